"""Mamba-3 mixer on the GPU (mamba_ssm `Mamba3`, SISO and MIMO): forward and backward through the ops, the
same maths as mambactl/reference/mamba3.py's `mamba3_block` / `mamba3_block_backward`.

in_proj -> [z | x | B | C | dd_dt | dd_A | trap | angle] -> mamba3_prep (RMSNorm of B, C, Δ, A·Δ, λ, the
cumulative angles θ, rotated k, q, v = mimo_x ⊙ x, mimo_z ⊙ z) -> mamba3_scan -> mamba3_finish (D skip, optional
per-head RMSNorm, SiLU gate, Σ_r mimo_o ⊙) -> out_proj. `p` and `g` map this layer's mixer names without prefix
to parameter and gradient tensors; gradients are accumulated into `g`.
"""

from __future__ import annotations

from mambactl.models.config import ModelConfig
from mambactl.ops import linear, slice
from mambactl.ops.mamba3_prep import (Mamba3Dims, mamba3_finish, mamba3_finish_backward, mamba3_prep,
                                      mamba3_prep_backward)
from mambactl.ops.mamba3_scan import mamba3_rotate_step, mamba3_scan, mamba3_scan_backward, mamba3_scan_step
from mambactl.ops.reduce import column_sums
from mambactl.runtime.tensor import Tensor

NORM_EPS = 1e-5  # B_norm, C_norm and the out-norm (fixed in mamba_ssm)


def _dims(cfg: ModelConfig, batch: int, length: int) -> Mamba3Dims:
    m = cfg.mamba3
    return Mamba3Dims(batch, length, cfg.mamba3_nheads, m.headdim, cfg.mamba3_rank, m.ngroups, m.d_state,
                      cfg.mamba3_num_rope_angles, bool(m.is_mimo))


def _mimo(p: dict, d: Mamba3Dims):
    """(mimo_x, mimo_z, mimo_o) for MIMO; (None, None, None) for SISO, whose kernels multiply by nothing."""
    if d.mimo:
        return p["mimo_x"], p["mimo_z"], p["mimo_o"]
    return None, None, None


def _project(p: dict, x: Tensor, d: Mamba3Dims, mimo, cfg: ModelConfig, with_v: bool = True) -> dict:
    """in_proj, mamba3_prep (with the RMSNorm of B and C): what the parallel forward and the step share
    (`with_v` False: SISO's v = x stays in proj, where the parallel scan reads it)."""
    proj = linear.linear(x, p["in_proj.weight"])
    pr = mamba3_prep(proj, p["dt_bias"], p["B_norm.weight"], p["C_norm.weight"], p["B_bias"], p["C_bias"], mimo[0],
                     mimo[1], d, cfg.mamba3.A_floor, NORM_EPS, with_v=with_v)
    return dict(proj=proj, prep=pr)


def mamba3_forward(p: dict, x: Tensor, batch: int, length: int, cfg: ModelConfig):
    """x [B·L, d_model] -> (y [B·L, d_model], saved)."""
    d = _dims(cfg, batch, length)
    M = d.rows
    mimo = _mimo(p, d)
    proj_saved = _project(p, x, d, mimo, cfg, with_v=d.mimo)
    pr = proj_saved["prep"]
    shape5 = lambda t: t.reshape(batch, length, d.heads, d.rank, -1)  # noqa: E731
    shape3 = lambda t: t.reshape(batch, length, d.heads)  # noqa: E731
    scalars = shape3(pr["adt"]), shape3(pr["dt"]), shape3(pr["lam"])
    if d.mimo:  # the op picks its chunk, not chunk_size
        ys, scan_saved = mamba3_scan(shape5(pr["q"]), shape5(pr["k"]), shape5(pr["v"]), *scalars)
    else:  # v = x read in place from proj's columns, the skip D v added in the SSD core
        ys, scan_saved = mamba3_scan(shape5(pr["q"]), shape5(pr["k"]), proj_saved["proj"].reshape(batch, length, -1),
                                     *scalars, D=p["D"], v_start=d.heads * d.headdim, headdim=d.headdim)
    norm_w = p["norm.weight"] if cfg.mamba3.is_outproj_norm else None
    out, fin = mamba3_finish(ys.reshape(M, d.heads, d.rank, d.headdim), pr["v"], pr["zr"], p["D"] if d.mimo else None,
                             norm_w, mimo[2], d, NORM_EPS)
    result = linear.linear(out, p["out_proj.weight"])
    saved = dict(x=x, **proj_saved, scan=scan_saved, fin=fin, out=out, dims=d, mimo=mimo)
    return result, saved


