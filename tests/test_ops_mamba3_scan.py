"""GPU Mamba-3 scan (mambactl/ops/mamba3_scan.py) against the float64 reference (mambactl/reference/mamba3.py):
the chunked and the sequential forward, and the exact backward, SISO (R = 1) and MIMO (R > 1)."""

import numpy as np
import pytest

from mambactl.errors import ShapeError
from mambactl.ops import checks
from mambactl.ops.mamba3_scan import (BACKWARD_THREADS, BWD_CHANNELS, FWD_CHANNELS, FWD_TILES, TILE_N,
                                      backward_adjoint_loops_per_step, backward_buffers, forward_loops_per_step,
                                      forward_tile, mamba3_scan, mamba3_scan_backward)
from mambactl.ops.ssd import MAX_CHUNK
from mambactl.reference import mamba3 as ref

NAMES = ("q", "k", "v", "adt", "dt", "lam")
GRADS = ("dq", "dk", "dv", "dadt", "ddt", "dlam")


def make_inputs(batch, length, heads, rank, nstate, headdim, seed=0, lam_mode="random", decay=1.0):
    """Float32 inputs in the block's ranges: Δ > 0, A·Δ < 0 (times `decay`), λ in (0, 1) ("near0" / "near1":
    within 1e-6 of 0 or 1)."""
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    dt = (0.1 + rng.random((batch, length, heads))).astype(np.float32)
    A = -(0.2 + rng.random((batch, length, heads))).astype(np.float32)
    lam = rng.random((batch, length, heads))
    lam = {"random": lam, "near0": 1e-6 * lam, "near1": 1 - 1e-6 * lam}[lam_mode]
    return dict(q=normal(batch, length, heads, rank, nstate, scale=0.5),
                k=normal(batch, length, heads, rank, nstate, scale=0.5),
                v=normal(batch, length, heads, rank, headdim), adt=(decay * A * dt).astype(np.float32), dt=dt,
                lam=lam.astype(np.float32))


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
    # the backward's blocks: value channels past one workgroup (BACKWARD_THREADS = 64) and not a multiple of it,
    # several state tiles (TILE_N = 16) with a partial last one, several reduction passes (one per rank)
    (1, 9, 2, 1, 40, 80, 4),   # P = 80: a full and a partial p-block; N = 40: tiles of 16 + 16 + 8
    (2, 11, 1, 3, 70, 67, 4),  # MIMO rank 3, five tiles, P = 67
    (1, 6, 1, 16, 33, 17, 4),  # the largest rank: 2·16·16 + 3 outputs per step
    (1, 5, 1, 1, 128, 130, 2), # the largest N, three p-blocks
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


