"""GPU Mamba-3 scan (mambactl/ops/mamba3_scan.py) against the float64 reference (mambactl/reference/mamba3.py):
the chunked and the sequential forward, and the exact backward, SISO (R = 1) and MIMO (R > 1)."""

import numpy as np
import pytest

from mambactl.errors import ShapeError
from mambactl.ops.mamba3_scan import mamba3_scan, mamba3_scan_backward
from mambactl.reference import mamba3 as ref

NAMES = ("q", "k", "v", "adt", "dt", "lam")
GRADS = ("dq", "dk", "dv", "dadt", "ddt", "dlam")


def make_inputs(batch, length, heads, rank, nstate, headdim, seed=0):
    """Float32 inputs in the block's ranges: Δ > 0, A·Δ < 0, λ in (0, 1)."""
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    dt = (0.1 + rng.random((batch, length, heads))).astype(np.float32)
    A = -(0.2 + rng.random((batch, length, heads))).astype(np.float32)
    return dict(q=normal(batch, length, heads, rank, nstate, scale=0.5),
                k=normal(batch, length, heads, rank, nstate, scale=0.5),
                v=normal(batch, length, heads, rank, headdim), adt=(A * dt).astype(np.float32), dt=dt,
                lam=rng.random((batch, length, heads)).astype(np.float32))


def rel_err(got, want):
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def run_gpu(rt, x, dy, chunk):
    y, saved = mamba3_scan(*(rt.from_numpy(x[k]) for k in NAMES), chunk=chunk)
    grads = mamba3_scan_backward(saved, rt.from_numpy(dy))
    return y.numpy(), [g.numpy() for g in grads], saved


@pytest.mark.parametrize("batch,length,heads,rank,nstate,headdim,chunk", [
    (1, 1, 2, 1, 4, 3, 8),     # one step
    (2, 5, 3, 1, 8, 4, 2),     # SISO, several chunks, L not a multiple of the chunk
    (1, 33, 2, 1, 6, 5, 16),   # SISO
    (2, 33, 2, 2, 8, 4, 8),    # MIMO rank 2
    (1, 70, 2, 4, 4, 3, 32),   # MIMO rank 4
    (1, 70, 1, 1, 16, 2, 100), # one chunk longer than L
])
def test_matches_reference(gpu, batch, length, heads, rank, nstate, headdim, chunk):
    x = make_inputs(batch, length, heads, rank, nstate, headdim)
    dy = np.random.default_rng(1).standard_normal((batch, length, heads, rank, headdim)).astype(np.float32)
    y, grads, _ = run_gpu(gpu, x, dy, chunk)
    x64 = [x[k].astype(np.float64) for k in NAMES]
    y_ref = ref.mamba3_scan(*x64, chunk_size=8)
    np.testing.assert_allclose(ref.mamba3_scan_sequential(*x64), y_ref, rtol=1e-9, atol=1e-9)
    assert rel_err(y, y_ref) < 1e-4, rel_err(y, y_ref)
    grads_ref = ref.mamba3_scan_backward(*x64, dy.astype(np.float64))
    for name, got, want in zip(GRADS, grads, grads_ref):
        assert got.shape == want.shape, name
        assert rel_err(got, want) < 1e-4, (name, rel_err(got, want))


def test_deterministic_and_chunk_independent(gpu):
    x = make_inputs(2, 40, 2, 2, 8, 4, seed=2)
    dy = np.random.default_rng(3).standard_normal((2, 40, 2, 2, 4)).astype(np.float32)
    y1, g1, _ = run_gpu(gpu, x, dy, chunk=8)
    y2, g2, _ = run_gpu(gpu, x, dy, chunk=8)
    assert np.array_equal(y1, y2)
    for name, a, b in zip(GRADS, g1, g2):
        assert np.array_equal(a, b), f"{name} differs between identical runs"
    y3, g3, _ = run_gpu(gpu, x, dy, chunk=40)
    assert rel_err(y3, y1) < 1e-5
    for name, a, b in zip(GRADS, g3, g1):
        assert rel_err(a, b) < 1e-5, name


def test_saved_states_are_chunk_boundaries_only(gpu):
    batch, length, heads, rank, nstate, headdim, chunk = 1, 50, 2, 1, 4, 3, 16
    x = make_inputs(batch, length, heads, rank, nstate, headdim)
    _, saved = mamba3_scan(*(gpu.from_numpy(x[k]) for k in NAMES), chunk=chunk)
    n_chunks = -(-length // chunk)
    assert saved.states.shape == (batch, n_chunks, heads, headdim, nstate)
    inputs = {id(getattr(saved, k).buffer) for k in NAMES}
    extra = sum(t.size for t in vars(saved).values() if hasattr(t, "buffer") and id(t.buffer) not in inputs)
    assert extra == batch * heads * headdim * nstate * (n_chunks + 1)


def test_shape_errors(gpu):
    x = {k: gpu.from_numpy(v) for k, v in make_inputs(1, 4, 2, 1, 3, 2).items()}
    args = [x[k] for k in NAMES]
    with pytest.raises(ShapeError, match="k has shape"):
        mamba3_scan(args[0], gpu.from_numpy(np.zeros((1, 4, 2, 1, 5), np.float32)), *args[2:])
    with pytest.raises(ShapeError, match="lam has shape"):
        mamba3_scan(*args[:5], gpu.from_numpy(np.zeros((1, 4, 3), np.float32)))
    with pytest.raises(ShapeError, match="chunk"):
        mamba3_scan(*args, chunk=0)
    _, saved = mamba3_scan(*args)
    with pytest.raises(ShapeError, match="dy has shape"):
        mamba3_scan_backward(saved, gpu.from_numpy(np.zeros((1, 4, 2, 1, 3), np.float32)))
