"""mamba3_prep / mamba3_prep_backward (kernels/mamba3_prep.wgsl) against float64 numpy built from
mambactl/reference/mamba3.py's pieces: SISO and MIMO, grouped B/C, part of the state rotated, lengths that are
no multiple of the θ walks' 16 lanes, walks split into dispatches, and a walk longer than Mesa llvmpipe's loop
budget. Outputs start NaN-poisoned (the `gpu` fixture), so an element no kernel writes fails."""

import numpy as np
import pytest

from mambactl.ops.mamba3_prep import Mamba3Dims, mamba3_prep, mamba3_prep_backward, prep_walk_loops
from mambactl.reference import mamba3 as ref
from mambactl.reference.activations import sigmoid, sigmoid_backward, softplus, softplus_backward

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

    x = dict(proj=f(M, d.cols), Bn=f(M, d.rgn), Cn=f(M, d.rgn), dt_bias=f(H) + np.float32(dt_shift),
             B_bias=f(H, R, N, scale=0.3), C_bias=f(H, R, N, scale=0.3), mimo_x=1 + f(H, R, P, scale=0.3),
             mimo_z=1 + f(H, R, P, scale=0.3), D=f(H))
    g = dict(dq=f(M, H * R * N), dk=f(M, H * R * N), dv=f(M, H * R * P), dzr=f(M, H, R, P), dadt=f(M, H),
             ddt=f(M, H), dlam=f(M, H), dys=f(M, H, R, P))
    return x, g


def reference(d, x, g):
    """-> (forward dict, backward dict) in float64, as mamba3_prep / mamba3_prep_backward return them."""
    x = {k: v.astype(np.float64) for k, v in x.items()}
    g = {k: v.astype(np.float64) for k, v in g.items()}
    b, l, H, R, G, N, P, S = d.batch, d.length, d.heads, d.rank, d.groups, d.nstate, d.headdim, d.angles
    M, di, rgn = d.rows, H * P, d.rgn
    z, xs, _, _, dd_dt, dd_A, trap, ang = np.split(x["proj"], np.cumsum([di, di, rgn, rgn, H, H, H])[:], axis=1)
    z, xs = z.reshape(b, l, H, P), xs.reshape(b, l, H, P)
    dd_dt, dd_A, trap, ang = (t.reshape(b, l, -1) for t in (dd_dt, dd_A, trap, ang))
    dt_pre = dd_dt + x["dt_bias"]
    dt = softplus(dt_pre)
    A = -np.maximum(ref.heavy_tail(dd_A), A_FLOOR)
    theta = np.cumsum(dt[..., None] * (np.pi * np.tanh(ang))[:, :, None, :], axis=1)
    pairs = pairs_of(d)
    k = ref.rotate(ref._heads(x["Bn"].reshape(b, l, R, G, N), H) + x["B_bias"], theta, pairs)
    q = ref.rotate(ref._heads(x["Cn"].reshape(b, l, R, G, N), H) + x["C_bias"], theta, pairs)
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
    bwd = dict(dproj=dproj, dqb=dqb, dkb=dkb, dvx=dv * xs[:, :, :, None, :], dzz=dzr * z[:, :, :, None, :],
               dBn=ref._groups(dkb, G).reshape(M, rgn), dCn=ref._groups(dqb, G).reshape(M, rgn))
    return fwd, bwd


def run_gpu(gpu, d, x, g, segment=None):
    t = {k: gpu.from_numpy(v) for k, v in {**x, **g}.items()}
    pr = mamba3_prep(t["proj"], t["Bn"], t["Cn"], t["dt_bias"], t["B_bias"], t["C_bias"], t["mimo_x"],
                     t["mimo_z"], d, A_FLOOR, segment=segment)
    bw = mamba3_prep_backward(t["proj"], t["dt_bias"], t["mimo_x"], t["mimo_z"], t["D"], pr, t["dq"], t["dk"],
                              t["dv"], t["dzr"], t["dadt"], t["ddt"], t["dlam"], t["dys"], d, A_FLOOR,
                              segment=segment)
    return {k: v.numpy() for k, v in pr.items()}, {k: v.numpy() for k, v in bw.items()}


def check(d, got, want, tol):
    (gf, gb), (wf, wb) = got, want
    for name, w in wf.items():
        assert rel(gf[name].reshape(w.shape), w) < tol, (name, rel(gf[name].reshape(w.shape), w))
    cols = ~np.isnan(wb["dproj"][0])  # B's and C's columns are the model's (after the RMSNorm backward)
    assert rel(gb["dproj"][:, cols], wb["dproj"][:, cols]) < tol, "dproj"
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
    (1, 300, 6, 16, 1, 3, 32, 8, False),  # more columns than a θ workgroup's 16
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
    65,535; there the walks run in segments. Δ is kept small so θ stays O(1) over the walk."""
    d = Mamba3Dims(1, 560_000, 1, 1, 1, 1, 2, 1, False)
    assert prep_walk_loops(d.length) > 65535
    x, g = make_inputs(d, seed=2, dt_shift=-6.0)
    x["proj"][:, 2 * 1 + 2 * 2] -= 2.0  # dd_dt
    check(d, run_gpu(gpu, d, x, g), reference(d, x, g), 1e-4)


@pytest.mark.parametrize("rows_per_thread", ["gpu", "llvmpipe"])
def test_prep_row_blocks(gpu, monkeypatch, rows_per_thread):
    """The elementwise kernels' grid both ways: a row per thread (GPUs) and up to 64 (llvmpipe), on any adapter."""
    from mambactl.ops import mamba3_prep as op

    monkeypatch.setattr(op, "is_llvmpipe", lambda rt: rows_per_thread == "llvmpipe")
    d = Mamba3Dims(2, 70, 3, 4, 2, 3, 8, 2, True)
    x, g = make_inputs(d, seed=3)
    check(d, run_gpu(gpu, d, x, g), reference(d, x, g), 1e-5)
