"""GPU SSD scan (mambactl/ops/ssd.py) against the float64 reference (mambactl/reference/ssd.py): the core
`ssd_chunked` (adt, scale given directly) and Mamba-2's `ssd_scan` around it, composed with
Δ = clamp(softplus(dt_raw + dt_bias), dt_limit), A = −exp(A_log) and the D skip as mamba_ssm's Mamba2 does."""

import numpy as np
import pytest

from mambactl.errors import ShapeError
from mambactl.ops.checks import SEGMENT_BUDGET, cpu_subgroups
from mambactl.ops import ssd as ssd_op
from mambactl.ops.ssd import kernel_chunk, ssd_chunked, ssd_chunked_backward, ssd_scan, ssd_scan_backward, ssd_step
from mambactl.reference import ssd as ref
from mambactl.reference.activations import softplus, softplus_backward

NAMES = ("x", "dt_raw", "A_log", "B", "C", "D", "dt_bias")
GRADS = ("dx", "ddt_raw", "dA_log", "dB", "dC", "dD", "ddt_bias")


def make_inputs(batch, length, heads, headdim, groups, nstate, seed=0):
    """Float32 inputs: Δ ≈ 0.7, A in [-4, -1], and a few dt_raw > 20 (softplus's linear branch, Δ·A ≈ −50)."""
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    dt_raw = normal(batch, length, heads, scale=0.5)
    dt_raw.flat[::29] = 20.5 + rng.random(dt_raw.flat[::29].shape).astype(np.float32)
    return dict(x=normal(batch, length, heads, headdim), dt_raw=dt_raw,
                A_log=np.log(rng.uniform(1, 4, heads)).astype(np.float32),
                B=normal(batch, length, groups, nstate), C=normal(batch, length, groups, nstate), D=normal(heads),
                dt_bias=normal(heads, scale=0.3))


def reference(x, dy, chunk, dt_limit=(0.0, np.inf)):
    """Float64 y and gradients, in the order of GRADS."""
    x = {k: v.astype(np.float64) for k, v in x.items()}
    dy = dy.astype(np.float64)
    pre = x["dt_raw"] + x["dt_bias"]
    soft = softplus(pre)
    dt, A = np.clip(soft, *dt_limit), -np.exp(x["A_log"])
    args = (x["x"], dt, A, x["B"], x["C"])
    D = x["D"][:, None]
    y = ref.ssd(*args, chunk) + D * x["x"]
    dx, ddt, dA, dB, dC = ref.ssd_backward(*args, dy)
    ddt_raw = softplus_backward(pre, ddt * ((soft >= dt_limit[0]) & (soft <= dt_limit[1])))
    return y, (dx + D * dy, ddt_raw, dA * A, dB, dC, np.sum(dy * x["x"], axis=(0, 1, 3)), ddt_raw.sum(axis=(0, 1)))


def rel_err(got, want):
    assert np.all(np.isfinite(got))
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def run_gpu(rt, x, dy, chunk, grads=None, **kw):
    y, saved = ssd_scan(*(rt.from_numpy(x[k]) for k in NAMES), chunk=chunk, **kw)
    out = ssd_scan_backward(saved, rt.from_numpy(dy), grads)
    return y.numpy(), [g.numpy() for g in out], saved


def check(rt, batch, length, heads, headdim, groups, nstate, chunk, seed=0, tol=1e-4, **kw):
    x = make_inputs(batch, length, heads, headdim, groups, nstate, seed)
    dy = np.random.default_rng(seed + 1).standard_normal(x["x"].shape).astype(np.float32)
    y, grads, _ = run_gpu(rt, x, dy, chunk, **kw)
    y_ref, grads_ref = reference(x, dy, chunk, **{k: v for k, v in kw.items() if k == "dt_limit"})
    assert rel_err(y, y_ref) < tol, rel_err(y, y_ref)
    for name, got, want in zip(GRADS, grads, grads_ref):
        assert got.shape == want.shape, name
        assert rel_err(got, want) < tol, (name, rel_err(got, want))


@pytest.fixture(params=["ssd_tile", "ssd_tile_lanes"])
def engine(request, rt, monkeypatch):
    """Both tile engines on any adapter that has them (ssd_tile_lanes needs 8-lane subgroups: lavapipe's)."""
    if request.param == "ssd_tile_lanes" and not cpu_subgroups(rt):
        pytest.skip("ssd_tile_lanes needs 8-lane subgroups")
    monkeypatch.setattr(ssd_op, "FORCE_LANES", request.param == "ssd_tile_lanes")
    return request.param


