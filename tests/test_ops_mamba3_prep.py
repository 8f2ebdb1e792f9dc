"""mamba3_prep / mamba3_prep_backward (kernels/mamba3_prep.wgsl) against float64 numpy built from
mambactl/reference/mamba3.py's pieces (the B / C RMSNorm included): SISO and MIMO, grouped B/C, part of the state
rotated, lengths that are no multiple of the θ walks' 16 lanes or of the rotation backward's blocks of rows, walks
split into dispatches, and a walk longer than Mesa llvmpipe's loop budget. Outputs start NaN-poisoned (the `gpu` fixture), so an element no kernel writes fails."""

import numpy as np
import pytest

from mambactl.errors import ShapeError
from mambactl.ops.mamba3_prep import (Mamba3Dims, mamba3_finish, mamba3_finish_backward, mamba3_prep,
                                      mamba3_prep_backward, prep_walk_loops, rotate_blocks)
from mambactl.reference import mamba3 as ref
from mambactl.reference.activations import sigmoid, sigmoid_backward, softplus, softplus_backward
from mambactl.reference.rmsnorm import rmsnorm, rmsnorm_backward

A_FLOOR = 0.3


def rel(got, want):
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got)), "unwritten (NaN-poisoned) or non-finite elements in the GPU output"
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def pairs_of(d):
    j = np.arange(d.angles)
    return (j, j + d.nstate // 2) if d.mimo else (2 * j, 2 * j + 1)


def make_inputs(d, seed=0, dt_shift=0.0):
    rng = np.random.default_rng(seed)
    M, H, R, N, P = d.rows, d.heads, d.rank, d.nstate, d.headdim

    def f(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    x = dict(proj=f(M, d.cols), B_norm_w=1 + f(N, scale=0.3), C_norm_w=1 + f(N, scale=0.3),
             dt_bias=f(H) + np.float32(dt_shift),
             B_bias=f(H, R, N, scale=0.3), C_bias=f(H, R, N, scale=0.3), mimo_x=1 + f(H, R, P, scale=0.3),
             mimo_z=1 + f(H, R, P, scale=0.3), D=f(H))
    # SISO has no mimo_* parameters: the reference multiplies by 1, the GPU ops get None. (They are drawn either
    # way, so every other input is the data these tests had before SISO stopped taking them.)
    if not d.mimo:
        x["mimo_x"], x["mimo_z"] = np.ones_like(x["mimo_x"]), np.ones_like(x["mimo_z"])
    g = dict(dq=f(M, H * R * N), dk=f(M, H * R * N), dv=f(M, H * R * P), dzr=f(M, H, R, P), dadt=f(M, H),
             ddt=f(M, H), dlam=f(M, H), dys=f(M, H, R, P))
    return x, g


def reference(d, x, g):
    """-> (forward dict, backward dict) in float64, as mamba3_prep / mamba3_prep_backward return them."""
    x = {k: v.astype(np.float64) for k, v in x.items()}
    g = {k: v.astype(np.float64) for k, v in g.items()}
    b, l, H, R, G, N, P, S = d.batch, d.length, d.heads, d.rank, d.groups, d.nstate, d.headdim, d.angles
    M, di, rgn = d.rows, H * P, d.rgn
    z, xs, Bp, Cp, dd_dt, dd_A, trap, ang = np.split(x["proj"], np.cumsum([di, di, rgn, rgn, H, H, H])[:], axis=1)
    Bp, Cp = Bp.reshape(-1, N), Cp.reshape(-1, N)  # a (row, rank, group) per row: the norm's
    Bn, Cn = rmsnorm(Bp, x["B_norm_w"], ref.NORM_EPS), rmsnorm(Cp, x["C_norm_w"], ref.NORM_EPS)
    z, xs = z.reshape(b, l, H, P), xs.reshape(b, l, H, P)
    dd_dt, dd_A, trap, ang = (t.reshape(b, l, -1) for t in (dd_dt, dd_A, trap, ang))
    dt_pre = dd_dt + x["dt_bias"]
    dt = softplus(dt_pre)
    A = -np.maximum(ref.heavy_tail(dd_A), A_FLOOR)
    theta = np.cumsum(dt[..., None] * (np.pi * np.tanh(ang))[:, :, None, :], axis=1)
    pairs = pairs_of(d)
    k = ref.rotate(ref._heads(Bn.reshape(b, l, R, G, N), H) + x["B_bias"], theta, pairs)
    q = ref.rotate(ref._heads(Cn.reshape(b, l, R, G, N), H) + x["C_bias"], theta, pairs)
    fwd = dict(q=q, k=k, v=xs[:, :, :, None, :] * x["mimo_x"], zr=z[:, :, :, None, :] * x["mimo_z"], adt=A * dt,
               dt=dt, lam=sigmoid(trap), theta=theta)

    dq, dk = g["dq"].reshape(q.shape), g["dk"].reshape(k.shape)
    dv = g["dv"].reshape(b, l, H, R, P) + x["D"][:, None, None] * g["dys"].reshape(b, l, H, R, P)
    dzr = g["dzr"].reshape(b, l, H, R, P)
    dqb, dthq = ref.rotate_backward(q, theta, pairs, dq)
    dkb, dthk = ref.rotate_backward(k, theta, pairs, dk)
    dcum = np.flip(np.cumsum(np.flip(dthq + dthk, axis=1), axis=1), axis=1)
    tanh = np.tanh(ang)
    dadt, ddt = g["dadt"].reshape(b, l, H), g["ddt"].reshape(b, l, H)
    ddt = ddt + dadt * A + np.pi * np.sum(dcum * tanh[:, :, None, :], axis=3)
    dang = np.pi * (1 - tanh**2) * np.sum(dcum * dt[..., None], axis=2)
    ddd_A = ref.heavy_tail_backward(dd_A, -dadt * dt * (ref.heavy_tail(dd_A) >= A_FLOOR))
    dproj = np.full((M, d.cols), np.nan)
    dproj[:, :di] = np.sum(dzr * x["mimo_z"], axis=3).reshape(M, di)
    dproj[:, di:2 * di] = np.sum(dv * x["mimo_x"], axis=3).reshape(M, di)
    off = 2 * di + 2 * rgn
    dproj[:, off:off + H] = softplus_backward(dt_pre, ddt).reshape(M, H)
    dproj[:, off + H:off + 2 * H] = ddd_A.reshape(M, H)
    dproj[:, off + 2 * H:off + 3 * H] = sigmoid_backward(trap, g["dlam"].reshape(b, l, H)).reshape(M, H)
    dproj[:, off + 3 * H:] = dang.reshape(M, S)
    dBp, dBw = rmsnorm_backward(Bp, x["B_norm_w"], ref._groups(dkb, G).reshape(-1, N), ref.NORM_EPS)
    dCp, dCw = rmsnorm_backward(Cp, x["C_norm_w"], ref._groups(dqb, G).reshape(-1, N), ref.NORM_EPS)
    dproj[:, 2 * di:2 * di + rgn] = dBp.reshape(M, rgn)
    dproj[:, 2 * di + rgn:off] = dCp.reshape(M, rgn)
    bwd = dict(dproj=dproj, dB_bias_part=dkb.sum(axis=(0, 1)), dC_bias_part=dqb.sum(axis=(0, 1)),
               dB_norm_part=dBw, dC_norm_part=dCw, ddt_rows=dproj[:, off:off + H])
    if d.mimo:  # ∂mimo_x, ∂mimo_z per row
        bwd.update(dvx=dv * xs[:, :, :, None, :], dzz=dzr * z[:, :, :, None, :])
    return fwd, bwd


def run_gpu(gpu, d, x, g, segment=None):
    t = {k: gpu.from_numpy(v) for k, v in {**x, **g}.items()}
    dzr, dproj, dv, D, dys = t["dzr"], None, t["dv"], t["D"], t["dys"]
    if not d.mimo:
        t["mimo_x"] = t["mimo_z"] = None
        # SISO takes dz and dx in place: dproj arrives with its z columns written (mamba3_finish_backward's dz_into)
        # and its x columns (mamba3_scan_backward's dv_out: dv with the skip's D dys) and every other column NaN,
        # so a column the prep backward misses (or overwrites) fails
        host = np.full((d.rows, d.cols), np.nan, np.float32)
        di = d.heads * d.headdim
        host[:, :di] = g["dzr"].reshape(d.rows, -1)
        host[:, di:2 * di] = (g["dv"].reshape(d.rows, d.heads, -1)
                              + x["D"][:, None] * g["dys"].reshape(d.rows, d.heads, -1)).reshape(d.rows, -1)
        dzr, dproj, dv, D, dys = None, gpu.from_numpy(host), None, None, None
    pr = mamba3_prep(t["proj"], t["dt_bias"], t["B_norm_w"], t["C_norm_w"], t["B_bias"], t["C_bias"], t["mimo_x"],
                     t["mimo_z"], d, A_FLOOR, ref.NORM_EPS, segment=segment)
    bw = mamba3_prep_backward(t["proj"], t["dt_bias"], t["B_norm_w"], t["C_norm_w"], t["B_bias"], t["C_bias"],
                              t["mimo_x"], t["mimo_z"], D, pr, t["dq"], t["dk"], dv, dzr, t["dadt"],
                              t["ddt"], t["dlam"], dys, d, A_FLOOR, ref.NORM_EPS, segment=segment, dproj=dproj)
    fwd = {k: v.numpy() for k, v in pr.items()}
    if not d.mimo:  # zr = z in place: "zr" is proj itself
        assert pr["zr"] is t["proj"]
        fwd["zr"] = fwd["zr"][:, :d.heads * d.headdim]
    back = {k: v.numpy() for k, v in bw.items()}
    for name, width in (("dB_bias_part", d.heads * d.rank * d.nstate), ("dC_bias_part", d.heads * d.rank * d.nstate),
                        ("dB_norm_part", d.nstate), ("dC_norm_part", d.nstate)):
        # per block of rows, NaN-poisoned: an unwritten one fails
        assert back[name].shape == (rotate_blocks(d), width)
        assert np.all(np.isfinite(back[name])), name
        back[name] = back[name].astype(np.float64).sum(axis=0)
    return fwd, back


def check(d, got, want, tol):
    (gf, gb), (wf, wb) = got, want
    for name, w in wf.items():
        assert rel(gf[name].reshape(w.shape), w) < tol, (name, rel(gf[name].reshape(w.shape), w))
    assert rel(gb["dproj"], wb["dproj"]) < tol, "dproj"
    for name, w in wb.items():
        if name != "dproj":
            assert rel(gb[name].reshape(w.shape), w) < tol, (name, rel(gb[name].reshape(w.shape), w))


# (batch, length, heads, headdim, rank, groups, nstate, angles, mimo)
SHAPES = [
    (2, 37, 3, 5, 1, 1, 8, 4, False),     # SISO, the whole state rotated, L no multiple of 16
    (2, 21, 4, 4, 1, 2, 12, 3, False),    # SISO, 2 groups, half the state rotated
    (1, 50, 4, 3, 2, 2, 10, 3, True),     # MIMO rank 2, 2 groups, 3 of 5 pairs rotated
    (3, 9, 2, 8, 3, 1, 8, 4, True),       # MIMO rank 3, every pair rotated
    (2, 1, 2, 4, 1, 1, 8, 2, False),      # one token (decode)
    (1, 300, 6, 16, 1, 3, 32, 8, False),  # more columns than a θ workgroup's 16 or a rotation workgroup's 64
    (2, 5, 12, 2, 1, 1, 4, 1, False),     # more heads than B's columns (a rotation thread's per-head scalars)
    (2, 13, 2, 4, 1, 1, 9, 3, False),     # SISO, an odd state: the last dim unpaired
    (1, 11, 2, 3, 2, 2, 9, 3, True),      # MIMO, an odd state: dims (j, j + 4) and the last unpaired
]


@pytest.mark.parametrize("shape", SHAPES)
def test_prep_matches_reference(gpu, shape):
    d = Mamba3Dims(*shape)
    x, g = make_inputs(d)
    check(d, run_gpu(gpu, d, x, g), reference(d, x, g), 1e-5)


@pytest.mark.parametrize("segment", [1, 7])
def test_prep_segmented(gpu, segment):
    """The llvmpipe path: the θ walks split into dispatches of `segment` steps."""
    d = Mamba3Dims(2, 37, 3, 4, 2, 1, 8, 3, True)
    x, g = make_inputs(d, seed=1)
    check(d, run_gpu(gpu, d, x, g, segment=segment), reference(d, x, g), 1e-5)


def test_prep_walk_past_loop_budget(gpu):
    """L 560,000 (one head, one angle): a θ-walk invocation over all of it would loop 70k times, over llvmpipe's
    65,535; there the walks run in segments. Also more row blocks of the rotation backward than a grid dimension
    holds. Δ is kept small so θ stays O(1) over the walk."""
    d = Mamba3Dims(1, 560_000, 1, 1, 1, 1, 2, 1, False)
    assert prep_walk_loops(d.length) > 65535
    x, g = make_inputs(d, seed=2, dt_shift=-6.0)
    x["proj"][:, 2 * 1 + 2 * 2] -= 2.0  # dd_dt
    check(d, run_gpu(gpu, d, x, g), reference(d, x, g), 1e-4)


@pytest.mark.parametrize("rows_per_thread", ["gpu", "llvmpipe"])
def test_prep_row_blocks(gpu, monkeypatch, rows_per_thread):
    """The elementwise kernels' grids both ways on any adapter: an item (prep) or row (reduce) per thread (GPUs),
    up to 64 (llvmpipe)."""
    from mambactl.ops import mamba3_prep as op

    monkeypatch.setattr(op, "is_llvmpipe", lambda rt: rows_per_thread == "llvmpipe")
    d = Mamba3Dims(2, 70, 3, 4, 2, 3, 8, 2, True)
    x, g = make_inputs(d, seed=3)
    check(d, run_gpu(gpu, d, x, g), reference(d, x, g), 1e-5)


@pytest.mark.parametrize("splits", [2, 3])
def test_prep_rotate_splits(gpu, monkeypatch, splits):
    """The rotation backward with a group's heads split over threads (3 splits of 4 heads: 2, 2 and none)."""
    from mambactl.ops import mamba3_prep as op

    monkeypatch.setattr(op, "ROTATE_SPLITS", splits)
    for shape in [(2, 21, 4, 4, 1, 1, 12, 3, False), (1, 13, 8, 3, 2, 2, 10, 3, True)]:
        d = Mamba3Dims(*shape)
        x, g = make_inputs(d, seed=4)
        check(d, run_gpu(gpu, d, x, g), reference(d, x, g), 1e-5)


def test_siso_takes_no_mimo_tensors(gpu):
    d = Mamba3Dims(1, 4, 2, 4, 1, 1, 8, 2, False)
    x, _ = make_inputs(d)
    t = {k: gpu.from_numpy(v) for k, v in x.items()}
    with pytest.raises(ShapeError, match="mamba3_prep: mimo_x is given for SISO"):
        mamba3_prep(t["proj"], t["dt_bias"], t["B_norm_w"], t["C_norm_w"], t["B_bias"], t["C_bias"], t["mimo_x"],
                    None, d, A_FLOOR, ref.NORM_EPS)


def test_siso_without_v_and_in_place_gradients(gpu):
    """SISO's parallel forward (with_v False): no v stored and every other output the same bits; its backward
    refuses the MIMO-only inputs (dx comes in dproj's x columns)."""
    d = Mamba3Dims(2, 21, 4, 4, 1, 2, 12, 3, False)
    x, g = make_inputs(d, seed=5)
    t = {k: gpu.from_numpy(v) for k, v in {**x, **g}.items()}
    args = (t["proj"], t["dt_bias"], t["B_norm_w"], t["C_norm_w"], t["B_bias"], t["C_bias"], None, None, d, A_FLOOR,
            ref.NORM_EPS)
    full, bare = mamba3_prep(*args), mamba3_prep(*args, with_v=False)
    assert bare["v"] is None and full["v"] is not None
    for name in ("q", "k", "adt", "dt", "lam", "theta", "Bn", "Cn"):
        np.testing.assert_array_equal(bare[name].numpy(), full[name].numpy(), err_msg=name)
    dproj = gpu.from_numpy(np.zeros((d.rows, d.cols), np.float32))
    with pytest.raises(ShapeError, match="SISO takes dz and dx in place"):
        mamba3_prep_backward(t["proj"], t["dt_bias"], t["B_norm_w"], t["C_norm_w"], t["B_bias"], t["C_bias"], None,
                             None, None, bare, t["dq"], t["dk"], t["dv"], None, t["dadt"], t["ddt"], t["dlam"], None,
                             d, A_FLOOR, ref.NORM_EPS, dproj=dproj)


def finish_reference(d, f, norm):
    """mambactl/reference/mamba3.py's _finish and its backward (mamba3_block_backward's first lines), float64."""
    f = {k: v.astype(np.float64) for k, v in f.items()}
    M, H, R, P = d.rows, d.heads, d.rank, d.headdim
    y = f["ys"] + f["D"][:, None, None] * f["v"]
    w = f["norm_w"].reshape(H, 1, P)
    yn = ref.rmsnorm(y, w, ref.NORM_EPS) if norm else y
    o = yn * ref.silu(f["zr"])
    out = np.sum(o * f["mimo_o"], axis=2).reshape(M, H * P)
    do = f["dout"].reshape(M, H, 1, P) * f["mimo_o"]
    dzr = ref.silu_backward(f["zr"], do * yn)
    dyn = do * ref.silu(f["zr"])
    dys = ref.rmsnorm_backward(y, w, dyn, ref.NORM_EPS)[0] if norm else dyn
    back = dict(dys=dys, dzr=dzr, dD=np.sum(dys * f["v"], axis=3).transpose(0, 2, 1).reshape(M * R, H))
    if norm:
        back["dnw"] = (dyn * ref.rmsnorm(y, 1.0, ref.NORM_EPS)).transpose(0, 2, 1, 3).reshape(M * R, H * P)
    if d.mimo:
        back["dmo"] = (f["dout"].reshape(M, H, 1, P) * o).reshape(M, H * R * P)
    return out, back


# (rows M, heads, headdim, rank, mimo, norm): P within one workgroup of 64 lanes, past it and not a multiple of it
FINISH_SHAPES = [(5, 3, 4, 1, False, False), (5, 3, 4, 1, False, True), (3, 2, 130, 1, False, True),
                 (4, 2, 70, 3, True, True), (4, 3, 5, 2, True, False), (2, 24, 64, 1, False, False)]


# SISO as the model runs it: z / dz in place in proj / dproj's columns
SISO_IN_PLACE = [(5, 3, 4, 1, False, False), (3, 2, 130, 1, False, True), (2, 24, 64, 1, False, False)]


def finish_case(gpu, d, rows, heads, headdim, rank, mimo, norm, lanes, in_place=False):
    """in_place: SISO as the model runs it, z read from proj and dz written into dproj in place, and no skip here
    (D None: the scan's core added D v, so y = ys and ∂D is the scan's)."""
    rng = np.random.default_rng(7)
    M, H, R, P = d.rows, heads, rank, headdim
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    f = dict(ys=f32(M, H, R, P), v=f32(M, H, R, P), zr=f32(M, H, R, P), D=f32(H), norm_w=1 + 0.3 * f32(H * P),
             mimo_o=1 + 0.3 * f32(H, R, P) if mimo else np.ones((H, R, P), np.float32), dout=f32(M, H * P))
    t = {k: gpu.from_numpy(v) for k, v in f.items()}
    mimo_o = t["mimo_o"] if mimo else None
    norm_w = t["norm_w"] if norm else None
    zr, dz_into = t["zr"], None
    if in_place:  # z in proj's first H·P columns (the rest random), dz into a NaN dproj's
        proj = f32(M, d.cols)
        proj[:, :H * P] = f["zr"].reshape(M, -1)
        zr, dz_into = gpu.from_numpy(proj), gpu.from_numpy(np.full((M, d.cols), np.nan, np.float32))
    v, D = (None, None) if in_place else (t["v"], t["D"])
    out, saved = mamba3_finish(t["ys"], v, zr, D, norm_w, mimo_o, d, ref.NORM_EPS, lanes=lanes)
    back = mamba3_finish_backward(saved, v, zr, D, norm_w, mimo_o, t["dout"], d, ref.NORM_EPS,
                                  lanes=lanes, dz_into=dz_into)
    out_ref, back_ref = finish_reference(d, {**f, "D": np.zeros_like(f["D"])} if in_place else f, norm)
    if in_place:
        assert back["dD"] is None and saved["y"] is t["ys"]
        del back_ref["dD"]
    assert rel(out.numpy(), out_ref) < 1e-5
    if in_place:
        assert back["dzr"] is None
        dproj = dz_into.numpy()
        back["dzr"] = dproj[:, :H * P]
        assert np.all(np.isnan(dproj[:, H * P:])), "dz_into written past its z columns"
    for name, want in back_ref.items():
        got = np.asarray(back[name].numpy() if hasattr(back[name], "numpy") else back[name]).reshape(want.shape)
        assert rel(got, want) < 1e-5, (name, rel(got, want))
    assert (back["dmo"] is None) == (not mimo)


@pytest.mark.parametrize("lanes", [1, 16, 64])  # CPU adapters, GPUs, a whole workgroup per item
@pytest.mark.parametrize("rows,heads,headdim,rank,mimo,norm", FINISH_SHAPES)
def test_finish_matches_reference(gpu, rows, heads, headdim, rank, mimo, norm, lanes):
    """Each lane count on any adapter; several items share a workgroup below 64 lanes, the last one partly past
    the end (M·H·R = 45, 15, ... items)."""
    d = Mamba3Dims(1, rows, heads, headdim, rank, 1, 8, 2, mimo)
    finish_case(gpu, d, rows, heads, headdim, rank, mimo, norm, lanes)


@pytest.mark.parametrize("lanes", [1, 16])
@pytest.mark.parametrize("rows,heads,headdim,rank,mimo,norm", SISO_IN_PLACE)
def test_finish_siso_in_place(gpu, rows, heads, headdim, rank, mimo, norm, lanes):
    """SISO as Mamba-3's block runs it: z read from proj's columns and dz written into dproj's."""
    d = Mamba3Dims(1, rows, heads, headdim, rank, 1, 8, 2, mimo)
    finish_case(gpu, d, rows, heads, headdim, rank, mimo, norm, lanes, in_place=True)
