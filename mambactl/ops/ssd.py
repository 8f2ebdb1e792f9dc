"""Mamba-2 SSD scan with fused Δ = clamp(softplus(dt + dt_bias)), A = −exp(A_log) and D skip, forward and exact
backward (kernels/ssd.wgsl; the math and the kernel plan are in that file's header).

    S_t = exp(Δ_t A) S_{t−1} + Δ_t x_t B_tᵀ  (per batch and head, S is headdim × d_state),  y_t = S_t C_t + D x_t

Shapes: x, y [B, L, H, P] (the [B·L, d_inner] rows split into heads); dt_raw [B, L, H]; B, C [B, L, G, N], head h
reading group h // (H / G); A_log, D, dt_bias [H]. Memory: the forward saves the state entering every chunk
([B, ceil(L / chunk), H, P, N]), the state after the last step ([B, H, P, N]: `ssd_step` continues the
recurrence from it, one token at a time) and references to its inputs; the backward recomputes Δ and the
in-chunk decays. The backward's transients: one more such state tensor, two tensors of x's size, the decay sums
[B, H, n_chunks, 5, chunk], the crossing partials [B, H, n_chunks, ceil(chunk / 64), chunk], U's pieces
[B, H, n_chunks, ceil(N / 64), chunk] and, when a group has several heads, dB's and dC's per-head terms
[B, L, H, N] (summed over the group's heads in order).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mambactl.errors import ShapeError
from mambactl.ops.checks import expect, grid_1d
from mambactl.runtime.tensor import Tensor

WORKGROUP = 256  # mirrors kernels/ssd.wgsl's WG
MAX_CHUNK = 1024  # mirrors MAX_CHUNK there: ssd_prep / ssd_dt_backward hold a chunk in workgroup memory
TILE = 64
DEFAULT_CHUNK = 256  # mamba_ssm's chunk_size
NO_LIMIT = 3.0e38  # an upper clamp that never binds (a finite float32)


@dataclass
class SSDSaved:
    """What the backward needs: the forward's inputs (not copied) and the chunk entry states."""

    x: Tensor
    dt_raw: Tensor
    A_log: Tensor
    B: Tensor
    C: Tensor
    D: Tensor
    dt_bias: Tensor
    states: Tensor  # [B, n_chunks, H, P, N]: the state entering chunk c
    chunk: int
    dt_limit: tuple[float, float]
    last_state: Tensor  # [B, H, P, N]: the state after the last step (to continue recurrently, `ssd_step`)


def _check_inputs(op: str, x, dt_raw, A_log, B, C, D, dt_bias) -> tuple[int, int, int, int, int, int]:
    expect(op, "x", x, (None, None, None, None))
    batch, length, heads, headdim = x.shape
    if min(x.shape) < 1:
        raise ShapeError(f"{op}: x has shape {x.shape}; batch, length, heads and headdim must be at least 1")
    expect(op, "dt_raw", dt_raw, (batch, length, heads))
    expect(op, "B", B, (batch, length, None, None))
    groups, nstate = B.shape[2], B.shape[3]
    if groups < 1 or nstate < 1 or heads % groups:
        raise ShapeError(f"{op}: B has shape {B.shape}; its groups must divide the {heads} heads and N be >= 1")
    expect(op, "C", C, B.shape)
    for name, t in (("A_log", A_log), ("D", D), ("dt_bias", dt_bias)):
        expect(op, name, t, (heads,))
    return batch, length, heads, headdim, groups, nstate