LENGTHS = lambda c: [1, 5, c - 1, c, c + 1, 3 * c + 2]  # noqa: E731


@pytest.mark.parametrize("chunk,length,groups", [(c, n, 1 + i % 2) for c in (8, 16) for i, n in enumerate(LENGTHS(c))])
def test_matches_reference(rt, engine, chunk, length, groups):
    check(rt, 2, length, 4, 5, groups, 6, chunk)


@pytest.mark.parametrize("batch,length,heads,headdim,groups,nstate,chunk", [
    (1, 150, 2, 70, 1, 70, 72),   # P, N over one 64-wide tile; chunk of two row tiles and a partial sub-block
    (1, 300, 4, 16, 2, 16, 256),  # mamba_ssm's chunk: four row tiles, decays through many sub-blocks
    (1, 23, 6, 3, 3, 2, 1),       # chunk 1: every step is its own chunk, all work in the state passing
    # mamba2's P 64 and N 128 (two 64-wide column tiles of dB, dC and of U's pieces), two heads per group
    # (ssd_sum_heads); L 200: a last chunk of 8 steps, and the padded row / column blocks skipped.
    (2, 200, 4, 64, 2, 128, 64),
    (1, 50, 2, 64, 1, 128, 16),   # chunk 16: one sub-block per chunk, a partial last chunk
    # one head per group (dB, dC written directly, no head sum); N 65: a second column tile of one column;
    # chunk 256 with L 260: a full chunk of four row blocks, then a chunk of 4 steps.
    (1, 260, 3, 33, 3, 65, 256),
])
def test_tiles_and_chunk_shapes(rt, engine, batch, length, heads, headdim, groups, nstate, chunk):
    check(rt, batch, length, heads, headdim, groups, nstate, chunk)


def test_matches_the_sequential_recurrence(rt):
    x = make_inputs(1, 21, 2, 3, 1, 4, seed=5)
    y, _ = ssd_scan(*(rt.from_numpy(x[k]) for k in NAMES), chunk=8)
    f = {k: v.astype(np.float64) for k, v in x.items()}
    dt = softplus(f["dt_raw"] + f["dt_bias"])
    want = ref.ssd_sequential(f["x"], dt, -np.exp(f["A_log"]), f["B"], f["C"]) + f["D"][:, None] * f["x"]
    assert rel_err(y.numpy(), want) < 1e-5


def test_dt_limit_clamps_and_masks_the_gradient(rt):
    check(rt, 2, 19, 4, 3, 2, 5, 8, seed=3, dt_limit=(0.5, 1.0))


