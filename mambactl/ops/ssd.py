"""The SSD scan (state space duality): a general chunked core and Mamba-2's composition around it, forward and
exact backward (kernels/ssd.wgsl; the math and the kernel plan are in that file's header).

The core, `ssd_chunked` / `ssd_chunked_backward`, per batch and head (S is headdim × d_state):

    S_t = exp(adt_t) S_{t−1} + scale_t x_t B_tᵀ,   y_t = S_t C_t (+ D x_t when D is given)

with the per-step log-decay adt [B, L, H] (≤ 0) and input scale [B, L, H] given directly (Mamba-3 builds them
its own way). Mamba-2's `ssd_scan` / `ssd_scan_backward` are an elementwise prep (scale = Δ =
clamp(softplus(dt_raw + dt_bias)), adt = Δ A, A = −exp(A_log)), the core, and the chain rule back to dt_raw,
A_log and dt_bias.

Shapes: x, y [B, L, H, P] (the [B·L, d_inner] rows split into heads); B, C [B, L, G, N], head h reading group
h // (H / G); D [H]. Memory: the forward saves the state entering every chunk ([B, ceil(L / chunk), H, P, N]),
the state after the last step ([B, H, P, N]: decoding continues from it, Mamba-2's `ssd_step` one token at a
time) and references to its inputs; the backward recomputes the in-chunk decays (and Mamba-2's Δ). The
backward's transients: one more such state tensor, two tensors of x's size, the decay sums
[B, H, n_chunks, 5, chunk], the crossing partials [B, H, n_chunks, ceil(chunk / 64), chunk], U's pieces
[B, H, n_chunks, ceil(N / 64), chunk] and, when a group has several heads, dB's and dC's per-head terms
[B, L, H, N] (summed over the group's heads in order).

On Mesa llvmpipe (its loop budget of 65,535 iterations per shader invocation: mambactl/ops/checks.py) the walks
over chunks (the state passing, forward and backward, and the sums of the per-chunk parameter partials) go in
dispatch segments carrying their running sums in a buffer; the in-chunk kernels' loops are bounded by the chunk
(at most 1024), P and N (`kernel_loops`), and a shape past the budget there is refused before dispatch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mambactl.errors import ShapeError
from mambactl.ops.checks import expect, grid_1d, loop_budget, segment_length, segments
from mambactl.runtime.tensor import Tensor

WORKGROUP = 256  # mirrors kernels/ssd.wgsl's WG
MAX_CHUNK = 1024  # mirrors MAX_CHUNK there: ssd_prep / ssd_rows_backward hold a chunk in workgroup memory
TILE = 64
DEFAULT_CHUNK = 256  # mamba_ssm's chunk_size
NO_LIMIT = 3.0e38  # an upper clamp that never binds (a finite float32)
KT = 16  # mirrors KT there: depth of a slice through workgroup memory
SUB = 16  # mirrors SUB there: sub-block of the pair decays
SCAN_THREADS = 128  # the tile kernels' workgroup (8 × 16)


# --- loop iterations per shader invocation (upper bounds, no loop unrolled), for Mesa llvmpipe's budget ---------
SLICE = 1 + 8 + KT  # one KT-deep slice through workgroup memory: 8 loads per thread, then mac_wide's KT steps
BLOCK_OUT = 4 * (1 + 8)  # a thread's 4 × 8 register block written out
REDUCE = 8  # log2(WORKGROUP) rounds of workgroup_sum / exclusive_prefix
PASSING_LOOPS = 1  # ssd_state_passing per chunk
PASSING_BACKWARD_LOOPS = 1 + REDUCE  # ssd_state_passing_backward per chunk (a workgroup sum of W_c each)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kernel_loops(chunk: int, headdim: int, nstate: int, heads: int = 1, groups: int = 1) -> dict[str, int]:
    """Loop iterations per invocation of the kernels whose loops are bounded by the chunk, P and N (the walks
    over chunks are per chunk: PASSING_LOOPS, PASSING_BACKWARD_LOOPS, and one per (batch, chunk) partial in
    ssd_param_grads). `chunk` is the effective one (min(chunk, L)). ssd_chunk_scan: the largest over its modes
    (the q·k depth is N for y and dxd, P for dB and dC); every mode's extras counted."""
    q, tiles = chunk, _cdiv(chunk, TILE)
    seg = _cdiv(q, WORKGROUP)

    def scan(depth):
        state_term = _cdiv(depth, KT) * SLICE
        per_block = _cdiv(q, SUB) + _cdiv(depth, KT) * SLICE + BLOCK_OUT + _cdiv(TILE, KT) * SLICE
        return state_term + BLOCK_OUT + (BLOCK_OUT + 8) + tiles * per_block + BLOCK_OUT

    return {
        "ssd_prep": 2 * seg + 2 * REDUCE + 2 * SUB,
        "ssd_chunk_state": _cdiv(q, SCAN_THREADS) + _cdiv(q, KT) * SLICE + BLOCK_OUT,
        "ssd_chunk_scan": max(scan(nstate), scan(headdim)),
        "ssd_decay_grad": 2 * _cdiv(q, SCAN_THREADS) + tiles * (
            _cdiv(q, SUB) + (_cdiv(nstate, KT) + _cdiv(headdim, KT)) * SLICE + BLOCK_OUT + 3 * TILE
            + _cdiv(q, SCAN_THREADS)),
        "ssd_rows_backward": _cdiv(headdim * nstate, WORKGROUP) + _cdiv(q, 16) * (1 + _cdiv(headdim, 16) + 16)
        + seg * (1 + _cdiv(nstate, TILE)) + 2 * REDUCE + seg + seg * (1 + tiles) + REDUCE,
        "ssd_mamba2_backward": seg + 2 * REDUCE,
        "ssd_sum_heads": heads // groups,
        "ssd_step": nstate,
    }


