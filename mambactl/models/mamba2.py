"""Mamba-2 (SSD) mixer on the GPU: forward and backward through the ops (mamba_ssm `Mamba2`, HF `Mamba2Mixer`).

in_proj -> [z | xBC | dt] columns -> causal depthwise conv1d + SiLU over xBC -> [x | B | C] -> SSD scan with
Δ = clamp(softplus(dt + dt_bias), dt_limit), A = −exp(A_log) and the D skip -> gated RMSNorm of y·silu(z) in
groups of d_inner / ngroups -> out_proj. `p` and `g` map this layer's mixer names without prefix
("in_proj.weight", "A_log", ...) to parameter and gradient tensors; gradients are accumulated into `g`.
"""

from __future__ import annotations

from mambactl.models.config import ModelConfig
from mambactl.ops import conv1d, linear, slice
from mambactl.ops.fill import zeros
from mambactl.ops.rmsnorm_gated import rmsnorm_gated, rmsnorm_gated_backward
from mambactl.ops.ssd import ssd_scan, ssd_scan_backward, ssd_step
from mambactl.runtime.tensor import Tensor


def _dims(cfg: ModelConfig):
    m = cfg.mamba2
    return m, cfg.mamba2_d_inner, cfg.mamba2_nheads, m.headdim, m.ngroups, m.d_state, cfg.mamba2_conv_dim


def _in_proj(p: dict, x: Tensor, rows: int, heads: int) -> tuple[Tensor, Tensor]:
    """in_proj as two products: [z | xBC] ([M, rows]) and dt ([M, heads]), from the weight's (and bias's) row blocks.
    Apart, [z | xBC] takes whole 128-column GEMM tiles more often (the 130m shape's 3328 = 26·128, where 3352 columns
    padded a 27th tile for dt's 24) and dt needs no column slice for the scan: H200, 130m, a step 212.3-212.7 ->
    211.6-211.8 ms streamed (2026-12-02, two rounds alternating). The backward keeps one [M, 3352] gradient."""
    w, b = p["in_proj.weight"], p.get("in_proj.bias")

    def part(start, n):
        return linear.linear(x, slice.row_block(w, start, n), None if b is None else slice.row_block(b, start, n))

    return part(0, rows), part(rows, heads)