@pytest.mark.parametrize("batch,length,heads,nstate,headdim,chunk,start,extra", [
    (2, 33, 3, 6, 5, 16, 3, 2),    # scalar loads (odd P, stride, first column)
    (1, 72, 2, 16, 8, 64, 8, 4),   # vec4 loads
    (1, 72, 2, 16, 8, 64, 6, 1),   # vec4 shape, v and dv rows not (stride 23, as the tiny model's 298): copied
])
def test_siso_skip_and_v_in_place(gpu, batch, length, heads, nstate, headdim, chunk, start, extra):
    """SISO as the block runs it: v read from columns [start, start + H·P) of a wider matrix, the skip D v added
    in the core, dv (with D dy) written into another matrix's columns and ∂D added into dD; against float64."""
    x = make_inputs(batch, length, heads, 1, nstate, headdim, seed=3)
    rng = np.random.default_rng(4)
    D = rng.standard_normal(heads).astype(np.float32)
    dy = rng.standard_normal((batch, length, heads, 1, headdim)).astype(np.float32)
    width = start + heads * headdim + extra
    wide = rng.standard_normal((batch, length, width)).astype(np.float32)
    wide[:, :, start:start + heads * headdim] = x["v"].reshape(batch, length, -1)
    t = {k: gpu.from_numpy(v) for k, v in x.items()}
    rest = [t[k] for k in ("adt", "dt", "lam")]
    y, saved = mamba3_scan(t["q"], t["k"], gpu.from_numpy(wide), *rest, chunk=chunk, D=gpu.from_numpy(D),
                           v_start=start, headdim=headdim)
    dv_wide = gpu.from_numpy(np.full((batch, length, width), np.nan, np.float32))
    dD0 = np.array(rng.standard_normal(heads), np.float32)
    dD = gpu.from_numpy(dD0)
    grads = mamba3_scan_backward(saved, gpu.from_numpy(dy), dD=dD, dv_out=(dv_wide, start))
    assert grads[2] is dv_wide
    x64 = [x[k].astype(np.float64) for k in NAMES]
    v64, dy64 = x64[2], dy.astype(np.float64)
    y_ref = ref.mamba3_scan(*x64, chunk_size=8) + D[:, None, None] * v64
    assert rel_err(y.numpy(), y_ref) < 1e-4
    want = list(ref.mamba3_scan_backward(*x64, dy64))
    want[2] = want[2] + D[:, None, None] * dy64
    got_dv = dv_wide.numpy()
    assert np.all(np.isnan(got_dv[:, :, :start])) and np.all(np.isnan(got_dv[:, :, start + heads * headdim:]))
    got = [g.numpy() for g in grads]
    got[2] = got_dv[:, :, start:start + heads * headdim].reshape(want[2].shape)
    for name, g, w in zip(GRADS, got, want):
        assert rel_err(g.reshape(w.shape), w) < 1e-4, (name, rel_err(g.reshape(w.shape), w))
    dD_want = dD0 + np.sum(dy64 * v64, axis=(0, 1, 3, 4))
    assert rel_err(dD.numpy(), dD_want) < 1e-5
    with pytest.raises(ShapeError, match="dD is missing"):
        mamba3_scan_backward(saved, gpu.from_numpy(dy))
    with pytest.raises(ShapeError, match="D is for SISO"):
        m = make_inputs(1, 4, 2, 2, 4, 3)
        mamba3_scan(*(gpu.from_numpy(m[k]) for k in NAMES), D=gpu.from_numpy(np.ones(2, np.float32)))


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


