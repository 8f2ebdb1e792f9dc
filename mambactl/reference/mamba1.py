"""Mamba-1 mixer (mamba_ssm `Mamba` / HF `MambaMixer.slow_forward`) and its hand-written backward.

`params` holds one mixer's tensors under their names without the layer prefix ("in_proj.weight",
"conv1d.weight" [d_inner, 1, d_conv], "x_proj.weight", "dt_proj.weight", "dt_proj.bias", "A_log", "D",
"out_proj.weight", optional "in_proj.bias", "conv1d.bias", "out_proj.bias"); the grads use the same names.
"""

from mambactl.reference.activations import exp, exp_backward, silu, silu_backward, softplus, softplus_backward
from mambactl.reference.conv1d import conv1d, conv1d_backward
from mambactl.reference.linear import linear, linear_backward
from mambactl.reference.selective_scan import selective_scan, selective_scan_backward
from mambactl.reference.slice import column_concat, column_slice, column_slice_backward


def mamba1_block(params, x, cfg):
    """x [B, L, d_model] -> (y [B, L, d_model], saved for the backward)."""
    Bsz, L, d = x.shape
    di, R, N = cfg.d_inner, cfg.dt_rank, cfg.mamba1.d_state
    x2 = x.reshape(-1, d)
    xz = linear(x2, params["in_proj.weight"], params.get("in_proj.bias"))  # [M, 2 di]: x then z
    xs = column_slice(xz, 0, di).reshape(Bsz, L, di)
    z = column_slice(xz, di, di).reshape(Bsz, L, di)
    xc = conv1d(xs, params["conv1d.weight"], params.get("conv1d.bias"))
    u = silu(xc)
    dbc = linear(u.reshape(-1, di), params["x_proj.weight"])  # [M, R + 2N]: dt, B, C
    dt = column_slice(dbc, 0, R)
    Bm = column_slice(dbc, R, N).reshape(Bsz, L, N)
    Cm = column_slice(dbc, R + N, N).reshape(Bsz, L, N)
    dt_pre = linear(dt, params["dt_proj.weight"], params["dt_proj.bias"]).reshape(Bsz, L, di)
    delta = softplus(dt_pre)
    A = -exp(params["A_log"])
    ys = selective_scan(u, delta, A, Bm, Cm, params["D"], z)
    y = linear(ys.reshape(-1, di), params["out_proj.weight"], params.get("out_proj.bias")).reshape(Bsz, L, d)
    saved = dict(x2=x2, xs=xs, z=z, xc=xc, u=u, dt=dt, Bm=Bm, Cm=Cm, dt_pre=dt_pre, delta=delta, A=A, ys=ys)
    return y, saved


def mamba1_block_backward(params, saved, dy, cfg):
    """dy [B, L, d_model] -> (dx [B, L, d_model], grads: dict name -> array, shaped as params)."""
    s = saved
    Bsz, L, d = dy.shape
    di, N = cfg.d_inner, cfg.mamba1.d_state
    grads = {}
    dys, grads["out_proj.weight"], db = linear_backward(s["ys"].reshape(-1, di), params["out_proj.weight"],
                                                       dy.reshape(-1, d))
    if "out_proj.bias" in params:
        grads["out_proj.bias"] = db
    du, ddelta, dA, dB, dC, grads["D"], dz = selective_scan_backward(
        s["u"], s["delta"], s["A"], s["Bm"], s["Cm"], params["D"], s["z"], dys.reshape(Bsz, L, di))
    grads["A_log"] = exp_backward(params["A_log"], -dA)
    ddt_pre = softplus_backward(s["dt_pre"], ddelta).reshape(-1, di)
    ddt, grads["dt_proj.weight"], grads["dt_proj.bias"] = linear_backward(s["dt"], params["dt_proj.weight"], ddt_pre)
    ddbc = column_concat([ddt, dB.reshape(-1, N), dC.reshape(-1, N)])
    du_x, grads["x_proj.weight"], _ = linear_backward(s["u"].reshape(-1, di), params["x_proj.weight"], ddbc)
    du = du + du_x.reshape(Bsz, L, di)
    dxs, grads["conv1d.weight"], db = conv1d_backward(s["xs"], params["conv1d.weight"], silu_backward(s["xc"], du))
    if "conv1d.bias" in params:
        grads["conv1d.bias"] = db
    dxz = column_slice_backward(dxs.reshape(-1, di), 0, 2 * di) + column_slice_backward(dz.reshape(-1, di), di, 2 * di)
    dx, grads["in_proj.weight"], db = linear_backward(s["x2"], params["in_proj.weight"], dxz)
    if "in_proj.bias" in params:
        grads["in_proj.bias"] = db
    return dx.reshape(Bsz, L, d), grads