def _check_loops(rt, op: str, shape, loops: dict[str, int], kernels) -> None:
    """Refuse (on llvmpipe, before anything is recorded) a shape whose in-chunk loops pass the budget."""
    for name in kernels:
        loop_budget(rt, f"{op} ({name})", shape, loops[name])


@dataclass
class SSDSaved:
    """What the core's backward needs: the forward's inputs (not copied) and the chunk entry states."""

    x: Tensor
    adt: Tensor
    scale: Tensor
    B: Tensor
    C: Tensor
    D: Tensor | None
    states: Tensor  # [B, n_chunks, H, P, N]: the state entering chunk c
    chunk: int
    last_state: Tensor  # [B, H, P, N]: the state after the last step (decoding continues from it)


@dataclass
class Mamba2SSDSaved:
    """What `ssd_scan_backward` needs: Mamba-2's inputs (not copied) and the core's chunk entry states (its Δ and
    Δ A are recomputed, so nothing of size B·L·H is kept)."""

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


def _check_core(op: str, x, adt, scale, B, C, D) -> tuple[int, int, int, int, int, int]:
    expect(op, "x", x, (None, None, None, None))
    batch, length, heads, headdim = x.shape
    if min(x.shape) < 1:
        raise ShapeError(f"{op}: x has shape {x.shape}; batch, length, heads and headdim must be at least 1")
    expect(op, "adt", adt, (batch, length, heads))
    expect(op, "scale", scale, (batch, length, heads))
    expect(op, "B", B, (batch, length, None, None))
    groups, nstate = B.shape[2], B.shape[3]
    if groups < 1 or nstate < 1 or heads % groups:
        raise ShapeError(f"{op}: B has shape {B.shape}; its groups must divide the {heads} heads and N be >= 1")
    expect(op, "C", C, B.shape)
    if D is not None:
        expect(op, "D", D, (heads,))
    return batch, length, heads, headdim, groups, nstate


def _check_inputs(op: str, x, dt_raw, A_log, B, C, D, dt_bias) -> tuple[int, int, int, int, int, int]:
    dims = _check_core(op, x, dt_raw, dt_raw, B, C, D)
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        expect(op, name, t, (dims[2],))
    return dims