@pytest.mark.parametrize("rank", [1, 2])
def test_saved_states_are_chunk_boundaries_only(gpu, rank):
    """What the forward keeps besides references to its inputs: the state entering each chunk and the last one
    (and for SISO the SSD core's input scale and diagonal weight, one number each per step and head, its in-chunk
    decay sums and its C Bᵀ = q kᵀ per chunk, which its backward reuses)."""
    batch, length, heads, nstate, headdim, chunk = 1, 50, 2, 4, 3, 16
    x = make_inputs(batch, length, heads, rank, nstate, headdim)
    _, saved = mamba3_scan(*(gpu.from_numpy(x[k]) for k in NAMES), chunk=chunk)
    n_chunks = -(-length // chunk)
    assert saved.states.shape == (batch, n_chunks, heads, headdim, nstate)
    assert (saved.core is not None) == (rank == 1)
    inputs = {id(getattr(saved, k).buffer) for k in NAMES}
    kept = {id(t.buffer): t.size for obj in (saved, saved.core) if obj is not None for t in vars(obj).values()
            if hasattr(t, "buffer") and id(t.buffer) not in inputs}
    core = 0
    if rank == 1:
        core = 2 * batch * length * heads + batch * heads * n_chunks * (6 * chunk + chunk * chunk)
    assert sum(kept.values()) == batch * heads * headdim * nstate * (n_chunks + 1) + core


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


def test_backward_transients_do_not_scale_with_headdim_state_and_length(gpu, monkeypatch):
    """No tensor of B·L·H·P·R·N elements (the old per-channel dq / dk partials): the backward's largest new
    tensor is a chunk of states or dv / dq-sized, whatever L is."""
    batch, length, heads, rank, nstate, headdim, chunk = 1, 32, 2, 2, 40, 70, 4
    x = make_inputs(batch, length, heads, rank, nstate, headdim)
    dy = np.random.default_rng(1).standard_normal((batch, length, heads, rank, headdim)).astype(np.float32)
    _, saved = mamba3_scan(*(gpu.from_numpy(x[k]) for k in NAMES), chunk=chunk)
    dyt = gpu.from_numpy(dy)
    sizes = []
    real_empty = gpu.empty

    def empty(shape, *args, **kwargs):
        sizes.append(int(np.prod(shape)))
        return real_empty(shape, *args, **kwargs)

    monkeypatch.setattr(gpu, "empty", empty)
    grads = [g.numpy() for g in mamba3_scan_backward(saved, dyt)]
    monkeypatch.undo()
    tiles = -(-nstate // TILE_N)
    bound = max(batch * heads * chunk * BWD_CHANNELS * tiles * TILE_N,  # one chunk of states (one p-block, padded)
                batch * length * heads * rank * headdim * tiles,     # dv per state tile
                batch * length * heads * rank * nstate)              # dq, dk
    assert sizes and max(sizes) <= bound, (max(sizes), bound)
    assert max(sizes) * 8 <= batch * length * heads * headdim * rank * nstate
    grads_ref = ref.mamba3_scan_backward(*(x[k].astype(np.float64) for k in NAMES), dy.astype(np.float64))
    for name, got, want in zip(GRADS, grads, grads_ref):
        assert rel_err(got, want) < 1e-4, (name, rel_err(got, want))


def test_backward_plan_fits_the_130m_training_shape():
    """mamba-130m training (d_model 768: 24 heads of 64, d_state 128, L 1024, batch 8): every tensor the
    backward allocates stays far under a 4 GB buffer (the old per-channel partials were 6.4 GB each)."""
    batch, length, heads, rank, nstate, headdim, chunk = 8, 1024, 24, 1, 128, 64, 64
    plan = backward_buffers(batch, length, heads, rank, nstate, headdim, chunk)
    outputs = [(batch, length, heads, rank, nstate), (batch, length, heads, rank, headdim)]
    nbytes = {name: 4 * int(np.prod(shape)) for name, shape in list(plan.items()) + list(enumerate(outputs))}
    assert max(nbytes.values()) <= 512 * 2**20, nbytes
    assert sum(nbytes.values()) < 2**30, nbytes
    assert BACKWARD_THREADS <= 256


@pytest.mark.parametrize("batch,length,heads,rank,nstate,headdim,chunk,segment", [
    (2, 33, 2, 2, 8, 4, 8, 3),      # segments not dividing the chunk, chunks not dividing L
    (1, 20, 1, 1, 40, 80, 16, 5),   # two p-blocks, two state tiles
    (1, 9, 1, 3, 6, 5, 100, 1),     # one step per dispatch, one chunk longer than L
    (1, 37, 1, 3, 70, 40, 8, 7),    # MIMO R = 3 tiled forward: segments cutting its time tiles (5 steps)
    (1, 23, 1, 3, 100, 130, 8, 5),  # backward: three p-blocks of 64 (the last of 2), two column blocks (64 + 36)
])
def test_segmented_matches_one_dispatch(gpu, batch, length, heads, rank, nstate, headdim, chunk, segment):
    """The dispatch segments that Mesa llvmpipe's loop budget needs (the carried state in last_state / g_carry)
    give bit-identical results to one dispatch, and match the reference."""
    x = make_inputs(batch, length, heads, rank, nstate, headdim, seed=4)
    dy = np.random.default_rng(5).standard_normal((batch, length, heads, rank, headdim)).astype(np.float32)
    args = [gpu.from_numpy(x[k]) for k in NAMES]
    y1, saved1 = mamba3_scan(*args, chunk=chunk, segment=10**6)
    g1 = mamba3_scan_backward(saved1, gpu.from_numpy(dy))
    y2, saved2 = mamba3_scan(*args, chunk=chunk, segment=segment)
    g2 = mamba3_scan_backward(saved2, gpu.from_numpy(dy), segment=segment)
    assert np.array_equal(y1.numpy(), y2.numpy())
    assert np.array_equal(saved1.last_state.numpy(), saved2.last_state.numpy())
    for name, a, b in zip(GRADS, g1, g2):
        assert np.array_equal(a.numpy(), b.numpy()), name
    x64 = [x[k].astype(np.float64) for k in NAMES]
    assert rel_err(y2.numpy(), ref.mamba3_scan_sequential(*x64)) < 1e-4
    for name, got, want in zip(GRADS, g2, ref.mamba3_scan_backward(*x64, dy.astype(np.float64))):
        assert rel_err(got.numpy(), want) < 1e-4, name


@pytest.mark.parametrize("batch,length,heads,rank,nstate,headdim,chunk", [
    (1, 23, 2, 3, 13, 33, 4),    # MIMO R = 3: tiles of 5 steps, L a multiple of neither; N = 13 over 8 state tiles
                                 # of 2 (the last one empty), P = 33: a full and a one-channel block of 32
    (2, 19, 1, 1, 70, 70, 8),    # SISO: N = 70 (tiles of 9, the last of 7), P = 70 (blocks 32 + 32 + 6)
    (1, 7, 1, 2, 3, 1, 3),       # N < 8 state tiles (five empty), one channel
    (1, 5, 1, 16, 128, 3, 2),    # one step's k, q overflow 16 KiB: the per-channel forward
])
def test_forward_tiles_match_reference(gpu, batch, length, heads, rank, nstate, headdim, chunk):
    """The tiled forward (FWD_CHANNELS channels × FWD_TILES state tiles per workgroup, time tiles of
    forward_tile(R, N) steps) and its fallback, against the reference, outputs poisoned by the fixture."""
    tile = forward_tile(rank, nstate)
    assert (tile == 0) == (rank == 16 and nstate == 128)
    assert FWD_CHANNELS * FWD_TILES <= 256
    x = make_inputs(batch, length, heads, rank, nstate, headdim, seed=6)
    dy = np.random.default_rng(7).standard_normal((batch, length, heads, rank, headdim)).astype(np.float32)
    y, grads, saved = run_gpu(gpu, x, dy, chunk)
    x64 = [x[k].astype(np.float64) for k in NAMES]
    assert rel_err(y, ref.mamba3_scan_sequential(*x64)) < 1e-4
    for name, got, want in zip(GRADS, grads, ref.mamba3_scan_backward(*x64, dy.astype(np.float64))):
        assert rel_err(got, want) < 1e-4, (name, rel_err(got, want))
    assert np.isfinite(saved.states.numpy()).all() and np.isfinite(saved.last_state.numpy()).all()


def test_walk_past_the_loop_budget(gpu):
    """A walk longer than Mesa llvmpipe's loop budget allows per invocation, forward and backward, with no forced
    segment: on llvmpipe the wrapper splits it into dispatches by itself (elsewhere one dispatch)."""
    batch, length, heads, rank, nstate, headdim = 1, 800, 1, 1, 4, 3
    assert length * forward_loops_per_step(rank, nstate) > checks.LOOP_BUDGET
    assert length * backward_adjoint_loops_per_step(rank, nstate) > checks.LOOP_BUDGET
    x = make_inputs(batch, length, heads, rank, nstate, headdim, seed=8)
    dy = np.random.default_rng(9).standard_normal((batch, length, heads, rank, headdim)).astype(np.float32)
    y, grads, _ = run_gpu(gpu, x, dy, chunk=64)
    x64 = [x[k].astype(np.float64) for k in NAMES]
    assert rel_err(y, ref.mamba3_scan_sequential(*x64)) < 1e-4
    for name, got, want in zip(GRADS, grads, ref.mamba3_scan_backward(*x64, dy.astype(np.float64))):
        assert rel_err(got, want) < 1e-4, (name, rel_err(got, want))


@pytest.mark.parametrize("batch,length,heads,rank,nstate,headdim,chunk", [
    (1, 13, 2, 3, 100, 130, 5),  # MIMO R = 3; N = 100: column blocks 64 + 36; P = 130: p-blocks 64 + 64 + 2
    (2, 9, 1, 2, 65, 65, 4),     # one column and one channel past a block
    (1, 7, 1, 1, 3, 1, 3),       # one channel, three columns: almost every element of the 64 × 64 block idle
    (1, 6, 1, 16, 128, 17, 4),   # the largest rank and N: 2·16 reduction barriers a step, no fallback needed
    (1, 70, 1, 1, 128, 64, 64),  # the 130m head (P 64, N 128), L past one chunk and not a multiple of it
])
def test_backward_blocks_match_reference(gpu, batch, length, heads, rank, nstate, headdim, chunk):
    """The backward's blocks (BACKWARD_THREADS threads, each 4 channels × 4 columns; BWD_CHANNELS channels walked
    in blocks, TILE_N columns per workgroup, partial last blocks) against the reference, outputs poisoned by the
    fixture, and bit-identical on a second run (fixed-order sums)."""
    assert BACKWARD_THREADS <= 256 and BACKWARD_THREADS * 16 == BWD_CHANNELS * TILE_N
    x = make_inputs(batch, length, heads, rank, nstate, headdim, seed=10)
    dy = np.random.default_rng(11).standard_normal((batch, length, heads, rank, headdim)).astype(np.float32)
    _, grads, _ = run_gpu(gpu, x, dy, chunk)
    _, again, _ = run_gpu(gpu, x, dy, chunk)
    x64 = [x[k].astype(np.float64) for k in NAMES]
    for name, got, want, second in zip(GRADS, grads, ref.mamba3_scan_backward(*x64, dy.astype(np.float64)), again):
        assert got.shape == want.shape, name
        assert rel_err(got, want) < 1e-4, (name, rel_err(got, want))
        assert np.array_equal(got, second), name


@pytest.mark.parametrize("batch,length,heads,nstate,headdim,chunk,lam_mode,decay", [
    (2, 37, 3, 8, 5, 16, "random", 1.0),   # L not a multiple of the chunk
    (1, 70, 2, 16, 4, 64, "random", 30.0), # strong decays: α down to e^-60 a step
    (2, 40, 2, 8, 4, 8, "near0", 1.0),     # λ ≈ 0: β carries everything, the diagonal weight is far from the scale
    (2, 40, 2, 8, 4, 8, "near1", 1.0),     # λ ≈ 1: Mamba-2 (δ ≈ 0)
    (1, 5, 1, 4, 3, 64, "random", 1.0),    # one chunk longer than L
    (1, 1030, 1, 4, 3, 2000, "random", 1.0),  # a chunk past the core's MAX_CHUNK: it runs min(chunk, MAX_CHUNK)
    (1, 130, 2, 128, 64, 64, "random", 1.0),  # the 130m head, L past two chunks
])
def test_siso_through_the_ssd_core(gpu, batch, length, heads, nstate, headdim, chunk, lam_mode, decay):
    """SISO runs the chunked SSD core with the fold's scale and diagonal weight: against the recurrent float64
    reference, forward, backward and the last state (h after the last step), outputs poisoned by the fixture."""
    x = make_inputs(batch, length, heads, 1, nstate, headdim, seed=12, lam_mode=lam_mode, decay=decay)
    dy = np.random.default_rng(13).standard_normal((batch, length, heads, 1, headdim)).astype(np.float32)
    y, grads, saved = run_gpu(gpu, x, dy, chunk)
    assert saved.core is not None and saved.chunk == min(chunk, length, MAX_CHUNK)
    x64 = [x[k].astype(np.float64) for k in NAMES]
    assert rel_err(y, ref.mamba3_scan_sequential(*x64)) < 1e-4, rel_err(y, ref.mamba3_scan_sequential(*x64))
    for name, got, want in zip(GRADS, grads, ref.mamba3_scan_backward(*x64, dy.astype(np.float64))):
        assert rel_err(got, want) < 1e-4, (name, rel_err(got, want))
    q, k, v, adt, dt, lam = x64
    h = np.zeros((batch, heads, headdim, nstate))
    for t in range(length):  # the recurrence's own h (zero state before the first token)
        prev = np.einsum("bhp,bhn->bhpn", v[:, t - 1, :, 0], k[:, t - 1, :, 0]) if t else 0.0
        h = (np.exp(adt[:, t])[..., None, None] * h + ((1 - lam[:, t]) * dt[:, t] * np.exp(adt[:, t]))[..., None, None]
             * prev + (lam[:, t] * dt[:, t])[..., None, None] * np.einsum("bhp,bhn->bhpn", v[:, t, :, 0], k[:, t, :, 0]))
    assert rel_err(saved.last_state.numpy(), h) < 1e-4
