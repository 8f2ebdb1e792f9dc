"""Mamba-1 (S6) mixer on the GPU: forward and backward through the ops (mamba_ssm `Mamba`, HF `MambaMixer`).

in_proj -> [x | z] columns -> causal depthwise conv1d + SiLU -> x_proj -> [dt | B | C] -> dt_proj (its bias
is fused into the scan) -> selective scan with softplus(Δ), D skip and SiLU(z) gate -> out_proj.
`p` and `g` map this layer's mixer names without prefix ("in_proj.weight", "A_log", ...) to parameter and
gradient tensors; gradients are accumulated into `g` (gradient accumulation over micro-batches).
"""

from __future__ import annotations

from mambactl.models.config import ModelConfig
from mambactl.ops import conv1d, linear, slice
from mambactl.ops.fill import zeros
from mambactl.ops.selective_scan import selective_scan, selective_scan_backward, selective_scan_step
from mambactl.runtime.tensor import Tensor


def mamba1_forward(p: dict, x: Tensor, batch: int, length: int, cfg: ModelConfig):
    """x [B·L, d_model] -> (y [B·L, d_model], saved)."""
    m, di, R, N = cfg.mamba1, cfg.d_inner, cfg.dt_rank, cfg.mamba1.d_state
    rt = x.runtime
    xz = linear.linear(x, p["in_proj.weight"], p.get("in_proj.bias"))
    conv_w = p["conv1d.weight"].reshape(di, m.d_conv)
    conv_b = p["conv1d.bias"] if m.conv_bias else zeros(rt, (di,))
    xz3 = xz.reshape(batch, length, 2 * di)  # the conv reads its x columns [0, d_inner) in place, the scan its z
    u = conv1d.conv1d_silu(xz3, conv_w, conv_b, x_start=0).reshape(-1, di)
    x_dbl = linear.linear(u, p["x_proj.weight"])
    dt_in, Bm, Cm = slice.column_split(x_dbl, [R, N, N])
    delta = linear.linear(dt_in, p["dt_proj.weight"])  # dt_proj.bias is added inside the scan
    shape3 = (batch, length, di)
    y, scan_saved = selective_scan(
        u.reshape(shape3), delta.reshape(shape3), p["A_log"], Bm.reshape(batch, length, N),
        Cm.reshape(batch, length, N), p["D"], xz3, p["dt_proj.bias"], z_start=di,
    )
    y = y.reshape(-1, di)
    out = linear.linear(y, p["out_proj.weight"], p.get("out_proj.bias"))
    saved = dict(x=x, xz3=xz3, u=u, dt_in=dt_in, y=y, scan=scan_saved, conv_w=conv_w, conv_b=conv_b,
                 batch=batch, length=length)
    return out, saved


def mamba1_backward(p: dict, g: dict, saved: dict, dout: Tensor, cfg: ModelConfig) -> Tensor:
    """dout [B·L, d_model] -> dx [B·L, d_model]; parameter gradients are added into `g`."""
    m, di = cfg.mamba1, cfg.d_inner
    s = saved
    dy, _, _ = linear.linear_backward(s["y"], p["out_proj.weight"], dout, dw=g["out_proj.weight"], db=g.get("out_proj.bias"))
    dxz3 = dout.runtime.empty(s["xz3"].shape)  # [dx | dz]: the scan writes dz's columns, the conv dx's
    du, ddelta, _, dB, dC, _, _, _ = selective_scan_backward(
        s["scan"], dy.reshape(s["batch"], s["length"], di),
        grads={"A_log": g["A_log"], "D": g["D"], "delta_bias": g["dt_proj.bias"]}, dz_out=(dxz3, di),
    )
    ddt_in, _, _ = linear.linear_backward(s["dt_in"], p["dt_proj.weight"], ddelta.reshape(-1, di), dw=g["dt_proj.weight"])
    dx_dbl = slice.column_concat([ddt_in, dB.reshape(-1, m.d_state), dC.reshape(-1, m.d_state)])
    du2, _, _ = linear.linear_backward(s["u"], p["x_proj.weight"], dx_dbl, dw=g["x_proj.weight"])
    conv_dw = g["conv1d.weight"].reshape(di, m.d_conv)
    conv_db = g["conv1d.bias"] if m.conv_bias else zeros(dout.runtime, (di,))
    shape3 = (s["batch"], s["length"], di)
    conv1d.conv1d_silu_backward(  # u fed the scan (du) and x_proj (du2)
        s["xz3"], s["conv_w"], s["conv_b"], du.reshape(shape3), du2.reshape(shape3), dw=conv_dw, db=conv_db,
        x_start=0, dx_out=(dxz3, 0),
    )
    dx, _, _ = linear.linear_backward(s["x"], p["in_proj.weight"], dxz3.reshape(-1, 2 * di), dw=g["in_proj.weight"],
                                      db=g.get("in_proj.bias"))
    return dx


def mamba1_decode_state(saved: dict, cfg: ModelConfig) -> dict:
    """The recurrent state after a parallel forward: the conv window and the scan's last state."""
    return {"conv": conv1d.conv1d_state(saved["xz3"], cfg.mamba1.d_conv, x_start=0, channels=cfg.d_inner),
            "ssm": saved["scan"].last_state}


def mamba1_step(p: dict, x: Tensor, state: dict, cfg: ModelConfig) -> Tensor:
    """One token per batch row: x [B, d_model] -> [B, d_model]; `state` (conv window, SSM state) advances."""
    m, di, R, N = cfg.mamba1, cfg.d_inner, cfg.dt_rank, cfg.mamba1.d_state
    rt = x.runtime
    xz = linear.linear(x, p["in_proj.weight"], p.get("in_proj.bias"))
    conv_b = p["conv1d.bias"] if m.conv_bias else zeros(rt, (di,))
    u = conv1d.conv1d_step(state["conv"], xz, p["conv1d.weight"].reshape(di, m.d_conv), conv_b, silu=True)
    x_dbl = linear.linear(u, p["x_proj.weight"])
    delta = linear.linear(slice.column_slice(x_dbl, 0, R), p["dt_proj.weight"])
    # z, B and C read in place in xz's and x_dbl's rows
    y = selective_scan_step(state["ssm"], u, delta, p["A_log"], x_dbl, x_dbl, p["D"], xz, p["dt_proj.bias"],
                            z_start=di, b_start=R, c_start=R + N)
    return linear.linear(y, p["out_proj.weight"], p.get("out_proj.bias"))
