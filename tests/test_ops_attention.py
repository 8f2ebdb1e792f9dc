"""GPU flash attention and rotary embedding (mambactl/ops/attention.py) against the float64 reference
(mambactl/reference/attention.py): lengths around the 64-row and 32-key tiles, head dims below, at and above
16 and 64, one and several heads, poisoned outputs. The decoding step (KV cache): cache lengths around its
256-position chunks' edges, rotary on and off, growth when full, the device limit."""

import numpy as np
import pytest

from mambactl.errors import ShapeError
from mambactl.ops import attention as ops_attention
from mambactl.ops.attention import attention, attention_backward, attention_step, kv_cache, rope, rope_backward
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


def step_inputs(batch, length, heads, head_dim, seed):
    """A cache of `length` positions (k, v [B, T, H, Dh]) and one new token's q | k | v rows, float32; q
    scaled so the scores spread over several units."""
    rng = np.random.default_rng(seed)
    k, v = (rng.standard_normal((batch, length, heads, head_dim)).astype(np.float32) for _ in range(2))
    row = rng.standard_normal((batch, 3 * heads * head_dim)).astype(np.float32)
    row[:, : heads * head_dim] *= 3
    return k, v, row


def check_step(gpu, cache, k, v, row, heads, rope_base):
    """One GPU step against the reference; returns the reference's grown (k, v) cache."""
    f64 = lambda a: a.astype(np.float64)
    got = attention_step(gpu.from_numpy(row), cache, rope_base).numpy()
    want, k, v = ref.attention_step(f64(row), k, v, heads, rope_base)
    assert rel_err(got, want, 0) < 1e-5
    assert cache.length == k.shape[1]
    assert rel_err(cache.k.numpy()[:, : cache.length], k, 0) < 1e-5
    assert np.array_equal(cache.v.numpy()[:, : cache.length], v)
    return k, v


# A cache of 1, 3, 17 or 65 positions gets one more; the (head dim, rope) pairs each compile once.
@pytest.mark.parametrize("length", [1, 3, 17, 65])
@pytest.mark.parametrize("head_dim,rope_base", [(8, None), (8, 10000.0), (16, None), (16, 500.0), (32, None),
                                                (32, 10000.0)], ids=str)
def test_step_matches_reference(gpu, length, head_dim, rope_base):
    heads = 3
    k, v, row = step_inputs(2, length, heads, head_dim, seed=length)
    cache = kv_cache(gpu.from_numpy(k), gpu.from_numpy(v))
    check_step(gpu, cache, k.astype(np.float64), v.astype(np.float64), row, heads, rope_base)


def test_step_over_chunks_and_growth(gpu, monkeypatch):
    """A small initial capacity doubles twice while 300 positions pass the kernel's 256-position chunks."""
    monkeypatch.setattr(ops_attention, "CACHE_CHUNK", 2)
    heads, head_dim = 2, 16
    k, v, _ = step_inputs(1, 3, heads, head_dim, seed=9)
    cache = kv_cache(gpu.from_numpy(k), gpu.from_numpy(v))
    capacities = {cache.capacity}
    k, v = k.astype(np.float64), v.astype(np.float64)
    for t in range(3, 300):
        row = step_inputs(1, 1, heads, head_dim, seed=t)[2]
        if t in (3, 5, 6, 7, 12, 13, 24, 25, 255, 256, 257, 299):  # around capacities and chunk edges
            k, v = check_step(gpu, cache, k, v, row, heads, 10000.0)
        else:
            attention_step(gpu.from_numpy(row), cache, 10000.0)
            k, v = ref.attention_step(row.astype(np.float64), k, v, heads, 10000.0)[1:]
        capacities.add(cache.capacity)
    assert sorted(capacities)[:3] == [6, 12, 24] and cache.length == 300


def test_step_reports_the_device_limit(gpu, monkeypatch):
    """A cache that would pass the storage binding limit stops with a one-line ShapeError and keeps its positions."""
    monkeypatch.setattr(ops_attention, "CACHE_CHUNK", 2)
    heads, head_dim = 1, 8
    seven, nine = (gpu.from_numpy(np.zeros((1, n, heads, head_dim), np.float32)) for n in (7, 9))
    monkeypatch.setattr(gpu, "max_binding", 8 * heads * head_dim * 4)  # 8 positions of one sequence
    k, v, row = step_inputs(1, 3, heads, head_dim, seed=3)
    cache = kv_cache(gpu.from_numpy(k), gpu.from_numpy(v))
    for _ in range(5):
        attention_step(gpu.from_numpy(row), cache)
    assert (cache.length, cache.capacity) == (8, 8)
    with pytest.raises(ShapeError, match=r"attention_step: a KV cache of 9 positions .*\(at most 8 positions\)") as e:
        attention_step(gpu.from_numpy(row), cache)
    assert "\n" not in str(e.value) and cache.length == 8
    assert kv_cache(seven, seven).capacity == 8  # the room after a prompt stops at the limit
    with pytest.raises(ShapeError, match=r"kv_cache: a KV cache of 9 positions .*\(at most 8 positions\)"):
        kv_cache(nine, nine)


def test_step_shapes_are_checked_before_dispatch(gpu):
    k = gpu.from_numpy(np.zeros((2, 3, 2, 5), np.float32))
    cache = kv_cache(k, k)
    with pytest.raises(ShapeError, match="qkv has shape"):
        attention_step(gpu.from_numpy(np.zeros((2, 20), np.float32)), cache)
    with pytest.raises(ShapeError, match="even head dim"):
        attention_step(gpu.from_numpy(np.zeros((2, 30), np.float32)), cache, 10000.0)
    with pytest.raises(ShapeError, match="v has shape"):
        kv_cache(k, gpu.from_numpy(np.zeros((2, 4, 2, 5), np.float32)))
    assert cache.length == 3


def test_step_softmax_is_stable_for_large_scores(gpu):
    """Scores up to ~270 in size (exp overflows float32 past 88) still give the reference's output."""
    heads, head_dim = 2, 16
    k, v, row = step_inputs(2, 40, heads, head_dim, seed=4)
    row[:, : heads * head_dim] *= 30
    cache = kv_cache(gpu.from_numpy(k), gpu.from_numpy(v))
    check_step(gpu, cache, k.astype(np.float64), v.astype(np.float64), row, heads, None)
