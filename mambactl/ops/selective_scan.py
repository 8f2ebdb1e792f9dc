"""Mamba-1 selective scan with fused softplus and SiLU gate, forward and exact backward (kernels/selective_scan.wgsl).

As mamba_ssm's `selective_scan_fn(u, delta, A, B, C, D, z, delta_bias, delta_softplus=True)` in time-major
layout, with A passed as A_log:

    Δ = softplus(delta + delta_bias),  A = −exp(A_log),
    h_t = exp(Δ_t A) h_{t−1} + Δ_t B_t u_t,  y_t = (C_t·h_t + D u_t) · silu(z_t).

Memory: the forward keeps the state entering each chunk of `chunk` steps ([B, ceil(L / chunk), Dc, N]; chunk
128 by default); the backward recomputes the states in between.

GPUs (`path="tiled"`): LP = max(4, NP / 4) lanes of a subgroup per (batch row, channel), 4 states each in vec4
registers (NP: N rounded up to a power of two), no workgroup memory or barriers (kernels/selective_scan.wgsl
says why and what was measured); they need the `subgroup` feature and a channel's LP lanes within one subgroup
(N ≤ 4 · subgroup lanes: N ≤ 128 on NVIDIA), elsewhere the direct kernels run. The backward's transient
buffers are the state entering every 4th step (slots [B, ceil(Dc·LP / 128), n_chunks · ceil(min(chunk, L) / 4),
128] of vec4: about B·L·Dc·N bytes, 201 MB per layer at the 130m shape, written by the chunk-parallel walk and
read once by the adjoint) and the per-subgroup partials of dB and dC (2 × [ceil(Dc / CPS), B, L, N], CPS =
subgroup lanes / LP channels per subgroup: 8 at N = 16 on NVIDIA).

CPU adapters (`rt.info.type == "CPU"`, e.g. Mesa llvmpipe) take barrier-free kernels instead (`path="direct"`;
`path="tiled"` / `"direct"` forces either): one invocation per (batch row, channel) walks time with its N states
in private arrays. Same saved states, so either backward consumes either forward. The direct backward's
transient buffers are a scratch of one chunk's states per invocation ([B·G, min(chunk, L) + 1, N]) and the
partials of dB and dC (2 × [G, B, L, N]), where G = ceil(Dc / per_thread) channel groups and an invocation owns
per_thread channels, chosen so that B·G ≈ DIRECT_THREADS (memory O(DIRECT_THREADS·L·N), not O(B·Dc·L·N)),
except that on llvmpipe one chunk of an invocation's channels must fit the segment budget (a cap of
SEGMENT_BUDGET / (2·min(chunk, L)·(N + 1)) channels per invocation; 14 for N = 16 and chunk 64).

CPU adapters whose subgroups have 8 lanes (Mesa lavapipe on AVX2; `Runtime.subgroup_size`) take the subgroup
kernels instead when N ≤ 16 (`path="subgroup"`): the direct walks with the state in vec4 registers and the 8 lanes
of a subgroup on 8 consecutive channels, sharing B_t and C_t by broadcasts and summing dB, dC across lanes
(kernels/selective_scan.wgsl says why that is ~5× faster there). Same saved states; transient buffers: the
partials of dB and dC (2 × [ceil(Dc / 8), B, L, N]) and a scratch of one state per 4 steps of a chunk
([ceil(min(chunk, L) / 4), B·ceil(Dc / 8), 16, 8]).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mambactl.errors import ShapeError
from mambactl.ops.checks import (LOOP_BUDGET, SEGMENT_BUDGET, SUBGROUP_LANES, cpu_subgroups, expect, expect_columns,
                                 grid_1d, is_cpu, is_llvmpipe, loop_budget, require_subgroup_lanes, segment_length,
                                 segments)
from mambactl.ops.slice import column_scatter, column_slice
from mambactl.runtime.tensor import Tensor

WORKGROUP = 128  # mirrors WG in kernels/selective_scan.wgsl
MAX_STATE = WORKGROUP  # the largest N (A_log's second dimension) any path takes
CHUNK_MULTIPLE = 8
CARRY_WORDS = 10  # CARRY in the kernel: a backward thread's carried sums between segments
# Steps between saved states. The GPU backward walks every chunk from its saved entry state (all chunks in one
# dispatch), so the chunk trades the saved states ([B, L / chunk, Dc, N]: 6 MB per layer at 128 and N = 16)
# against that walk's parallelism: H200, B 8, L 1024, Dc 1536, N 16, the backward's dispatches 0.772 / 0.785 /
# 0.788 ms at chunk 64 / 128 / 256; 128 keeps the memory small.
DEFAULT_CHUNK = 128
PATHS = ("tiled", "direct", "subgroup")
LANE_SUB = 4  # SUB in the kernel: steps per sub-tile of the GPU kernels, one owner lane each
LANE_STATES = 4  # states per lane of the GPU kernels (a vec4)
# The GPU backward's state slots per segment of chunks at most (B·L·Dc·N bytes for all chunks: 201 MB at the
# 130m shape, one segment); longer or wider shapes take several segments (and stay within the binding limit).
SLOT_BYTES = 256 * 2**20
SUBGROUP_MAX_STATE = 16  # SG_N in the kernel: the subgroup kernels hold the state in four vec4 registers
SUBGROUP_SUBCHUNK = 4  # SUBCHUNK in the kernel: steps per scratch slot of the subgroup backward
# Direct backward: invocations (B·G) to aim for when giving each several channels; enough SIMD batches for the
# CPU's threads, and it bounds the dB / dC partials to about DIRECT_THREADS·L·N each.
DIRECT_THREADS = 256
DIRECT_FORWARD_GROUP = 64  # mirrors the workgroup sizes of the direct kernels
DIRECT_BACKWARD_GROUP = 32


@dataclass
class ScanSaved:
    """What the backward needs: the forward's inputs (not copied) and the chunk entry states."""

    u: Tensor
    delta: Tensor
    A_log: Tensor
    B: Tensor
    C: Tensor
    D: Tensor
    z: Tensor
    delta_bias: Tensor
    states: Tensor  # [B, n_chunks, Dc, N]: the state before step k·chunk
    chunk: int
    last_state: Tensor  # [B, Dc, N]: the state after the last step (to continue recurrently)
    z_start: int = 0  # z's columns [z_start, z_start + Dc) are the gate (z wider than Dc: read in place)