def _dims(batch, length, heads, headdim, groups, nstate, chunk, dt_limit) -> dict:
    lo, hi = dt_limit
    return dict(batch=batch, len=length, heads=heads, ngroups=groups, headdim=headdim, nstate=nstate, chunk=chunk,
                nchunks=-(-length // chunk), dt_min=float(lo), dt_max=float(min(hi, NO_LIMIT)))


def _prep(rt, dims: dict, dt_raw, dt_bias, A_log) -> Tensor:
    """Δ and the in-chunk decay sums of Δ·A: [B, H, n_chunks, 5, chunk] (kernels/ssd.wgsl's `dec`)."""
    dec = rt.empty((dims["batch"], dims["heads"], dims["nchunks"], 5, dims["chunk"]))
    rt.run("ssd_prep", (dims["nchunks"], dims["heads"], dims["batch"]), dt_raw=dt_raw, dt_bias=dt_bias, A_log=A_log,
           dec_out=dec, **dims)
    return dec


def _chunk_state(rt, dims: dict, dec, left, right, grad: bool) -> Tensor:
    b, h, p, n, nc = dims["batch"], dims["heads"], dims["headdim"], dims["nstate"], dims["nchunks"]
    states = rt.empty((b, nc, h, p, n))
    groups = (-(-p // TILE) * -(-n // TILE), nc * h, b)
    rt.run("ssd_chunk_state", groups, {"GRAD": grad}, dec=dec, left=left, right=right, states=states,
           **dims)
    return states


def _chunk_scan(rt, dims: dict, dec, q, k, v, st, out, *, reverse=False, q_dt=False, k_dt=False, skip=None,
                per_group=False, out_state=None, row_dot=None) -> None:
    """One ssd_chunk_scan mode (see kernels/ssd.wgsl), one head per workgroup. `out` has v's layout, or
    per_group (dB, dC: v is B or C) a group's heads are summed into it by ssd_sum_heads, in order; out_state has
    x's layout. row_dot = (C, u_part): also U_r = C_r·(state term)_r per 64-wide piece of N into u_part."""
    H, G, P, N = dims["heads"], dims["ngroups"], dims["headdim"], dims["nstate"]
    if per_group:  # q, k: x or dy (a block per head); v: B or C (a block per group); state Pᵀ × N
        qk, vv, (s_j, s_k) = (H, P, 1), (G, N, H // G), (1, N)
    else:  # q, k: C or B; v: x or dy; state P × N
        qk, vv, (s_j, s_k) = (G, N, H // G), (H, P, 1), (N, 1)
    v_dim = vv[1]
    consts = {"REVERSE": reverse, "Q_DT": q_dt, "K_DT": k_dt, "ADD_SKIP": skip is not None,
              "STATE_OUT": out_state is not None, "ROW_DOT": row_dot is not None}
    per_head = out if not per_group or H == G else rt.empty((dims["batch"], dims["len"], H, v_dim))
    grid = (-(-v_dim // TILE) * -(-dims["chunk"] // TILE), dims["nchunks"] * H, dims["batch"])
    # Modes without a D skip, a separate state term or a row dot still bind something there: `dec` (read-only,
    # as it is bound anyway) and a one-element scratch (never written).
    c_in, u_part = row_dot if row_dot is not None else (dec, rt.empty((1,)))
    rt.run("ssd_chunk_scan", grid, consts, dec=dec, q_in=q, k_in=k, v_in=v, st_in=st, out=per_head,
           out_state=rt.empty((1,)) if out_state is None else out_state, skip=dec if skip is None else skip,
           c_in=c_in, u_part=u_part, len=dims["len"], heads=H, chunk=dims["chunk"], nchunks=dims["nchunks"],
           qk_width=qk[0], qk_dim=qk[1], qk_div=qk[2], v_width=vv[0], v_dim=v_dim, v_div=vv[2], s_j=s_j, s_k=s_k,
           pn=P * N)
    if per_head is not out:
        rt.run("ssd_sum_heads", grid_1d(out.size), head_part=per_head, out=out, **dims)


def ssd_scan(x: Tensor, dt_raw: Tensor, A_log: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor,
             chunk: int = DEFAULT_CHUNK, dt_limit: tuple[float, float] = (0.0, NO_LIMIT)) -> tuple[Tensor, SSDSaved]:
    """x [B, L, H, P], dt_raw [B, L, H], A_log, D, dt_bias [H], B, C [B, L, G, N] -> (y [B, L, H, P], saved).

    `chunk` (1..1024) is the SSD chunk length; any L works (the last chunk is masked). `dt_limit` = (lo, hi)
    clamps Δ after the softplus (mamba_ssm's dt_limit; hi may be inf)."""
    op = "ssd_scan"
    batch, length, heads, headdim, groups, nstate = _check_inputs(op, x, dt_raw, A_log, B, C, D, dt_bias)
    if not 1 <= chunk <= MAX_CHUNK:
        raise ShapeError(f"{op}: chunk is {chunk}; it must be in [1, {MAX_CHUNK}]")
    chunk = min(chunk, length)  # one chunk holds the whole sequence either way; a longer one is only padding
    dims = _dims(batch, length, heads, headdim, groups, nstate, chunk, dt_limit)
    rt = x.runtime
    dec = _prep(rt, dims, dt_raw, dt_bias, A_log)
    states = _chunk_state(rt, dims, dec, x, B, grad=False)
    last_state = rt.empty((batch, heads, headdim, nstate))
    rt.run("ssd_state_passing", grid_1d(batch * heads * headdim * nstate), dec=dec, states=states,
           last_state=last_state, **dims)
    y = rt.empty(x.shape)
    _chunk_scan(rt, dims, dec, C, B, x, states, y, k_dt=True, skip=D)
    return y, SSDSaved(x, dt_raw, A_log, B, C, D, dt_bias, states, chunk, (dims["dt_min"], dims["dt_max"]),
                       last_state)


def ssd_step(state: Tensor, x: Tensor, dt_raw: Tensor, A_log: Tensor, B: Tensor, C: Tensor, D: Tensor,
             dt_bias: Tensor, dt_limit: tuple[float, float] = (0.0, NO_LIMIT)) -> Tensor:
    """One decoding step per batch row. x [B, H·P], dt_raw [B, H], B, C [B, G·N], A_log, D, dt_bias [H];
    state [B, H, P, N] (e.g. a forward's `saved.last_state`) is advanced in place. -> y [B, H·P], the parallel
    scan's output at that position: Δ = clamp(softplus(dt_raw + dt_bias), dt_limit),
    S = exp(Δ A) S + Δ x Bᵀ, y = S C + D x."""
    op = "ssd_step"
    expect(op, "state", state, (None, None, None, None))
    batch, heads, headdim, nstate = state.shape
    if min(state.shape) < 1:
        raise ShapeError(f"{op}: state has shape {state.shape}; every dimension must be at least 1")
    expect(op, "x", x, (batch, heads * headdim))
    expect(op, "dt_raw", dt_raw, (batch, heads))
    expect(op, "B", B, (batch, None))
    if B.shape[1] % nstate or B.shape[1] < nstate or heads % (B.shape[1] // nstate):
        raise ShapeError(f"{op}: B has shape {B.shape}; its width must be G·{nstate}, G dividing the {heads} heads")
    groups = B.shape[1] // nstate
    expect(op, "C", C, B.shape)
    for name, t in (("A_log", A_log), ("D", D), ("dt_bias", dt_bias)):
        expect(op, name, t, (heads,))
    dims = _dims(batch, 1, heads, headdim, groups, nstate, 1, dt_limit)
    rt = x.runtime
    y = rt.empty(x.shape)
    rt.run("ssd_step", grid_1d(batch * heads * headdim, 64), x=x, dt_raw=dt_raw, dt_bias=dt_bias, A_log=A_log,
           b_in=B, c_in=C, skip=D, ssm_state=state, out=y, **dims)
    return y


def ssd_scan_backward(saved: SSDSaved, dy: Tensor, grads: Mapping[str, Tensor] | None = None):
    """dy [B, L, H, P] -> (dx, ddt_raw, dA_log, dB, dC, dD, ddt_bias), shaped like the inputs.

    ddt_raw is the gradient w.r.t. the forward's dt_raw (through the clamp and softplus). `grads`, a mapping
    with keys "A_log", "D" and "dt_bias", makes the parameter gradients add into those tensors (and returns them).
    """
    op = "ssd_scan_backward"
    s = saved
    batch, length, heads, headdim, groups, nstate = _check_inputs(op, s.x, s.dt_raw, s.A_log, s.B, s.C, s.D, s.dt_bias)
    expect(op, "dy", dy, s.x.shape)
    dims = _dims(batch, length, heads, headdim, groups, nstate, s.chunk, s.dt_limit)
    nc = dims["nchunks"]
    expect(op, "saved states", s.states, (batch, nc, heads, headdim, nstate))
    accumulate = grads is not None
    if accumulate:
        missing = {"A_log", "D", "dt_bias"} - set(grads)
        if missing:
            raise ShapeError(f"{op}: grads lacks {sorted(missing)}; give all of A_log, D and dt_bias")
        dA_log, dD, ddt_bias = (expect(op, f"grads[{k!r}]", grads[k], (heads,)) for k in ("A_log", "D", "dt_bias"))
    rt = dy.runtime
    if not accumulate:
        dA_log, dD, ddt_bias = rt.empty((heads,)), rt.empty((heads,)), rt.empty((heads,))
    dec = _prep(rt, dims, s.dt_raw, s.dt_bias, s.A_log)
    # The in-chunk part of dE, turned in place into dS_c = dE_{c+1}, with the partials of W_c.
    dstates = _chunk_state(rt, dims, dec, dy, s.C, grad=True)
    state_tiles = -(-headdim * nstate // WORKGROUP)
    w_part = rt.empty((batch, heads, nc, state_tiles))
    rt.run("ssd_state_passing_backward", (state_tiles, heads, batch), dec=dec, states=dstates,
           saved_states=s.states, w_part=w_part, **dims)
    dx, dxd_state = rt.empty(s.x.shape), rt.empty(s.x.shape)  # dx holds ∂loss/∂(Δ x) until ssd_dt_backward
    _chunk_scan(rt, dims, dec, s.B, s.C, dy, dstates, dx, reverse=True, out_state=dxd_state)
    dB, dC = rt.empty(s.B.shape), rt.empty(s.C.shape)
    _chunk_scan(rt, dims, dec, s.x, dy, s.C, dstates, dB, reverse=True, q_dt=True, per_group=True)
    # dC's state term exp(cs_t) Eᵀ dy_t dotted with C_t is U_t = dy_t·y_off_t (y_off_t = exp(cs_t) E C_t).
    u_part = rt.empty((batch, heads, nc, -(-nstate // TILE), s.chunk))
    _chunk_scan(rt, dims, dec, dy, s.x, s.B, s.states, dC, k_dt=True, per_group=True, row_dot=(s.C, u_part))
    row_tiles = -(-s.chunk // TILE)
    x_part = rt.empty((batch, heads, nc, row_tiles, s.chunk))
    rt.run("ssd_decay_grad", (row_tiles, nc * heads, batch), dec=dec, b_in=s.B, c_in=s.C, x=s.x, dy=dy,
           x_part=x_part, **dims)
    ddt_raw = rt.empty(s.dt_raw.shape)
    param_part = rt.empty((batch, nc, heads, 3))
    rt.run("ssd_dt_backward", (nc, heads, batch), dec=dec, dt_raw=s.dt_raw, dt_bias=s.dt_bias, A_log=s.A_log,
           skip=s.D, x=s.x, dy=dy, u_part=u_part, dxd_state=dxd_state, dx=dx, w_part=w_part, x_part=x_part,
           ddt_raw=ddt_raw, param_part=param_part, **dims)
    rt.run("ssd_param_grads", grid_1d(heads, 64), {"ACCUMULATE": accumulate}, param_part=param_part,
           dA_log=dA_log, dD=dD, ddt_bias=ddt_bias, **dims)
    return dx, ddt_raw, dA_log, dB, dC, dD, ddt_bias