def _dims(batch, length, heads, headdim, groups, nstate, chunk, dt_limit=(0.0, NO_LIMIT)) -> dict:
    lo, hi = dt_limit
    nchunks = -(-length // chunk)
    return dict(batch=batch, len=length, heads=heads, ngroups=groups, headdim=headdim, nstate=nstate, chunk=chunk,
                nchunks=nchunks, dt_min=float(lo), dt_max=float(min(hi, NO_LIMIT)), seg_lo=0, seg_hi=nchunks)


def _check_chunk(op: str, chunk: int, length: int) -> int:
    if not 1 <= chunk <= MAX_CHUNK:
        raise ShapeError(f"{op}: chunk is {chunk}; it must be in [1, {MAX_CHUNK}]")
    return min(chunk, length)  # one chunk holds the whole sequence either way; a longer one is only padding


def state_passing(rt, dims: dict, dec: Tensor, states: Tensor, last_state: Tensor, shape=None,
                  segment: int | None = None) -> None:
    """ssd_state_passing over the chunks, in dispatch segments of `segment` chunks (None: all of them, except on
    llvmpipe, whose loop budget sets it); E carried between segments in last_state."""
    nc = dims["nchunks"]
    seg = segment_length(rt, "ssd_chunked (ssd_state_passing)", shape, nc, PASSING_LOOPS, segment=segment)
    pn = dims["headdim"] * dims["nstate"]
    for lo, hi in segments(nc, seg):
        rt.run("ssd_state_passing", grid_1d(dims["batch"] * dims["heads"] * pn), dec=dec, states=states,
               last_state=last_state, **{**dims, "seg_lo": lo, "seg_hi": hi})


def state_passing_backward(rt, dims: dict, dec: Tensor, dstates: Tensor, saved_states: Tensor, w_part: Tensor,
                           shape=None, segment: int | None = None) -> None:
    """ssd_state_passing_backward, last chunk to first, in dispatch segments as `state_passing` (dE carried
    between segments in a [B, H, P·N] buffer)."""
    nc, pn = dims["nchunks"], dims["headdim"] * dims["nstate"]
    seg = segment_length(rt, "ssd_chunked_backward (ssd_state_passing_backward)", shape, nc,
                         PASSING_BACKWARD_LOOPS, segment=segment)
    carry = rt.empty((dims["batch"], dims["heads"], pn) if seg < nc else (1,))
    for lo, hi in reversed(segments(nc, seg)):
        rt.run("ssd_state_passing_backward", (_cdiv(pn, WORKGROUP), dims["heads"], dims["batch"]), dec=dec,
               states=dstates, saved_states=saved_states, w_part=w_part, carry=carry,
               **{**dims, "seg_lo": lo, "seg_hi": hi})


def param_grads(rt, dims: dict, param_part: Tensor, outs: list[Tensor], accumulate: bool, shape=None,
                segment: int | None = None, op: str = "ssd_chunked_backward") -> None:
    """ssd_param_grads: the B·nchunks partials [B·nchunks, H, len(outs)] added in order into outs (1 or 2
    tensors [H]), in dispatch segments as `state_passing` (the sums so far carried in an [H, len(outs)] buffer)."""
    total, k = dims["batch"] * dims["nchunks"], len(outs)
    seg = segment_length(rt, f"{op} (ssd_param_grads)", shape, total, 1, segment=segment)
    carry = rt.empty((dims["heads"], k) if seg < total else (1,))
    for lo, hi in segments(total, seg):
        rt.run("ssd_param_grads", grid_1d(dims["heads"], 64), {"ACCUMULATE": accumulate, "NPARAM": k},
               param_part=param_part, grad_0=outs[0], grad_1=outs[-1], carry=carry,
               **{**dims, "seg_lo": lo, "seg_hi": hi})


def _prep(rt, dims: dict, adt, scale) -> Tensor:
    """The scale and the in-chunk decay sums of adt: [B, H, n_chunks, 5, chunk] (kernels/ssd.wgsl's `dec`)."""
    dec = rt.empty((dims["batch"], dims["heads"], dims["nchunks"], 5, dims["chunk"]))
    rt.run("ssd_prep", (dims["nchunks"], dims["heads"], dims["batch"]), adt_in=adt, scale_in=scale, dec_out=dec,
           **dims)
    return dec
def _chunk_state(rt, dims: dict, dec, left, right, grad: bool) -> Tensor:
    b, h, p, n, nc = dims["batch"], dims["heads"], dims["headdim"], dims["nstate"], dims["nchunks"]
    states = rt.empty((b, nc, h, p, n))
    groups = (-(-p // TILE) * -(-n // TILE), nc * h, b)
    rt.run("ssd_chunk_state", groups, {"GRAD": grad}, dec=dec, left=left, right=right, states=states,
           **dims)
    return states


def _chunk_scan(rt, dims: dict, dec, q, k, v, st, out, *, reverse=False, q_scale=False, k_scale=False, skip=None,
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
    consts = {"REVERSE": reverse, "Q_SCALE": q_scale, "K_SCALE": k_scale, "ADD_SKIP": skip is not None,
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


def ssd_chunked(x: Tensor, adt: Tensor, scale: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
                chunk: int = DEFAULT_CHUNK, segment: int | None = None) -> tuple[Tensor, SSDSaved]:
    """The SSD core: x [B, L, H, P], adt, scale [B, L, H], B, C [B, L, G, N], D [H] or None ->
    (y [B, L, H, P], saved) with S_t = exp(adt_t) S_{t−1} + scale_t x_t B_tᵀ, y_t = S_t C_t (+ D x_t).

    adt must be ≤ 0 (a decay; the in-chunk decay sums rely on it). `chunk` (1..1024) is the chunk length; any L
    works (the last chunk is masked). `segment`: chunks per dispatch of the state passing (None: all, except on
    Mesa llvmpipe, whose loop budget sets it; mambactl/ops/checks.py). saved.last_state [B, H, P, N] is the
    state after the last step."""
    op = "ssd_chunked"
    batch, length, heads, headdim, groups, nstate = _check_core(op, x, adt, scale, B, C, D)
    chunk = _check_chunk(op, chunk, length)
    dims = _dims(batch, length, heads, headdim, groups, nstate, chunk)
    rt = x.runtime
    shape = tuple(x.shape)
    _check_loops(rt, op, shape, kernel_loops(chunk, headdim, nstate),
                 ("ssd_prep", "ssd_chunk_state", "ssd_chunk_scan"))
    dec = _prep(rt, dims, adt, scale)
    states = _chunk_state(rt, dims, dec, x, B, grad=False)
    last_state = rt.empty((batch, heads, headdim, nstate))
    state_passing(rt, dims, dec, states, last_state, shape, segment)
    y = rt.empty(x.shape)
    _chunk_scan(rt, dims, dec, C, B, x, states, y, k_scale=True, skip=D)
    return y, SSDSaved(x, adt, scale, B, C, D, states, chunk, last_state)


def ssd_chunked_backward(saved: SSDSaved, dy: Tensor, grads: Mapping[str, Tensor] | None = None,
                         segment: int | None = None):
    """dy [B, L, H, P] -> (dx, dadt, dscale, dB, dC, dD), shaped like the core's inputs (dD None without D).

    `grads`, a mapping with key "D" (when the forward had D), makes dD add into that tensor (and returns it).
    `segment`: chunks (and (batch, chunk) partials) per dispatch of the walks over chunks, as in `ssd_chunked`.
    """
    op = "ssd_chunked_backward"
    s = saved
    batch, length, heads, headdim, groups, nstate = _check_core(op, s.x, s.adt, s.scale, s.B, s.C, s.D)
    expect(op, "dy", dy, s.x.shape)
    dims = _dims(batch, length, heads, headdim, groups, nstate, s.chunk)
    nc = dims["nchunks"]
    expect(op, "saved states", s.states, (batch, nc, heads, headdim, nstate))
    has_d = s.D is not None
    accumulate = bool(grads) and has_d
    if accumulate:
        if "D" not in grads:
            raise ShapeError(f"{op}: grads lacks ['D']; give the D gradient to accumulate into")
        dD = expect(op, "grads['D']", grads["D"], (heads,))
    rt = dy.runtime
    shape = tuple(dy.shape)
    _check_loops(rt, op, shape, kernel_loops(s.chunk, headdim, nstate, heads, groups),
                 ("ssd_prep", "ssd_chunk_state", "ssd_chunk_scan", "ssd_sum_heads", "ssd_decay_grad",
                  "ssd_rows_backward"))
    dec = _prep(rt, dims, s.adt, s.scale)
    # The in-chunk part of dE, turned in place into dS_c = dE_{c+1}, with the partials of W_c.
    dstates = _chunk_state(rt, dims, dec, dy, s.C, grad=True)
    state_tiles = -(-headdim * nstate // WORKGROUP)
    w_part = rt.empty((batch, heads, nc, state_tiles))
    state_passing_backward(rt, dims, dec, dstates, s.states, w_part, shape, segment)
    dx, dxd_state = rt.empty(s.x.shape), rt.empty(s.x.shape)  # dx holds ∂loss/∂(scale x) until ssd_rows_backward
    _chunk_scan(rt, dims, dec, s.B, s.C, dy, dstates, dx, reverse=True, out_state=dxd_state)
    dB, dC = rt.empty(s.B.shape), rt.empty(s.C.shape)
    _chunk_scan(rt, dims, dec, s.x, dy, s.C, dstates, dB, reverse=True, q_scale=True, per_group=True)
    # dC's state term exp(cs_t) Eᵀ dy_t dotted with C_t is U_t = dy_t·y_off_t (y_off_t = exp(cs_t) E C_t).
    u_part = rt.empty((batch, heads, nc, -(-nstate // TILE), s.chunk))
    _chunk_scan(rt, dims, dec, dy, s.x, s.B, s.states, dC, k_scale=True, per_group=True, row_dot=(s.C, u_part))
    row_tiles = -(-s.chunk // TILE)
    x_part = rt.empty((batch, heads, nc, row_tiles, s.chunk))
    rt.run("ssd_decay_grad", (row_tiles, nc * heads, batch), dec=dec, b_in=s.B, c_in=s.C, x=s.x, dy=dy,
           x_part=x_part, **dims)
    dadt, dscale = rt.empty(s.adt.shape), rt.empty(s.scale.shape)
    param_part = rt.empty((batch, nc, heads) if has_d else (1,))
    rt.run("ssd_rows_backward", (nc, heads, batch), {"HAS_D": has_d}, dec=dec, skip=s.D if has_d else dec,
           x=s.x, dy=dy, u_part=u_part, dxd_state=dxd_state, dx=dx, w_part=w_part, x_part=x_part, dadt=dadt,
           dscale=dscale, param_part=param_part, **dims)
    if not has_d:
        return dx, dadt, dscale, dB, dC, None
    if not accumulate:
        dD = rt.empty((heads,))
    param_grads(rt, dims, param_part, [dD], accumulate, shape, segment)
    return dx, dadt, dscale, dB, dC, dD


def _mamba2_prep(rt, dims: dict, dt_raw, dt_bias, A_log) -> tuple[Tensor, Tensor]:
    """(adt = Δ A, scale = Δ) [B, L, H] by ssd_mamba2_prep."""
    adt, scale = rt.empty(dt_raw.shape), rt.empty(dt_raw.shape)
    rt.run("ssd_mamba2_prep", grid_1d(dt_raw.size), dt_raw=dt_raw, dt_bias=dt_bias, A_log=A_log, adt_out=adt,
           scale_out=scale, **dims)
    return adt, scale


def ssd_scan(x: Tensor, dt_raw: Tensor, A_log: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor,
             chunk: int = DEFAULT_CHUNK, dt_limit: tuple[float, float] = (0.0, NO_LIMIT),
             segment: int | None = None) -> tuple[Tensor, Mamba2SSDSaved]:
    """Mamba-2's scan: x [B, L, H, P], dt_raw [B, L, H], A_log, D, dt_bias [H], B, C [B, L, G, N] ->
    (y [B, L, H, P], saved): the core with scale = Δ = clamp(softplus(dt_raw + dt_bias), dt_limit) and
    adt = Δ A, A = −exp(A_log).

    `chunk` (1..1024) is the SSD chunk length; any L works (the last chunk is masked). `dt_limit` = (lo, hi)
    clamps Δ after the softplus (mamba_ssm's dt_limit; hi may be inf). `segment`: chunks per dispatch of the
    state passing (None: all, except on Mesa llvmpipe, whose loop budget sets it; mambactl/ops/checks.py)."""
    op = "ssd_scan"
    batch, length, heads, headdim, groups, nstate = _check_inputs(op, x, dt_raw, A_log, B, C, D, dt_bias)
    chunk = _check_chunk(op, chunk, length)
    dims = _dims(batch, length, heads, headdim, groups, nstate, chunk, dt_limit)
    # The core's in-chunk loops, refused under this op's name before anything is recorded.
    _check_loops(x.runtime, op, tuple(x.shape), kernel_loops(chunk, headdim, nstate),
                 ("ssd_prep", "ssd_chunk_state", "ssd_chunk_scan"))
    adt, scale = _mamba2_prep(x.runtime, dims, dt_raw, dt_bias, A_log)
    y, core = ssd_chunked(x, adt, scale, B, C, D, chunk=chunk, segment=segment)
    return y, Mamba2SSDSaved(x, dt_raw, A_log, B, C, D, dt_bias, core.states, chunk,
                             (dims["dt_min"], dims["dt_max"]), core.last_state)


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
    _check_loops(rt, op, tuple(state.shape), kernel_loops(1, headdim, nstate), ("ssd_step",))
    y = rt.empty(x.shape)
    rt.run("ssd_step", grid_1d(batch * heads * headdim, 64), x=x, dt_raw=dt_raw, dt_bias=dt_bias, A_log=A_log,
           b_in=B, c_in=C, skip=D, ssm_state=state, out=y, **dims)
    return y


def ssd_scan_backward(saved: Mamba2SSDSaved, dy: Tensor, grads: Mapping[str, Tensor] | None = None,
                      segment: int | None = None):
    """dy [B, L, H, P] -> (dx, ddt_raw, dA_log, dB, dC, dD, ddt_bias), shaped like the inputs.

    ddt_raw is the gradient w.r.t. the forward's dt_raw (through the clamp and softplus). `grads`, a mapping
    with keys "A_log", "D" and "dt_bias", makes the parameter gradients add into those tensors (and returns them).
    `segment`: chunks (and (batch, chunk) partials) per dispatch of the walks over chunks, as in `ssd_scan`.
    """
    op = "ssd_scan_backward"
    s = saved
    batch, length, heads, headdim, groups, nstate = _check_inputs(op, s.x, s.dt_raw, s.A_log, s.B, s.C, s.D, s.dt_bias)
    expect(op, "dy", dy, s.x.shape)
    accumulate = grads is not None
    if accumulate:
        missing = {"A_log", "D", "dt_bias"} - set(grads)
        if missing:
            raise ShapeError(f"{op}: grads lacks {sorted(missing)}; give all of A_log, D and dt_bias")
        dA_log, dD, ddt_bias = (expect(op, f"grads[{k!r}]", grads[k], (heads,)) for k in ("A_log", "D", "dt_bias"))
    rt = dy.runtime
    dims = _dims(batch, length, heads, headdim, groups, nstate, s.chunk, s.dt_limit)
    _check_loops(rt, op, tuple(dy.shape), kernel_loops(s.chunk, headdim, nstate), ("ssd_mamba2_backward",))
    adt, scale = _mamba2_prep(rt, dims, s.dt_raw, s.dt_bias, s.A_log)
    core = SSDSaved(s.x, adt, scale, s.B, s.C, s.D, s.states, s.chunk, s.last_state)
    dx, dadt, dscale, dB, dC, dD = ssd_chunked_backward(core, dy, {"D": dD} if accumulate else None, segment)
    ddt_raw = rt.empty(s.dt_raw.shape)
    param_part = rt.empty((batch, dims["nchunks"], heads, 2))
    rt.run("ssd_mamba2_backward", (dims["nchunks"], heads, batch), dt_raw=s.dt_raw, dt_bias=s.dt_bias, A_log=s.A_log,
           dadt=dadt, dscale=dscale, ddt_raw=ddt_raw, param_part=param_part, **dims)
    if not accumulate:
        dA_log, ddt_bias = rt.empty((heads,)), rt.empty((heads,))
    param_grads(rt, dims, param_part, [dA_log, ddt_bias], accumulate, tuple(dy.shape), segment, op)
    return dx, ddt_raw, dA_log, dB, dC, dD, ddt_bias