def channel_lanes(nstate: int) -> int:
    """LP of the GPU kernels: a channel's lanes, max(SUB, NP / 4) with NP = N rounded up to a power of two (4
    states per lane, one owner lane per step of a sub-tile)."""
    padded = 1 << (int(nstate) - 1).bit_length()
    return max(LANE_SUB, padded // LANE_STATES)


def lanes_fit(rt, nstate: int) -> bool:
    """Whether the GPU kernels run here: subgroups, and a channel's lanes within one (NVIDIA: N ≤ 128)."""
    return "subgroup" in rt.features and channel_lanes(nstate) <= rt.subgroup_size


def channels_per_subgroup(rt, nstate: int) -> int:
    """CPS: the GPU backward's channels per subgroup, so ceil(Dc / CPS) slices of dB / dC partials."""
    return rt.subgroup_size // channel_lanes(nstate)


def _check_inputs(op: str, u, delta, A_log, B, C, D, z, delta_bias, z_start: int | None = None
                  ) -> tuple[int, int, int, int]:
    expect(op, "u", u, (None, None, None))
    batch, length, channels = u.shape
    if min(u.shape) < 1:
        raise ShapeError(f"{op}: u has shape {u.shape}; batch, length and channels must be at least 1")
    expect(op, "delta", delta, u.shape)
    if z_start is None:
        expect(op, "z", z, u.shape)
    else:
        _check_columns(op, "z", z, batch, length, channels, z_start)
    expect(op, "A_log", A_log, (channels, None))
    nstate = A_log.shape[1]
    if not 1 <= nstate <= MAX_STATE:
        raise ShapeError(f"{op}: A_log has shape {A_log.shape}; the state size N must be in [1, {MAX_STATE}]")
    expect(op, "B", B, (batch, length, nstate))
    expect(op, "C", C, (batch, length, nstate))
    expect(op, "D", D, (channels,))
    expect(op, "delta_bias", delta_bias, (channels,))
    return batch, length, channels, nstate


def _check_columns(op: str, name: str, t: Tensor, batch: int, length: int, channels: int, start: int) -> None:
    """t [B, L, W] whose columns [start, start + Dc) an op reads or writes in place."""
    expect(op, name, t, (batch, length, None))
    expect_columns(op, name, t, start, channels)


def _gate(path: str, z: Tensor, z_start: int, channels: int) -> tuple[Tensor, int]:
    """(z, z_start) as the path's kernels read them: the CPU paths read a wider z in place (strides in their
    uniforms); the GPU kernels read a [B, L, Dc] gate, so a wider z is copied there."""
    if path != "tiled" or z.shape[2] == channels:
        return z, z_start
    batch, length, width = z.shape
    return column_slice(z.reshape(-1, width), z_start, channels).reshape(batch, length, channels), 0


def _scan_params(batch: int, length: int, channels: int, chunk: int, z: Tensor | None = None, z_start: int = 0,
                 dz: Tensor | None = None, dz_start: int = 0) -> dict:
    """The kernels' uniforms; z and dz's row strides and first columns where they are wider than Dc."""
    nchunks = -(-length // chunk)
    return dict(batch=batch, len=length, channels=channels, chunk=chunk, nchunks=nchunks, seg_begin=0,
                seg_end=length, kc_lo=0, kc_hi=nchunks, z_stride=channels if z is None else z.shape[2], z_col=z_start,
                dz_stride=channels if dz is None else dz.shape[2], dz_col=dz_start)


# Loop iterations per invocation (upper bounds, no unrolling assumed), for Mesa llvmpipe's budget of 65,535
# (mambactl/ops/checks.py). GPU kernels, per sub-tile of SUB steps: its loop, the butterflies over the channel's
# lane bits past SUB and, per step, those over the subgroup's channels past 8.
def lanes_forward_loops_per_step(nstate: int) -> int:
    return 1 + (channel_lanes(nstate).bit_length() - 1)


def lanes_backward_loops_per_chunk(nstate: int, steps: int, subgroup: int) -> int:
    lanes = channel_lanes(nstate)
    per_sub = 1 + (lanes.bit_length() - 1) + LANE_SUB * max(1, (subgroup // lanes).bit_length() - 4)
    return 1 + -(-steps // LANE_SUB) * (1 + per_sub)


def direct_forward_loops_per_step(nstate: int) -> int:
    return 1 + nstate  # the time loop and the loop over states


def direct_backward_loops_per_chunk(nstate: int, steps: int) -> int:
    """Per channel and chunk of `steps` steps: the chunk loop, the entry state copy, the recompute and the
    adjoint (each a time loop with a loop over states per step)."""
    return 1 + nstate + 2 * steps * (1 + nstate)


def direct_backward_fixed(nstate: int) -> int:
    return 1 + 2 * nstate  # per channel: its loop, loading A (and the carry), storing the sums


def subgroup_forward_loops_per_step(nstate: int) -> int:
    """The time loop, and the store of N states at a chunk boundary (at most every 8 steps: chunk ≥ 8)."""
    return 1 + -(-nstate // CHUNK_MULTIPLE)


def subgroup_backward_loops_per_chunk(nstate: int, steps: int) -> int:
    """The chunk loop, loading its entry state (16 words), the walk storing every SUBCHUNK-th state and the
    walk over sub-chunks (no inner loops)."""
    return 1 + SUBGROUP_MAX_STATE + steps + -(-steps // SUBGROUP_SUBCHUNK)


def subgroup_fixed(nstate: int) -> int:
    """Per invocation: loading A and a carry (16 words each), storing the sums (2N)."""
    return 3 * SUBGROUP_MAX_STATE + 2 * nstate


def subgroup_groups(channels: int) -> int:
    """Subgroups of channels (Dc padded to whole subgroups): the partials' leading dimension."""
    return -(-channels // SUBGROUP_LANES)


def direct_per_thread(rt, batch: int, length: int, channels: int, nstate: int, chunk: int,
                      per_thread: int | None = None) -> tuple[int, int]:
    """-> (channels per invocation, channel groups G) for the direct backward: B·G ≈ DIRECT_THREADS, and on
    llvmpipe one chunk of all an invocation's channels within the segment budget where one channel fits."""
    if per_thread is None:
        per_thread = max(1, batch * channels // DIRECT_THREADS)
        if is_llvmpipe(rt):
            one = direct_backward_loops_per_chunk(nstate, min(chunk, length)) + direct_backward_fixed(nstate)
            per_thread = max(1, min(per_thread, SEGMENT_BUDGET // one))
    per_thread = max(1, min(int(per_thread), channels))
    groups = -(-channels // per_thread)
    return -(-channels // groups), groups


def _choose_path(rt, op: str, path: str | None, nstate: int, steps: int, textured: tuple = ()) -> str:
    """`textured`: the tensors the subgroup kernels read through textures (they take them only where all fit)."""
    if path is not None:
        if path not in PATHS:
            raise ShapeError(f"{op}: unknown path {path!r}; one of {PATHS} or None")
        if path == "tiled" and not lanes_fit(rt, nstate):
            raise ShapeError(f"{op}: the tiled kernels need the subgroup feature and a channel's "
                             f"{channel_lanes(nstate)} lanes in one subgroup; this adapter has "
                             f"{rt.subgroup_size or 'no subgroups'}")
        return path
    if not is_cpu(rt):
        return "tiled" if lanes_fit(rt, nstate) else "direct"
    if nstate <= SUBGROUP_MAX_STATE and cpu_subgroups(rt) and rt.fits_texture(*textured):
        one = subgroup_backward_loops_per_chunk(nstate, steps) + subgroup_fixed(nstate)
        if not (is_llvmpipe(rt) and one > LOOP_BUDGET):
            return "subgroup"
    # The direct backward walks a whole chunk per dispatch; where one chunk is over llvmpipe's budget the tiled
    # kernels (finer segments) take it where they fit (else the direct one refuses the shape).
    one = direct_backward_loops_per_chunk(nstate, steps) + direct_backward_fixed(nstate)
    return "tiled" if is_llvmpipe(rt) and one > LOOP_BUDGET and lanes_fit(rt, nstate) else "direct"


def _check_subgroup(rt, op: str, nstate: int) -> None:
    if nstate > SUBGROUP_MAX_STATE:
        raise ShapeError(f"{op}: the subgroup path holds at most {SUBGROUP_MAX_STATE} states; A_log has N = {nstate}")
    require_subgroup_lanes(rt, f"{op}: the subgroup path")


def _lanes_constants(rt, nstate: int) -> dict:
    return {"N": nstate, "LP": channel_lanes(nstate), "SG": rt.subgroup_size}


def selective_scan(u: Tensor, delta: Tensor, A_log: Tensor, B: Tensor, C: Tensor, D: Tensor, z: Tensor,
                   delta_bias: Tensor, chunk: int | None = None, segment: int | None = None,
                   path: str | None = None, z_start: int | None = None) -> tuple[Tensor, ScanSaved]:
    """u, delta, z [B, L, Dc]; A_log [Dc, N]; B, C [B, L, N]; D, delta_bias [Dc] -> (y [B, L, Dc], saved).
    With `z_start`, z is [B, L, W] and its columns [z_start, z_start + Dc) are the gate (in_proj's output as it
    is: the CPU paths read them in place, the GPU path takes a copy).

    `chunk` (a positive multiple of 8) is the number of steps between saved states (None: DEFAULT_CHUNK).
    `segment`: steps per dispatch (rounded up to a sub-tile of 4 steps on the tiled path; h carried in
    last_state). None: one dispatch, except on Mesa llvmpipe, whose per-invocation loop budget sets it
    (mambactl/ops/checks.py). `path`: "tiled" (GPUs), "direct", "subgroup" (CPU adapters) or None (by the
    adapter; see the module docstring).
    """
    op = "selective_scan"
    batch, length, channels, nstate = _check_inputs(op, u, delta, A_log, B, C, D, z, delta_bias, z_start)
    if chunk is not None and (chunk < CHUNK_MULTIPLE or chunk % CHUNK_MULTIPLE):
        raise ShapeError(f"{op}: chunk is {chunk}; it must be a positive multiple of {CHUNK_MULTIPLE}")
    rt = u.runtime
    chunk = chunk or DEFAULT_CHUNK
    chosen = _choose_path(rt, op, path, nstate, min(chunk, length), (u, delta, z, B, C))
    z, z_start = _gate(chosen, z, z_start or 0, channels)
    params = _scan_params(batch, length, channels, chunk, z, z_start)
    y = rt.empty(u.shape)
    states = rt.empty((batch, params["nchunks"], channels, nstate))
    last_state = rt.empty((batch, channels, nstate))
    if chosen == "subgroup":
        _check_subgroup(rt, op, nstate)
        seg = segment_length(rt, op, tuple(u.shape), length, subgroup_forward_loops_per_step(nstate),
                             subgroup_fixed(nstate), segment=segment)
        groups = subgroup_groups(channels)
        for t0, t1 in segments(length, seg):
            params.update(seg_begin=t0, seg_end=t1)
            rt.run("selective_scan_forward_subgroup", grid_1d(batch * groups * SUBGROUP_LANES, DIRECT_FORWARD_GROUP),
                   {"N": nstate}, u=u, delta=delta, A_log=A_log, B=B, C=C, D=D, z=z, delta_bias=delta_bias, y=y,
                   states=states, states4=states, last_state=last_state, ngroups=groups, per_thread=1,
                   u_tex=u, delta_tex=delta, z_tex=z, B_tex=B, C_tex=C, **params)
        return y, ScanSaved(u, delta, A_log, B, C, D, z, delta_bias, states, chunk, last_state, z_start)
    if chosen == "direct":
        seg = segment_length(rt, op, tuple(u.shape), length, direct_forward_loops_per_step(nstate), 2 * nstate,
                             segment=segment)
        for t0, t1 in segments(length, seg):
            params.update(seg_begin=t0, seg_end=t1)
            rt.run("selective_scan_forward_direct", grid_1d(batch * channels, DIRECT_FORWARD_GROUP), {"N": nstate},
                   u=u, delta=delta, A_log=A_log, B=B, C=C, D=D, z=z, delta_bias=delta_bias, y=y, states=states,
                   last_state=last_state, ngroups=0, per_thread=0, **params)
        return y, ScanSaved(u, delta, A_log, B, C, D, z, delta_bias, states, chunk, last_state, z_start)
    constants = _lanes_constants(rt, nstate)
    grid = (-(-channels * constants["LP"] // WORKGROUP), batch)
    seg = segment_length(rt, op, tuple(u.shape), length, lanes_forward_loops_per_step(nstate), 16,
                         multiple=LANE_SUB, segment=segment)
    for t0, t1 in segments(length, seg):
        params.update(seg_begin=t0, seg_end=t1)
        rt.run("selective_scan_forward", grid, constants, u=u, delta=delta, A_log=A_log, B=B, C=C, D=D, z=z,
               delta_bias=delta_bias, y=y, states=states, last_state=last_state, B4=B, C4=C, **params)
    return y, ScanSaved(u, delta, A_log, B, C, D, z, delta_bias, states, chunk, last_state, z_start)


def selective_scan_step(state: Tensor, u: Tensor, delta: Tensor, A_log: Tensor, B: Tensor, C: Tensor, D: Tensor,
                        z: Tensor, delta_bias: Tensor, *, z_start: int | None = None, b_start: int | None = None,
                        c_start: int | None = None) -> Tensor:
    """One decoding step. u, delta, z [B, Dc]; B, C [B, N]; state [B, Dc, N] is advanced in place.
    -> y [B, Dc] (gated), the same as the parallel scan's output at that position. With `z_start`, z is wider rows
    [B, W] whose columns [z_start, z_start + Dc) are read (in_proj's output as it is); with `b_start` and `c_start`,
    B and C are one tensor of wider rows holding B at columns [b_start, b_start + N) and C at [c_start, ...)
    (x_proj's output)."""
    op = "selective_scan_step"
    expect(op, "u", u, (None, None))
    batch, channels = u.shape
    expect(op, "A_log", A_log, (channels, None))
    nstate = A_log.shape[1]
    expect(op, "state", state, (batch, channels, nstate))
    expect(op, "delta", delta, (batch, channels))
    expect(op, "z", z, (batch, channels if z_start is None else None))
    z_start = 0 if z_start is None else z_start
    expect_columns(op, "z", z, z_start, channels)
    if (b_start is None) != (c_start is None):
        raise ShapeError(f"{op}: give b_start and c_start together (B and C in one tensor) or neither")
    if b_start is None:
        expect(op, "B", B, (batch, nstate))
        expect(op, "C", C, (batch, nstate))
        b_start = c_start = 0
    else:
        expect(op, "B", B, (batch, None))
        if C is not B:
            raise ShapeError(f"{op}: with b_start and c_start, B and C are the same tensor")
        for name, start in (("B", b_start), ("C", c_start)):
            expect_columns(op, name, B, start, nstate)
    expect(op, "D", D, (channels,))
    expect(op, "delta_bias", delta_bias, (channels,))
    y = u.runtime.empty((batch, channels))
    u.runtime.run("selective_scan_step", (-(-(batch * channels) // 64),), u=u, delta=delta, A_log=A_log, B=B, C=C,
                  D=D, z=z, delta_bias=delta_bias, state=state, y=y, batch=batch, channels=channels, nstate=nstate,
                  z_stride=z.shape[1], z_col=z_start, bc_stride=B.shape[1], b_col=b_start, c_col=c_start)
    return y


def selective_scan_backward(saved: ScanSaved, dy: Tensor, grads: Mapping[str, Tensor] | None = None,
                            segment: int | None = None, path: str | None = None, per_thread: int | None = None,
                            dz_out: tuple[Tensor, int] | None = None):
    """dy [B, L, Dc] -> (du, ddelta, dA_log, dB, dC, dD, dz, ddelta_bias), shaped like the inputs; with
    `dz_out` = (matrix [B, L, W], start), dz goes into its columns [start, start + Dc) and dz is that matrix.

    ddelta is the gradient w.r.t. the forward's `delta` (before bias and softplus). `grads`, a mapping with
    keys "A_log", "D" and "delta_bias", makes the parameter gradients add into those tensors (and returns them).
    `segment`: chunks per dispatch (the adjoint and the parameter sums carried between dispatches). None: one
    dispatch, except on Mesa llvmpipe, whose per-invocation loop budget sets it (mambactl/ops/checks.py).
    `path` as in `selective_scan` (either backward takes either forward's `saved`); `per_thread` forces the
    direct backward's channels per invocation (tests).
    """
    op = "selective_scan_backward"
    s = saved
    batch, length, channels, nstate = _check_inputs(op, s.u, s.delta, s.A_log, s.B, s.C, s.D, s.z, s.delta_bias,
                                                    s.z_start)
    expect(op, "dy", dy, s.u.shape)
    if dz_out is not None:
        _check_columns(op, "dz_out", dz_out[0], batch, length, channels, dz_out[1])
    expect(op, "saved states", s.states, (batch, -(-length // s.chunk), channels, nstate))
    accumulate = grads is not None
    if accumulate:
        missing = {"A_log", "D", "delta_bias"} - set(grads)
        if missing:
            raise ShapeError(f"{op}: grads lacks {sorted(missing)}; give all of A_log, D and delta_bias")
        dA_log = expect(op, "grads['A_log']", grads["A_log"], (channels, nstate))
        dD = expect(op, "grads['D']", grads["D"], (channels,))
        ddelta_bias = expect(op, "grads['delta_bias']", grads["delta_bias"], (channels,))
    rt = dy.runtime
    if not accumulate:
        dA_log, dD, ddelta_bias = rt.empty((channels, nstate)), rt.empty((channels,)), rt.empty((channels,))
    du, ddelta = rt.empty(s.u.shape), rt.empty(s.u.shape)
    param_part = rt.empty((batch, channels, nstate + 2))
    chosen = _choose_path(rt, op, path, nstate, min(s.chunk, length), (s.u, s.delta, s.z, dy, s.B, s.C))
    z, z_start = _gate(chosen, s.z, s.z_start, channels)
    in_place = dz_out is not None and chosen != "tiled"  # the GPU kernels write a [B, L, Dc] dz, scattered below
    dz, dz_start = dz_out if in_place else (rt.empty(s.u.shape), 0)
    params = _scan_params(batch, length, channels, s.chunk, z, z_start, dz, dz_start)
    nchunks = params["nchunks"]
    if chosen == "subgroup":
        _check_subgroup(rt, op, nstate)
        groups, span = subgroup_groups(channels), min(s.chunk, length)
        dB_part = rt.empty((groups, batch, length, nstate))
        dC_part = rt.empty((groups, batch, length, nstate))
        scratch = rt.empty((-(-span // SUBGROUP_SUBCHUNK), batch * groups, SUBGROUP_MAX_STATE, SUBGROUP_LANES))
        carry = rt.empty((batch, channels, 2 * nstate + 2))
        seg = segment_length(rt, op, tuple(s.u.shape), nchunks, subgroup_backward_loops_per_chunk(nstate, span),
                             subgroup_fixed(nstate), segment=segment)
        for hi in range(nchunks, 0, -seg):
            params.update(kc_lo=max(0, hi - seg), kc_hi=hi)
            rt.run("selective_scan_backward_subgroup", grid_1d(batch * groups * SUBGROUP_LANES, DIRECT_FORWARD_GROUP),
                   {"N": nstate, "WALK": span > SUBGROUP_SUBCHUNK,
                    "TAIL": bool(length % SUBGROUP_SUBCHUNK or s.chunk % SUBGROUP_SUBCHUNK)},
                   u=s.u, delta=s.delta, A_log=s.A_log, B=s.B, C=s.C, D=s.D, z=z, delta_bias=s.delta_bias, dy=dy,
                   saved_states=s.states, saved_states4=s.states, du=du, ddelta=ddelta, dz=dz, dB_part=dB_part,
                   dC_part=dC_part, param_part=param_part, scratch4=scratch, carry=carry, ngroups=groups,
                   per_thread=1, u_tex=s.u, delta_tex=s.delta, z_tex=z, dy_tex=dy, B_tex=s.B, C_tex=s.C, **params)
    elif chosen == "direct":
        per, groups = direct_per_thread(rt, batch, length, channels, nstate, s.chunk, per_thread)
        dB_part = rt.empty((groups, batch, length, nstate))
        dC_part = rt.empty((groups, batch, length, nstate))
        scratch = rt.empty((batch * groups, min(s.chunk, length) + 1, nstate))
        carry = rt.empty((batch, channels, 2 * nstate + 2))
        seg = segment_length(rt, op, tuple(s.u.shape), nchunks,
                             per * direct_backward_loops_per_chunk(nstate, min(s.chunk, length)),
                             per * direct_backward_fixed(nstate), segment=segment)
        for hi in range(nchunks, 0, -seg):
            params.update(kc_lo=max(0, hi - seg), kc_hi=hi)
            rt.run("selective_scan_backward_direct", grid_1d(batch * groups, DIRECT_BACKWARD_GROUP), {"N": nstate},
                   u=s.u, delta=s.delta, A_log=s.A_log, B=s.B, C=s.C, D=s.D, z=z, delta_bias=s.delta_bias, dy=dy,
                   saved_states=s.states, du=du, ddelta=ddelta, dz=dz, dB_part=dB_part, dC_part=dC_part,
                   param_part=param_part, tile_states=scratch, carry=carry, ngroups=groups, per_thread=per,
                   **params)
    else:
        constants = _lanes_constants(rt, nstate)
        groups = -(-channels // channels_per_subgroup(rt, nstate))  # the partials' slices: one per subgroup
        dB_part = rt.empty((groups, batch, length, nstate))
        dC_part = rt.empty((groups, batch, length, nstate))
        grid = (-(-channels * constants["LP"] // WORKGROUP), batch)
        per_chunk = -(-min(s.chunk, length) // LANE_SUB)
        carry = rt.empty((batch, grid[0], WORKGROUP, CARRY_WORDS))
        # Segments of chunks: llvmpipe's loop budget, and the slots of one segment within SLOT_BYTES (one
        # dispatch at the 130m shape); each segment walks its chunks at once (one chunk per invocation, within
        # llvmpipe's budget if a chunk is), then runs their adjoint.
        seg = segment_length(rt, op, tuple(s.u.shape), nchunks,
                             lanes_backward_loops_per_chunk(nstate, min(s.chunk, length), rt.subgroup_size),
                             16, segment=segment)
        chunk_bytes = batch * grid[0] * per_chunk * WORKGROUP * LANE_STATES * 4
        seg = max(1, min(seg, min(SLOT_BYTES, rt.max_binding) // chunk_bytes))
        loop_budget(rt, op, tuple(s.u.shape), 1 + per_chunk)
        slots = rt.empty((batch, grid[0], min(seg, nchunks) * per_chunk, WORKGROUP, LANE_STATES))
        views = dict(B4=s.B, C4=s.C, slots=slots)
        for hi in range(nchunks, 0, -seg):
            params.update(kc_lo=max(0, hi - seg), kc_hi=hi)
            rt.run("selective_scan_backward_walk", (grid[0], batch, hi - params["kc_lo"]), constants, u=s.u,
                   delta=s.delta, A_log=s.A_log, B=s.B, delta_bias=s.delta_bias, saved_states=s.states, **views,
                   **params)
            rt.run("selective_scan_backward", grid, constants, u=s.u, delta=s.delta, A_log=s.A_log, B=s.B, C=s.C,
                   D=s.D, z=z, delta_bias=s.delta_bias, dy=dy, saved_states=s.states, du=du, ddelta=ddelta,
                   dz=dz, dB_part=dB_part, dC_part=dC_part, param_part=param_part, carry=carry, **views, **params)
    dB, dC = rt.empty(s.B.shape), rt.empty(s.C.shape)
    count = batch * length * nstate
    for part, total in ((dB_part, dB), (dC_part, dC)):
        textured = is_cpu(rt) and count % 4 == 0 and rt.fits_texture(part)
        rt.run("selective_scan_sum_slices", grid_1d(count // 4 if textured else count), {"TEXTURED": textured},
               part=part, part_tex=part if textured else None, total=total, total4=total, count=count, slices=groups)
    count = channels * (nstate + 2)
    rt.run("selective_scan_param_grads", grid_1d(count), {"ACCUMULATE": accumulate}, part=param_part,
           dA_log=dA_log, dD=dD, ddelta_bias=ddelta_bias, count=count, batch=batch, nstate=nstate)
    if dz_out is not None:
        if not in_place:
            column_scatter(dz.reshape(-1, channels), dz_out[0].reshape(-1, dz_out[0].shape[2]), dz_out[1])
        dz = dz_out[0]
    return du, ddelta, dA_log, dB, dC, dD, dz, ddelta_bias
