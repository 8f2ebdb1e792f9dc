"""GPU flash attention and rotary embedding (mambactl/ops/attention.py) against the float64 reference
(mambactl/reference/attention.py): lengths around the 64-row and 32-key tiles, head dims below, at and above
16 and 64, one and several heads, poisoned outputs."""

import numpy as np
import pytest

from mambactl.errors import ShapeError
from mambactl.ops.attention import attention, attention_backward, rope, rope_backward
from mambactl.reference import attention as ref

TOL = 1e-4


def make_inputs(shape, seed):
    """q, k, v, do float32; q scaled so scores spread over several units and the running max moves."""
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
    return 3 * q, k, v, do


def rel_err(got, want, floor):
    """‖got − want‖ / max(‖want‖, floor): `floor` stands in for a reference that is exactly zero. Poisoned
    (never written) elements are NaN and fail."""
    assert np.all(np.isfinite(got))
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), floor)


def run_gpu(gpu, q, k, v, do, causal=True):
    o, saved = attention(*(gpu.from_numpy(a) for a in (q, k, v)), causal)
    return [t.numpy() for t in (o, *attention_backward(saved, gpu.from_numpy(do)))]


def check(gpu, shape, causal=True, seed=0):
    q, k, v, do = make_inputs(shape, seed)
    got = run_gpu(gpu, q, k, v, do, causal)
    f64 = [a.astype(np.float64) for a in (q, k, v, do)]
    want = [ref.attention(*f64[:3], causal), *ref.attention_backward(*f64, causal)]
    # With one key the weights are constant and dq = dk = 0: then the error is measured against ‖do‖.
    floor = np.linalg.norm(do)
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, name
        err = rel_err(g, w, floor * 1e-3 if name == "o" else floor)
        assert err < TOL, (name, err)


# (B, L, H, Dh): every L in {1, 7, 64, 65, 130} and Dh in {4, 16, 64, 80}, heads 1 and 3; the pairs are
# spread so each head dim compiles once.
@pytest.mark.parametrize("shape", [(2, 1, 3, 16), (2, 7, 1, 4), (1, 7, 3, 80), (1, 64, 3, 16), (2, 65, 1, 64),
                                   (1, 65, 3, 4), (1, 130, 3, 64), (1, 130, 1, 80)], ids=str)
def test_causal_matches_reference(gpu, shape):
    check(gpu, shape)


def test_full_attention_matches_reference(gpu):
    check(gpu, (1, 70, 3, 16), causal=False)


def test_backward_is_deterministic(gpu):
    q, k, v, do = make_inputs((1, 97, 2, 16), seed=5)
    first, again = run_gpu(gpu, q, k, v, do), run_gpu(gpu, q, k, v, do)
    for name, a, b in zip(("o", "dq", "dk", "dv"), first, again):
        assert np.array_equal(a, b), f"{name} differs between identical runs"


@pytest.mark.parametrize("shape,base", [((2, 9, 3, 4), 10000.0), ((1, 130, 2, 80), 500.0)], ids=str)
def test_rope_matches_reference(gpu, shape, base):
    x = np.random.default_rng(6).standard_normal(shape).astype(np.float32)
    got, back = rope(gpu.from_numpy(x), base).numpy(), rope_backward(gpu.from_numpy(x), base).numpy()
    assert rel_err(got, ref.rope(x.astype(np.float64), base), 0) < 1e-5
    assert rel_err(back, ref.rope_backward(x.astype(np.float64), base), 0) < 1e-5


def test_shapes_are_checked_before_dispatch(gpu):
    ok = gpu.from_numpy(np.zeros((1, 4, 2, 8), np.float32))
    with pytest.raises(ShapeError, match="k has shape"):
        attention(ok, gpu.from_numpy(np.zeros((1, 4, 2, 6), np.float32)), ok)
    with pytest.raises(ShapeError, match=r"head dim in \[1, 128\]"):
        big = gpu.from_numpy(np.zeros((1, 2, 1, 129), np.float32))
        attention(big, big, big)
    with pytest.raises(ShapeError, match="even head dim"):
        rope(gpu.from_numpy(np.zeros((1, 2, 1, 5), np.float32)))
    _, saved = attention(ok, ok, ok)
    with pytest.raises(ShapeError, match="do has shape"):
        attention_backward(saved, gpu.from_numpy(np.zeros((1, 4, 2, 4), np.float32)))