def mamba2_forward(p: dict, x: Tensor, batch: int, length: int, cfg: ModelConfig):
    """x [B·L, d_model] -> (y [B·L, d_model], saved)."""
    m, di, H, P, G, N, conv_dim = _dims(cfg)
    rt = x.runtime
    zxbc, dt = _in_proj(p, x, di + conv_dim, H)
    conv_w = p["conv1d.weight"].reshape(conv_dim, m.d_conv)
    conv_b = p["conv1d.bias"] if m.conv_bias else zeros(rt, (conv_dim,))
    zxbc3 = zxbc.reshape(batch, length, -1)  # the conv reads its xBC columns in place, writes x, B, C apart
    xs, Bm, Cm = conv1d.conv1d_silu(zxbc3, conv_w, conv_b, x_start=di, parts=[di, G * N, G * N])
    y, scan_saved = ssd_scan(
        xs.reshape(batch, length, H, P), dt.reshape(batch, length, H), p["A_log"],
        Bm.reshape(batch, length, G, N), Cm.reshape(batch, length, G, N), p["D"], p["dt_bias"],
        dt_limit=tuple(m.dt_limit),  # the kernel chunk is the op's choice (ops/ssd.py kernel_chunk), not chunk_size
    )
    y = y.reshape(-1, di)
    yn, rstd = rmsnorm_gated(y, zxbc, p["norm.weight"], di // G, cfg.norm_eps, z_start=0)  # z: columns [0, di)
    out = linear.linear(yn, p["out_proj.weight"], p.get("out_proj.bias"))
    saved = dict(x=x, zxbc=zxbc, zxbc3=zxbc3, y=y, rstd=rstd, yn=yn, scan=scan_saved, conv_w=conv_w,
                 conv_b=conv_b, batch=batch, length=length)
    return out, saved


def mamba2_backward(p: dict, g: dict, saved: dict, dout: Tensor, cfg: ModelConfig) -> Tensor:
    """dout [B·L, d_model] -> dx [B·L, d_model]; parameter gradients are added into `g`."""
    m, di, H, P, G, N, conv_dim = _dims(cfg)
    s = saved
    B, L = s["batch"], s["length"]
    dyn, _, _ = linear.linear_backward(s["yn"], p["out_proj.weight"], dout, dw=g["out_proj.weight"],
                                       db=g.get("out_proj.bias"))
    dzxbcdt = dout.runtime.empty((B * L, di + conv_dim + H))  # [dz | dxBC | ddt], each written in place
    dy, _, _ = rmsnorm_gated_backward(s["y"], s["zxbc"], p["norm.weight"], s["rstd"], di // G, dyn,
                                      dw=g["norm.weight"], z_start=0, dz_out=(dzxbcdt, 0))
    dxs, ddt, _, dB, dC, _, _ = ssd_scan_backward(
        s["scan"], dy.reshape(B, L, H, P), grads={"A_log": g["A_log"], "D": g["D"], "dt_bias": g["dt_bias"]},
    )
    conv_dw = g["conv1d.weight"].reshape(conv_dim, m.d_conv)
    conv_db = g["conv1d.bias"] if m.conv_bias else zeros(dout.runtime, (conv_dim,))
    du = [dxs.reshape(B, L, di), dB.reshape(B, L, G * N), dC.reshape(B, L, G * N)]  # read in place by the walk
    conv1d.conv1d_silu_backward(s["zxbc3"], s["conv_w"], s["conv_b"], du, dw=conv_dw, db=conv_db, x_start=di,
                                dx_out=(dzxbcdt.reshape(B, L, -1), di))
    slice.column_scatter(ddt.reshape(-1, H), dzxbcdt, di + conv_dim)
    dx, _, _ = linear.linear_backward(s["x"], p["in_proj.weight"], dzxbcdt, dw=g["in_proj.weight"],
                                      db=g.get("in_proj.bias"))
    return dx


def mamba2_decode_state(saved: dict, cfg: ModelConfig) -> dict:
    """The recurrent state after a parallel forward: the conv window of xBC and the scan's last state."""
    return {"conv": conv1d.conv1d_state(saved["zxbc3"], cfg.mamba2.d_conv, x_start=cfg.mamba2_d_inner,
                                        channels=cfg.mamba2_conv_dim), "ssm": saved["scan"].last_state}


def mamba2_step(p: dict, x: Tensor, state: dict, cfg: ModelConfig) -> Tensor:
    """One token per batch row: x [B, d_model] -> [B, d_model]; `state` (conv window, SSM state) advances."""
    m, di, H, P, G, N, conv_dim = _dims(cfg)
    rt = x.runtime
    zxbcdt = linear.linear(x, p["in_proj.weight"], p.get("in_proj.bias"))
    conv_b = p["conv1d.bias"] if m.conv_bias else zeros(rt, (conv_dim,))
    xs, Bm, Cm = conv1d.conv1d_step(state["conv"], zxbcdt, p["conv1d.weight"].reshape(conv_dim, m.d_conv), conv_b,
                                    x_start=di, silu=True, parts=[di, G * N, G * N])
    y = ssd_step(state["ssm"], xs, zxbcdt, p["A_log"], Bm, Cm, p["D"], p["dt_bias"], dt_limit=tuple(m.dt_limit),
                 dt_start=di + conv_dim)
    yn, _ = rmsnorm_gated(y, zxbcdt, p["norm.weight"], di // G, cfg.norm_eps, z_start=0)
    return linear.linear(yn, p["out_proj.weight"], p.get("out_proj.bias"))