def mamba3_backward(p: dict, g: dict, saved: dict, dout: Tensor, cfg: ModelConfig) -> Tensor:
    """dout [B·L, d_model] -> dx [B·L, d_model]; parameter gradients are added into `g`."""
    s = saved
    d = s["dims"]
    M, H, R, P = d.rows, d.heads, d.rank, d.headdim
    mimo_x, mimo_z, mimo_o = s["mimo"]
    pr = s["prep"]
    dout_mix, _, _ = linear.linear_backward(s["out"], p["out_proj.weight"], dout, dw=g["out_proj.weight"])
    norm_w = p["norm.weight"] if cfg.mamba3.is_outproj_norm else None
    # SISO: dz and dx go straight into dproj's z and x columns (z and x are read in place there), and ∂D is the
    # scan's (its core adds the skip)
    dproj = None if d.mimo else dout.runtime.empty((M, d.cols))
    D = p["D"] if d.mimo else None
    fb = mamba3_finish_backward(s["fin"], pr["v"], pr["zr"], D, norm_w, mimo_o, dout_mix, d, NORM_EPS,
                                dz_into=dproj)
    if norm_w is not None:
        column_sums(fb["dnw"], out=g["norm.weight"])
    dys = fb["dys"].reshape(d.batch, d.length, H, R, P)
    flat = lambda t: t.reshape(M, -1)  # noqa: E731
    if d.mimo:
        column_sums(fb["dD"], out=g["D"])
        column_sums(fb["dmo"], out=g["mimo_o"].reshape(-1))
        dq, dk, dv, dadt, ddt, dlam = mamba3_scan_backward(s["scan"], dys)
        dv, dys_in = flat(dv), fb["dys"]
    else:
        dq, dk, _, dadt, ddt, dlam = mamba3_scan_backward(s["scan"], dys, dD=g["D"],
                                                          dv_out=(dproj.reshape(d.batch, d.length, -1), H * P))
        dv = dys_in = None
    bw = mamba3_prep_backward(s["proj"], p["dt_bias"], p["B_norm.weight"], p["C_norm.weight"], p["B_bias"],
                              p["C_bias"], mimo_x, mimo_z, D, pr, flat(dq), flat(dk), dv, fb["dzr"],
                              flat(dadt), flat(ddt), flat(dlam), dys_in, d, cfg.mamba3.A_floor, NORM_EPS,
                              dproj=dproj)
    dproj = bw["dproj"]
    column_sums(bw["dB_bias_part"], out=g["B_bias"].reshape(-1))
    column_sums(bw["dC_bias_part"], out=g["C_bias"].reshape(-1))
    if d.mimo:
        column_sums(flat(bw["dvx"]), out=g["mimo_x"].reshape(-1))
        column_sums(flat(bw["dzz"]), out=g["mimo_z"].reshape(-1))
    column_sums(bw["ddt_rows"], out=g["dt_bias"])
    column_sums(bw["dB_norm_part"], out=g["B_norm.weight"])
    column_sums(bw["dC_norm_part"], out=g["C_norm.weight"])
    dx, _, _ = linear.linear_backward(s["x"], p["in_proj.weight"], dproj, dw=g["in_proj.weight"])
    return dx


def mamba3_decode_state(saved: dict, cfg: ModelConfig) -> dict:
    """The recurrent state after a parallel forward: the angle θ reached at the last position, the scan's last
    state h (its SSD state g equals h there), and the last position's k and v."""
    d = saved["dims"]
    B, L, H, R, N, P, S = d.batch, d.length, d.heads, d.rank, d.nstate, d.headdim, max(d.angles, 1)
    pr = saved["prep"]

    def last(t, width, shape):
        return slice.column_slice(t.reshape(B, L * width), (L - 1) * width, width).reshape(*shape)

    h = saved["scan"].last_state
    h = slice.column_slice(h.reshape(B, H * P * N), 0, H * P * N).reshape(B, H, P, N)  # a copy: steps write it
    if pr["v"] is not None:
        v = last(pr["v"], H * R * P, (B, H, R, P))
    else:  # SISO: v = x, columns [H·P, 2·H·P) of the last row's proj
        v = slice.column_slice(saved["proj"].reshape(B, L * d.cols), (L - 1) * d.cols + H * P, H * P)
        v = v.reshape(B, H, R, P)
    return {"theta": last(pr["theta"], H * S, (B, H, S)), "h": h, "k": last(pr["k"], H * R * N, (B, H, R, N)),
            "v": v}


def mamba3_step(p: dict, x: Tensor, state: dict, cfg: ModelConfig) -> Tensor:
    """One token per batch row: x [B, d_model] -> [B, d_model]; `state` (θ, h, previous k and v) advances in place."""
    batch = x.shape[0]
    d = _dims(cfg, batch, 1)
    M, H, R, N, P = batch, d.heads, d.rank, d.nstate, d.headdim
    mimo = _mimo(p, d)
    # L = 1: the prep turns q, k by this token's angle increment alone; the rotate step adds the angle before it
    pr = _project(p, x, d, mimo, cfg)["prep"]
    S = max(d.angles, 1)
    q, k, theta = mamba3_rotate_step(pr["q"].reshape(batch, H, R, N), pr["k"].reshape(batch, H, R, N),
                                     state["theta"], pr["theta"].reshape(batch, H, S), d.angles, d.mimo)
    v = pr["v"].reshape(batch, H, R, P)
    ys = mamba3_scan_step(state["h"], q, k, v, pr["adt"], pr["dt"], pr["lam"], state["k"], state["v"])
    for name, new in (("theta", theta), ("k", k), ("v", v)):  # in place, so a captured step replays (runtime.Graph)
        x.runtime.copy(new, state[name])
    norm_w = p["norm.weight"] if cfg.mamba3.is_outproj_norm else None
    out, _ = mamba3_finish(ys.reshape(M, H, R, P), pr["v"], pr["zr"], p["D"], norm_w, mimo[2], d, NORM_EPS)
    return linear.linear(out, p["out_proj.weight"])