def test_deterministic_and_parameter_grads_accumulate(rt, engine):
    x = make_inputs(2, 37, 4, 5, 2, 6, seed=2)
    dy = np.random.default_rng(3).standard_normal(x["x"].shape).astype(np.float32)
    _, fresh, _ = run_gpu(rt, x, dy, 8)
    _, again, _ = run_gpu(rt, x, dy, 8)
    for name, a, b in zip(GRADS, fresh, again):
        assert np.array_equal(a, b), f"{name} differs between identical runs"
    rng = np.random.default_rng(4)
    start = {k: rng.standard_normal(4).astype(np.float32) for k in ("A_log", "D", "dt_bias")}
    acc = {k: rt.from_numpy(v) for k, v in start.items()}
    _, summed, _ = run_gpu(rt, x, dy, 8, grads=acc)
    by_name, fresh_by_name = dict(zip(GRADS, summed)), dict(zip(GRADS, fresh))
    for key in ("A_log", "D", "dt_bias"):
        np.testing.assert_allclose(by_name["d" + key], start[key] + fresh_by_name["d" + key], rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(acc[key].numpy(), by_name["d" + key])


@pytest.mark.parametrize("segment", [1, 2, 3])
def test_segmented_walks_are_bit_identical(rt, segment):
    """`segment` chunks per dispatch of the state passing (forward, backward) and the parameter partials (the
    split Mesa llvmpipe's loop budget takes on long sequences): the same bits as one dispatch, accumulating too."""
    x = make_inputs(2, 37, 4, 5, 2, 6, seed=2)
    dy = np.random.default_rng(3).standard_normal(x["x"].shape).astype(np.float32)
    start = {k: np.random.default_rng(4).standard_normal(4).astype(np.float32) for k in ("A_log", "D", "dt_bias")}
    runs = []
    for seg in (None, segment):
        acc = {k: rt.from_numpy(v) for k, v in start.items()}
        y, saved = ssd_scan(*(rt.from_numpy(x[k]) for k in NAMES), chunk=8, segment=seg)
        grads = ssd_scan_backward(saved, rt.from_numpy(dy), acc, segment=seg)
        runs.append([y.numpy(), saved.states.numpy(), saved.last_state.numpy()] + [g.numpy() for g in grads])
    for name, a, b in zip(("y", "states", "last_state") + GRADS, *runs):
        assert np.array_equal(a, b), name


def test_saved_state_is_chunk_boundaries_only(rt):
    batch, length, heads, headdim, groups, nstate, chunk = 2, 70, 4, 5, 2, 6, 16
    x = make_inputs(batch, length, heads, headdim, groups, nstate)
    y, saved = ssd_scan(*(rt.from_numpy(x[k]) for k in NAMES), chunk=chunk)
    n_chunks = -(-length // chunk)
    assert saved.states.shape == (batch, n_chunks, heads, headdim, nstate)
    assert saved.last_state.shape == (batch, heads, headdim, nstate)
    # Beyond references to the inputs and the output and the one decoding state: the chunk entry states, the
    # decay sums and C Bᵀ per chunk, Δ and Δ A: O(B·H·P·N·L / chunk + B·L·G·chunk), not the B·H·P·N·L states.
    kept = {id(getattr(saved, k).buffer) for k in NAMES + ("last_state",)} | {id(y.buffer)}
    tensors = list(vars(saved).values()) + list(vars(saved.core).values())
    extra = sum(t.size for t in {id(t.buffer): t for t in tensors if hasattr(t, "buffer")}.values()
                if id(t.buffer) not in kept)
    states = batch * heads * headdim * nstate * n_chunks
    decays = batch * heads * n_chunks * 6 * chunk
    cb = batch * n_chunks * groups * chunk * chunk
    assert extra == states + decays + cb + 2 * batch * length * heads
    assert extra <= batch * heads * headdim * nstate * (length / chunk + 1) + batch * (length + chunk) * groups * chunk \
        + 7 * batch * (length + chunk) * heads


def final_state(x, dt_limit=(0.0, np.inf)):
    """Float64 state after the last step by the plain recurrence: [b, h, p, n]."""
    f = {k: v.astype(np.float64) for k, v in x.items()}
    dt = np.clip(softplus(f["dt_raw"] + f["dt_bias"]), *dt_limit)
    decay = np.exp(dt * -np.exp(f["A_log"]))
    Bh = ref._heads(f["B"], f["x"].shape[2])
    state = np.zeros(f["x"].shape[:1] + f["x"].shape[2:] + f["B"].shape[-1:])
    for t in range(f["x"].shape[1]):
        state = decay[:, t, :, None, None] * state + (dt[:, t, :, None] * f["x"][:, t])[..., None] * Bh[:, t, :, None]
    return state


@pytest.mark.parametrize("length,chunk,groups,dt_limit", [
    (5, 8, 1, (0.0, np.inf)),  # one partial chunk
    (16, 8, 2, (0.0, np.inf)),  # whole chunks
    (19, 8, 2, (0.5, 1.0)),  # padding in the last chunk; a dt_limit that binds
    (7, 1, 1, (0.0, np.inf)),  # chunk 1: the final state is all state passing
])
@pytest.mark.parametrize("lanes,nstate", [(1, 5), (32, 5), (32, 37)])  # CPU adapters' walk; GPUs' tree, N past a lane each
def test_step_continues_the_parallel_scan(rt, monkeypatch, length, chunk, groups, dt_limit, lanes, nstate):
    """Prefill L steps, then ssd_step 3 more from saved.last_state: y equals the parallel scan over L + 3."""
    monkeypatch.setattr(ssd_op, "step_lanes", lambda _rt: lanes)
    batch, heads, headdim, extra = 2, 4, 3, 3
    x = make_inputs(batch, length + extra, heads, headdim, groups, nstate, seed=length)
    kw = dict(chunk=chunk, dt_limit=dt_limit)
    y_full, _ = ssd_scan(*(rt.from_numpy(x[k]) for k in NAMES), **kw)
    y_full = y_full.numpy()
    pre = {k: v[:, :length] if v.ndim > 1 else v for k, v in x.items()}
    y_pre, saved = ssd_scan(*(rt.from_numpy(pre[k]) for k in NAMES), **kw)
    state = saved.last_state
    assert rel_err(state.numpy(), final_state(pre, dt_limit)) < 1e-5
    assert rel_err(y_pre.numpy(), y_full[:, :length]) < 1e-5
    param = {k: rt.from_numpy(x[k]) for k in ("A_log", "D", "dt_bias")}
    junk = np.random.default_rng(length).standard_normal((batch, 9)).astype(np.float32)
    for t in range(length, length + extra):
        dt, dt_start = x["dt_raw"][:, t], None
        if t % 2:  # dt as columns [2, 2 + H) of wider rows (Mamba-2's in_proj output)
            dt, dt_start = np.concatenate([junk[:, :2], dt, junk[:, 2:]], axis=1), 2
        y = ssd_step(state, rt.from_numpy(x["x"][:, t].reshape(batch, -1)), rt.from_numpy(dt),
                     param["A_log"], rt.from_numpy(x["B"][:, t].reshape(batch, -1)),
                     rt.from_numpy(x["C"][:, t].reshape(batch, -1)), param["D"], param["dt_bias"], dt_limit=dt_limit,
                     dt_start=dt_start)
        assert y.shape == (batch, heads * headdim)
        assert rel_err(y.numpy().reshape(batch, heads, headdim), y_full[:, t]) < 1e-5, t
    assert rel_err(state.numpy(), final_state(x, dt_limit)) < 1e-5


def test_step_shape_errors(rt):
    state = rt.from_numpy(np.zeros((2, 4, 3, 5), np.float32))
    vec = rt.from_numpy(np.zeros(4, np.float32))
    x, dt = rt.from_numpy(np.zeros((2, 12), np.float32)), rt.from_numpy(np.zeros((2, 4), np.float32))
    bc = rt.from_numpy(np.zeros((2, 10), np.float32))
    with pytest.raises(ShapeError, match="x has shape"):
        ssd_step(state, rt.from_numpy(np.zeros((2, 11), np.float32)), dt, vec, bc, bc, vec, vec)
    with pytest.raises(ShapeError, match="groups|G·5"):
        bad = rt.from_numpy(np.zeros((2, 15), np.float32))
        ssd_step(state, x, dt, vec, bad, bad, vec, vec)
    with pytest.raises(ShapeError, match="C has shape"):
        ssd_step(state, x, dt, vec, bc, rt.from_numpy(np.zeros((2, 5), np.float32)), vec, vec)
    with pytest.raises(ShapeError, match=r"dt_raw columns \[3, 7\) outside its 6"):
        ssd_step(state, x, rt.from_numpy(np.zeros((2, 6), np.float32)), vec, bc, bc, vec, vec, dt_start=3)


def test_shape_errors(rt):
    x = {k: rt.from_numpy(v) for k, v in make_inputs(1, 4, 4, 2, 2, 3).items()}
    args = [x[k] for k in NAMES]
    with pytest.raises(ShapeError, match="groups must divide"):
        bad = rt.from_numpy(np.zeros((1, 4, 3, 3), np.float32))
        ssd_scan(*args[:3], bad, bad, *args[5:])
    with pytest.raises(ShapeError, match="C has shape"):
        ssd_scan(*args[:4], rt.from_numpy(np.zeros((1, 4, 2, 5), np.float32)), *args[5:])
    with pytest.raises(ShapeError, match="chunk"):
        ssd_scan(*args, chunk=2048)
    with pytest.raises(ShapeError, match="dt_bias has shape"):
        ssd_scan(*args[:6], rt.from_numpy(np.zeros(3, np.float32)))
    _, saved = ssd_scan(*args, chunk=2)
    with pytest.raises(ShapeError, match="dy has shape"):
        ssd_scan_backward(saved, rt.from_numpy(np.zeros((1, 4, 4, 3), np.float32)))
    with pytest.raises(ShapeError, match="grads lacks"):
        ssd_scan_backward(saved, rt.from_numpy(np.zeros((1, 4, 4, 2), np.float32)), {"D": x["D"]})


# --- the core ------------------------------------------------------------------------------------------------------
CORE = ("dx", "dadt", "dscale", "dB", "dC", "dD", "ddiag")


def core_inputs(batch, length, heads, headdim, groups, nstate, seed=0, strong=False):
    """Float32 core inputs: adt ≤ 0 (strong: every 7th step ≈ −40, so a chunk's decay sums reach thousands) and
    a scale of either sign, unrelated to adt (as Mamba-3's)."""
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    adt = -np.abs(normal(batch, length, heads, scale=0.6))
    if strong:
        adt.flat[::7] = -40.0 * rng.random(adt.flat[::7].shape).astype(np.float32)
    return dict(x=normal(batch, length, heads, headdim), adt=adt, scale=normal(batch, length, heads),
                B=normal(batch, length, groups, nstate), C=normal(batch, length, groups, nstate), D=normal(heads),
                diag=normal(batch, length, heads))


def check_core(rt, batch, length, heads, headdim, groups, nstate, chunk, seed=0, strong=False, with_d=True,
               tol=1e-4, with_diag=False):
    x = core_inputs(batch, length, heads, headdim, groups, nstate, seed, strong)
    dy = np.random.default_rng(seed + 1).standard_normal(x["x"].shape).astype(np.float32)
    names = ("x", "adt", "scale", "B", "C")
    D = rt.from_numpy(x["D"]) if with_d else None
    diag = rt.from_numpy(x["diag"]) if with_diag else None
    y, saved = ssd_chunked(*(rt.from_numpy(x[k]) for k in names), D, chunk=chunk, diag=diag)
    grads = ssd_chunked_backward(saved, rt.from_numpy(dy))
    f = {k: v.astype(np.float64) for k, v in x.items()}
    args = [f[k] for k in names]
    Dref = f["D"] if with_d else None
    diag_ref = f["diag"] if with_diag else None
    y_ref = ref.ssd_chunked(*args, chunk, Dref, diag_ref)
    grads_ref = ref.ssd_chunked_backward(*args, dy.astype(np.float64), Dref, diag_ref)
    assert rel_err(y.numpy(), y_ref) < tol, rel_err(y.numpy(), y_ref)
    assert saved.last_state.shape == (batch, heads, headdim, nstate)
    for name, got, want in zip(CORE, grads, grads_ref):
        if want is None:
            assert got is None, name
            continue
        assert got.shape == want.shape, name
        assert rel_err(got.numpy(), want) < tol, (name, rel_err(got.numpy(), want))


@pytest.mark.parametrize("batch,length,heads,headdim,groups,nstate,chunk,strong", [
    (2, 37, 4, 5, 1, 6, 8, False),     # G = 1: all heads share B and C; a partial last chunk
    (2, 37, 4, 5, 4, 6, 8, True),      # G = H (Mamba-3: a k and q per head); strong decays
    (1, 45, 6, 7, 2, 9, 16, True),     # 1 < G < H
    (1, 150, 3, 64, 3, 128, 64, True),  # Mamba-3's P 64, N 128, chunk 64, G = H; L past two chunks
    (2, 200, 4, 64, 1, 128, 128, False),  # mamba2's P, N at G = 1, two row tiles a chunk, a partial last one
    (1, 40, 20, 4, 1, 4, 16, True),    # 20 heads a group: dCB in 7 planes of 3 heads, the last of 2
])
def test_core_matches_reference(rt, engine, batch, length, heads, headdim, groups, nstate, chunk, strong):
    check_core(rt, batch, length, heads, headdim, groups, nstate, chunk, strong=strong)


def test_core_without_d(rt, engine):
    check_core(rt, 2, 21, 4, 3, 2, 5, 8, seed=4, strong=True, with_d=False)


@pytest.mark.parametrize("batch,length,heads,headdim,groups,nstate,chunk,with_d", [
    (2, 37, 4, 5, 4, 6, 8, False),      # G = H as Mamba-3, a partial last chunk, scalar loads
    (1, 150, 3, 64, 3, 128, 64, False),  # Mamba-3's P 64, N 128, chunk 64
    (2, 200, 4, 64, 1, 128, 128, True),  # two row tiles a chunk (diagonal on both), D too, heads sharing a group
    (1, 45, 6, 7, 2, 9, 16, True),
])
def test_core_with_diag(rt, engine, batch, length, heads, headdim, groups, nstate, chunk, with_d):
    """A diagonal weight (step t's own term in y_t weighted by diag_t, not scale_t): Mamba-3 SISO's form."""
    check_core(rt, batch, length, heads, headdim, groups, nstate, chunk, seed=8, strong=True, with_d=with_d,
               with_diag=True)


@pytest.mark.parametrize("batch,length,heads,headdim,groups,nstate,chunk,start,extra", [
    (2, 37, 4, 5, 4, 6, 8, 3, 2),        # scalar loads: P, the row stride and the first column odd
    (1, 150, 3, 64, 3, 128, 64, 8, 12),  # Mamba-3's P, N and chunk with vec4 loads: stride and column multiples of 4
    (2, 45, 6, 8, 2, 12, 16, 4, 0),      # x's columns the matrix's last ones
    (2, 48, 6, 8, 2, 12, 16, 2, 1),      # a shape for vec4 loads, x and dx rows not (stride 51, first column 2): copied
])
def test_core_reads_x_and_writes_dx_in_place(rt, engine, batch, length, heads, headdim, groups, nstate, chunk,
                                             start, extra):
    """x read as columns [start, start + H·P) of a wider matrix (x_start) and dx written into those of another
    (dx_out): the same bits as the contiguous call, with D and the diagonal weight (Mamba-3 SISO's form), and
    nothing else of dx_out written (NaN-poisoned). The contiguous call is checked against float64 too."""
    x = core_inputs(batch, length, heads, headdim, groups, nstate, seed=11, strong=True)
    dy = rt.from_numpy(np.random.default_rng(12).standard_normal(x["x"].shape).astype(np.float32))
    rng = np.random.default_rng(13)
    width = start + heads * headdim + extra
    wide = rng.standard_normal((batch, length, width)).astype(np.float32)
    wide[:, :, start:start + heads * headdim] = x["x"].reshape(batch, length, -1)
    t = {k: rt.from_numpy(v) for k, v in x.items()}
    rest = [t[k] for k in ("adt", "scale", "B", "C")]
    y0, s0 = ssd_chunked(t["x"], *rest, t["D"], chunk=chunk, diag=t["diag"])
    g0 = ssd_chunked_backward(s0, dy)
    y1, s1 = ssd_chunked(rt.from_numpy(wide), *rest, t["D"], chunk=chunk, diag=t["diag"], x_start=start,
                         headdim=headdim)
    dx_host = np.full((batch, length, width), np.nan, np.float32)
    dx_wide = rt.from_numpy(dx_host)
    g1 = ssd_chunked_backward(s1, dy, dx_out=(dx_wide, start))
    assert g1[0] is dx_wide
    np.testing.assert_array_equal(y1.numpy(), y0.numpy())
    got = dx_wide.numpy()
    np.testing.assert_array_equal(got[:, :, start:start + heads * headdim].reshape(x["x"].shape), g0[0].numpy())
    assert np.all(np.isnan(got[:, :, :start])) and np.all(np.isnan(got[:, :, start + heads * headdim:]))
    for name, a, b in zip(CORE[1:], g0[1:], g1[1:]):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=name)
    f = {k: v.astype(np.float64) for k, v in x.items()}
    args = [f[k] for k in ("x", "adt", "scale", "B", "C")]
    assert rel_err(y0.numpy(), ref.ssd_chunked(*args, chunk, f["D"], f["diag"])) < 1e-4
    want = ref.ssd_chunked_backward(*args, dy.numpy().astype(np.float64), f["D"], f["diag"])
    for name, got_t, w in zip(CORE, g0, want):
        assert rel_err(got_t.numpy(), w) < 1e-4, name
    with pytest.raises(ShapeError, match="x columns"):
        ssd_chunked(rt.from_numpy(wide), *rest, x_start=start + extra + 1, headdim=headdim)
    with pytest.raises(ShapeError, match="dx_out columns"):
        ssd_chunked_backward(s1, dy, dx_out=(dx_wide, start + extra + 1))


def test_core_dd_accumulates_and_shape_errors(rt):
    x = core_inputs(1, 9, 2, 3, 1, 4, seed=6)
    names = ("x", "adt", "scale", "B", "C")
    t = {k: rt.from_numpy(v) for k, v in x.items()}
    dy = rt.from_numpy(np.random.default_rng(7).standard_normal(x["x"].shape).astype(np.float32))
    _, saved = ssd_chunked(*(t[k] for k in names), t["D"], chunk=4)
    fresh = ssd_chunked_backward(saved, dy)[5].numpy()
    start = np.array([0.25, -1.5], np.float32)
    acc = rt.from_numpy(start)
    out = ssd_chunked_backward(saved, dy, {"D": acc})[5]
    np.testing.assert_allclose(out.numpy(), start + fresh, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(acc.numpy(), out.numpy())
    with pytest.raises(ShapeError, match="ssd_chunked: scale has shape"):
        ssd_chunked(t["x"], t["adt"], rt.from_numpy(np.zeros((1, 9, 3), np.float32)), t["B"], t["C"])
    with pytest.raises(ShapeError, match="ssd_chunked: D has shape"):
        ssd_chunked(*(t[k] for k in names), rt.from_numpy(np.zeros(3, np.float32)))


def test_tile_engine_is_the_ops_choice(rt, monkeypatch):
    """ssd_tile_lanes where the adapter has 8-lane subgroups and its loops fit llvmpipe's budget, else ssd_tile;
    FORCE_LANES forces either, and the dispatches are the chosen kernel's."""
    loops = ssd_op.kernel_loops(64, 64, 16, 2, 1)  # the tiny Mamba-2: one head pair, N 16
    assert loops["ssd_tile_lanes"] == ssd_op.LANE_LOOPS * loops["ssd_tile"]
    lanes = "ssd_tile_lanes" if cpu_subgroups(rt) else "ssd_tile"
    assert ssd_op.tile_engine(rt, loops) == lanes
    assert ssd_op.tile_engine(rt, dict(loops, ssd_tile_lanes=SEGMENT_BUDGET + 1)) == "ssd_tile"
    x = core_inputs(1, 9, 2, 3, 1, 4, seed=6)
    t = {k: rt.from_numpy(v) for k, v in x.items()}
    for force, want in ((None, lanes), (False, "ssd_tile")) + (((True, "ssd_tile_lanes"),) if cpu_subgroups(rt) else ()):
        monkeypatch.setattr(ssd_op, "FORCE_LANES", force)
        if "timestamp-query" in rt.features:
            rt.gpu_times = []
            ssd_chunked(*(t[k] for k in ("x", "adt", "scale", "B", "C")), t["D"], chunk=4)
            rt.sync()
            entries = {entry for entry, _, _ in rt.gpu_times if entry.startswith("ssd_tile")}
            rt.gpu_times = None
            assert entries == {want}, (force, entries)
        assert ssd_op.tile_engine(rt, loops) == want


def test_kernel_chunk_is_the_ops_choice(rt, monkeypatch):
    """Without a chunk the op picks one for the adapter and shape (at most L); FORCE_CHUNK overrides the pick, and
    what ran is in saved.chunk. The result is the reference's (which runs at its own chunk, 8) either way."""
    cpu = rt.info.type == "CPU"
    pick = ssd_op.CPU_CHUNK if cpu else ssd_op.GPU_CHUNK_SHARED
    assert kernel_chunk(rt, 1000, 4, 1) == pick
    assert kernel_chunk(rt, 1000, 4, 4) == (ssd_op.CPU_CHUNK if cpu else ssd_op.GPU_CHUNK_PER_HEAD)
    assert kernel_chunk(rt, 5, 4, 1) == 5
    x = make_inputs(2, 19, 4, 3, 2, 5, seed=9)
    dy = np.random.default_rng(10).standard_normal(x["x"].shape).astype(np.float32)
    want_y, want_grads = reference(x, dy, 8)
    for forced, ran in ((None, min(pick, 19)), (5, 5)):
        monkeypatch.setattr(ssd_op, "FORCE_CHUNK", forced)
        assert kernel_chunk(rt, 19, 4, 2) == ran
        y, saved = ssd_scan(*(rt.from_numpy(x[k]) for k in NAMES))
        assert saved.chunk == ran
        grads = ssd_scan_backward(saved, rt.from_numpy(dy))
        assert rel_err(y.numpy(), want_y) < 1e-4
        for name, got, w in zip(GRADS, grads, want_grads):
            assert rel_err(got.numpy(), w) < 1e-4, (name, forced)



def test_state_walks(rt):
    """The state walks against float64 recurrences: P·N = 9·130 = 1170 state elements, two workgroups of the
    backward (4 elements a thread), the last one partial; 5 chunks, a partial last batch of W_c sums; every output
    starts poisoned (NaN)."""
    rng = np.random.default_rng(11)
    B, nc, H, P, N = 2, 5, 3, 9, 130
    adt = (-0.3 * rng.uniform(0.5, 1.5, (B, nc, H))).astype(np.float32)
    dims = ssd_op._dims(B, nc, H, P, 1, N, 1)
    dec = ssd_op._prep(rt, dims, rt.from_numpy(adt), rt.from_numpy(np.ones((B, nc, H), np.float32)))
    decay = np.exp(adt.astype(np.float64)).transpose(0, 2, 1)[..., None, None]  # [B, H, nc, 1, 1]
    added, part, saved = (rng.standard_normal((B, nc, H, P, N)).astype(np.float32) for _ in range(3))

    states, last = rt.from_numpy(added), rt.empty((B, H, P, N))
    ssd_op.state_passing(rt, dims, dec, states, last)
    want, run = np.zeros((B, nc, H, P, N)), np.zeros((B, H, P, N))
    for c in range(nc):
        want[:, c] = run
        run = decay[:, :, c] * run + added[:, c]
    assert rel_err(states.numpy(), want) < 1e-6
    assert rel_err(last.numpy(), run) < 1e-6

    span = ssd_op.passing_span()
    tiles = -(-P * N // span)
    assert tiles == 2
    dstates, w_part = rt.from_numpy(part), rt.empty((B, H, nc, tiles))
    ssd_op.state_passing_backward(rt, dims, dec, dstates, rt.from_numpy(saved), w_part)
    want_ds, want_w, run = np.zeros((B, nc, H, P, N)), np.zeros((B, H, nc, tiles)), np.zeros((B, H, P, N))
    for c in reversed(range(nc)):
        want_ds[:, c] = run
        prod = (run * saved[:, c]).reshape(B, H, P * N)
        for k in range(tiles):
            want_w[:, :, c, k] = decay[:, :, c, 0, 0] * prod[:, :, k * span:(k + 1) * span].sum(axis=2)
        run = part[:, c] + decay[:, :, c] * run
    assert rel_err(dstates.numpy(), want_ds) < 1e-6
    assert rel_err(w_part.numpy(), want_w) < 1e-5


def _walk32(decay, added, fused):
    """The forward walk in float32 in ssd_state_passing's order: E_c out, then E = decay_c·E + added_c, rounded
    after the product and after the sum (fused: once, as an fma; longdouble holds the exact product).
    decay [B, H, nc] float32, added [B, nc, H, P, N] -> (states, last_state)."""
    wide = np.longdouble if fused else np.float32
    states, run = np.empty_like(added), np.zeros(added[:, 0].shape, np.float32)
    for c in range(added.shape[1]):
        states[:, c] = run
        prod = decay[:, :, c, None, None].astype(wide) * run.astype(wide)
        run = (prod + added[:, c].astype(wide)).astype(np.float32)
    return states, run


@pytest.mark.parametrize("nstate", [131, 132])
def test_state_passing_bits(rt, nstate):
    """ssd_state_passing against the float64 recurrence and, bit for bit, against the float32 recurrence in its
    order (_walk32) with the device's own exp of cs_end (the exp kernel's: llvmpipe's exp is not numpy's), whole
    and in segments of 1 and 3 of its 7 chunks (4 buffers: partly filled at a segment's end, two loop turns
    whole). P·N = 9·131 = 1179: PASS_SCALAR (odd, so head slabs start at every offset mod 4); 9·132 = 1188: vec4s;
    both two workgroups, the second partial. last_state starts poisoned (NaN) and both outputs are views of
    larger buffers whose tails (NaN) must stay unwritten; an unwritten state would keep its added value."""
    from mambactl.ops.activations import exp

    rng = np.random.default_rng(12)
    B, nc, H, P, N = 2, 7, 3, 9, nstate
    adt = (-0.3 * rng.uniform(0.5, 1.5, (B, nc, H))).astype(np.float32)
    dims = ssd_op._dims(B, nc, H, P, 1, N, 1)
    dec = ssd_op._prep(rt, dims, rt.from_numpy(adt), rt.from_numpy(np.ones((B, nc, H), np.float32)))
    cs_end = np.ascontiguousarray(dec.numpy()[:, :, :, 1, -1])  # [B, H, nc]: row CS, the chunk's last position
    decay = exp(rt.from_numpy(cs_end)).numpy()
    added = rng.standard_normal((B, nc, H, P, N)).astype(np.float32)
    want, run = np.zeros((B, nc, H, P, N)), np.zeros((B, H, P, N))
    for c in range(nc):
        want[:, c] = run
        run = np.exp(cs_end[:, :, c, None, None].astype(np.float64)) * run + added[:, c]
    # A compiler may contract decay·E + added into an fma (WGSL allows it; llvmpipe does not): one rounding a step.
    exact = [_walk32(decay, added, fused) for fused in (False, True)]
    guard = 64
    for segment in (None, 1, 3):
        states_buf = rt.from_numpy(np.concatenate([added.ravel(), np.full(guard, np.nan, np.float32)]))
        last_buf = rt.empty((B * H * P * N + guard,))
        states, last = states_buf.view(0, added.shape), last_buf.view(0, (B, H, P, N))
        ssd_op.state_passing(rt, dims, dec, states, last, segment=segment)
        got = states.numpy(), last.numpy()
        assert rel_err(got[0], want) < 1e-6, segment
        assert rel_err(got[1], run) < 1e-6, segment
        assert any(np.array_equal(got[0], w[0]) and np.array_equal(got[1], w[1]) for w in exact), segment
        assert np.isnan(states_buf.numpy()[-guard:]).all() and np.isnan(last_buf.numpy()[-guard:]).all(), segment
