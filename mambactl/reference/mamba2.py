"""Mamba-2 mixer (mamba_ssm `Mamba2` / HF `Mamba2Mixer.torch_forward`) and its hand-written backward.

    [z, xBC, dt] = in_proj(x);  xBC = SiLU(conv1d(xBC));  [x, B, C] = xBC;  Δ = clamp(softplus(dt + dt_bias), dt_limit)
    y = SSD(x, Δ, A = -exp(A_log), B, C) + D x  (per head);  out = out_proj(rmsnorm_gated(y, z, norm.weight))

`params` holds one mixer's tensors under their names without the layer prefix ("in_proj.weight" [2·d_inner +
2·G·N + H, d_model], "conv1d.weight" [d_inner + 2·G·N, 1, d_conv], "dt_bias" [H], "A_log" [H], "D" [H],
"norm.weight" [d_inner], "out_proj.weight", optional "in_proj.bias", "conv1d.bias", "out_proj.bias");
the grads use the same names. The gated norm's epsilon is `cfg.norm_eps` (HF's layer_norm_epsilon; mamba_ssm
fixes 1e-5, the default) and its groups are d_inner / ngroups channels.
"""

import numpy as np

from mambactl.reference.activations import exp, exp_backward, silu, silu_backward, softplus, softplus_backward
from mambactl.reference.conv1d import conv1d, conv1d_backward
from mambactl.reference.linear import linear, linear_backward
from mambactl.reference.rmsnorm_gated import rmsnorm_gated, rmsnorm_gated_backward
from mambactl.reference.slice import column_concat, column_slice
from mambactl.reference.ssd import ssd, ssd_backward


def _dims(cfg):
    m = cfg.mamba2
    return cfg.mamba2_d_inner, cfg.mamba2_nheads, m.headdim, m.ngroups, m.d_state, cfg.mamba2_conv_dim


def mamba2_block(params, x, cfg):
    """x [B, L, d_model] -> (y [B, L, d_model], saved for the backward)."""
    Bsz, L, d = x.shape
    di, H, P, G, N, conv_dim = _dims(cfg)
    lo, hi = cfg.mamba2.dt_limit
    x2 = x.reshape(-1, d)
    zxbcdt = linear(x2, params["in_proj.weight"], params.get("in_proj.bias"))  # [M, di + conv_dim + H]
    z = column_slice(zxbcdt, 0, di)
    xBC = column_slice(zxbcdt, di, conv_dim).reshape(Bsz, L, conv_dim)
    dt_in = column_slice(zxbcdt, di + conv_dim, H).reshape(Bsz, L, H)
    xBC_conv = conv1d(xBC, params["conv1d.weight"], params.get("conv1d.bias"))
    u = silu(xBC_conv).reshape(-1, conv_dim)
    xs = column_slice(u, 0, di).reshape(Bsz, L, H, P)
    Bm = column_slice(u, di, G * N).reshape(Bsz, L, G, N)
    Cm = column_slice(u, di + G * N, G * N).reshape(Bsz, L, G, N)
    dt_pre = dt_in + params["dt_bias"]
    dt_soft = softplus(dt_pre)
    delta = np.clip(dt_soft, lo, hi)
    A = -exp(params["A_log"])
    ys = ssd(xs, delta, A, Bm, Cm, cfg.mamba2.chunk_size) + params["D"][:, None] * xs
    ys = ys.reshape(-1, di)
    yn = rmsnorm_gated(ys, z, params["norm.weight"], di // G, cfg.norm_eps)
    y = linear(yn, params["out_proj.weight"], params.get("out_proj.bias")).reshape(Bsz, L, d)
    saved = dict(x2=x2, z=z, xBC=xBC, xBC_conv=xBC_conv, xs=xs, Bm=Bm, Cm=Cm, dt_pre=dt_pre, dt_soft=dt_soft,
                 delta=delta, A=A, ys=ys, yn=yn)
    return y, saved


def mamba2_block_backward(params, saved, dy, cfg):
    """dy [B, L, d_model] -> (dx [B, L, d_model], grads: dict name -> array, shaped as params)."""
    s = saved
    Bsz, L, d = dy.shape
    di, H, P, G, N, conv_dim = _dims(cfg)
    lo, hi = cfg.mamba2.dt_limit
    grads = {}
    dyn, grads["out_proj.weight"], db = linear_backward(s["yn"], params["out_proj.weight"], dy.reshape(-1, d))
    if "out_proj.bias" in params:
        grads["out_proj.bias"] = db
    dys, dz, grads["norm.weight"] = rmsnorm_gated_backward(s["ys"], s["z"], params["norm.weight"], di // G, dyn,
                                                           cfg.norm_eps)
    dys = dys.reshape(Bsz, L, H, P)
    grads["D"] = np.sum(dys * s["xs"], axis=(0, 1, 3))
    dxs, ddelta, dA, dB, dC = ssd_backward(s["xs"], s["delta"], s["A"], s["Bm"], s["Cm"], dys)
    dxs = dxs + params["D"][:, None] * dys
    grads["A_log"] = exp_backward(params["A_log"], -dA)
    # torch.clamp passes the gradient where lo <= x <= hi (both ends included).
    ddt_pre = softplus_backward(s["dt_pre"], ddelta * ((s["dt_soft"] >= lo) & (s["dt_soft"] <= hi)))
    grads["dt_bias"] = ddt_pre.sum(axis=(0, 1))
    du = column_concat([dxs.reshape(-1, di), dB.reshape(-1, G * N), dC.reshape(-1, G * N)]).reshape(Bsz, L, conv_dim)
    dxBC, grads["conv1d.weight"], db = conv1d_backward(s["xBC"], params["conv1d.weight"],
                                                      silu_backward(s["xBC_conv"], du))
    if "conv1d.bias" in params:
        grads["conv1d.bias"] = db
    dzxbcdt = column_concat([dz, dxBC.reshape(-1, conv_dim), ddt_pre.reshape(-1, H)])
    dx, grads["in_proj.weight"], db = linear_backward(s["x2"], params["in_proj.weight"], dzxbcdt)
    if "in_proj.bias" in params:
        grads["in_proj.bias"] = db
    return dx.reshape(Bsz, L, d), grads
