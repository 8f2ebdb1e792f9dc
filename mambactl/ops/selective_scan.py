"""Mamba-1 selective scan with fused softplus and SiLU gate, forward and exact backward (kernels/selective_scan.wgsl).

As mamba_ssm's `selective_scan_fn(u, delta, A, B, C, D, z, delta_bias, delta_softplus=True)` in time-major
layout, with A passed as A_log:

    Δ = softplus(delta + delta_bias),  A = −exp(A_log),
    h_t = exp(Δ_t A) h_{t−1} + Δ_t B_t u_t,  y_t = (C_t·h_t + D u_t) · silu(z_t).

Memory: the forward keeps the state entering each chunk of `chunk` steps ([B, ceil(L / chunk), Dc, N]; chunk
16 on the tiled path by default, 128 on the others); the backward recomputes the states in between. Its
transient buffers are the tile entry states of one chunk ([B, Dc / CH, ceil(min(chunk, L) / T), 1, 128]) and
the per-workgroup partials of dB and dC (2 × [Dc / CH, B, L, N]), where CH, the channels per workgroup, is
min(128 / N, 32) rounded down to a power of two (8 for N = 16), and T, the steps per tile, is the largest of
16, 8, 4 that divides `chunk` and keeps workgroup memory within 16 KiB (8 for N = 16). The tiled forward holds
4 states per thread and sums over n by subgroup butterflies where a channel's N / 4 lanes (N rounded up to a
power of two) fit a subgroup (CH = 32 at N = 16), else 1 state per thread and sums in workgroup memory; its
entry point uses subgroup operations, so adapters without the `subgroup` feature take the direct forward.

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
from mambactl.ops.checks import (LOOP_BUDGET, SEGMENT_BUDGET, SUBGROUP_LANES, cpu_subgroups, expect, grid_1d, is_cpu,
                                 is_llvmpipe, require_subgroup_lanes, segment_length, segments)
from mambactl.runtime.tensor import Tensor

WORKGROUP = 128  # mirrors WG in kernels/selective_scan.wgsl
MAX_CHANNELS_PER_GROUP = 32  # bounds the per-(step, channel) tiles when N is tiny
MAX_STATE = WORKGROUP  # one thread per state of a channel
TILES = (16, 8, 4)  # steps per tile, largest first
# WebGPU's guaranteed workgroup memory. Devices with more would take longer tiles, but on an H200 those ran
# slower (fewer workgroups resident per SM), so the tile is sized to this on every device.
WORKGROUP_MEMORY = 16384
CHUNK_MULTIPLE = 8
CARRY_WORDS = 10  # CARRY in the kernel: a backward thread's carried sums between segments
MAX_ITEMS = 4  # staged items per thread: the vec4 registers of Staged in the kernel
# Steps between saved states. On the tiled path shorter chunks walk less in the backward (it recomputes a
# chunk's tile entry states by walking all of the chunk's tiles but the last: H200, B 8, L 1024, Dc 1536, N 16,
# the backward's dispatches 2.59 / 2.52 / 2.46 / 2.35 ms at chunk 128 / 32 / 16 / 8) but save more states
# ([B, L / chunk, Dc, N]: 6 MB per layer at 128, 50 MB at 16, i.e. about one more activation-sized tensor per
# layer at N 16). 128 keeps the memory; the 0.1 ms per layer is not worth a GB at the 130m shape.
DEFAULT_CHUNK = 128
PATHS = ("tiled", "direct", "subgroup")
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


def lanes_per_channel(nstate: int) -> int:
    """NP: N rounded up to a power of two (the tiled kernels' threads of a channel times its states per
    thread; a channel's lanes are an aligned block, so subgroup butterflies over them stay inside it)."""
    return 1 << (int(nstate) - 1).bit_length()


def states_per_thread(nstate: int, spt: int = 1) -> int:
    """SPT of the tiled kernels, at most NP."""
    return min(int(spt), lanes_per_channel(nstate))


def channels_per_group(nstate: int, spt: int = 1) -> int:
    """Channels per workgroup: min(128 / LP, 32) with LP = NP / SPT threads per channel, a power of two that
    divides the workgroup (for SPT = 1 the same as the largest power of two ≤ min(128 / N, 32))."""
    lanes = lanes_per_channel(nstate) // states_per_thread(nstate, spt)
    return min(WORKGROUP // lanes, MAX_CHANNELS_PER_GROUP)


def items_per_thread(nstate: int, tile: int, spt: int = 1) -> int:
    """PF: a thread's items of a staged tile's (step, channel) and (step, state) lists."""
    return -(-tile * max(channels_per_group(nstate, spt), nstate) // WORKGROUP)


def tile_memory(nstate: int, tile: int, spt: int = 1, lane_sum: bool = False) -> int:
    """Bytes of workgroup memory of the tiled kernels: six [T, CH] and two [T, N] staging tiles, and two
    [T, CH·(N + 1)] tiles of terms; the LANE_SUM forward reads neither (one step of state_terms is declared)."""
    ch = channels_per_group(nstate, spt)
    terms = ch * (nstate + 1) * (1 if lane_sum else 2 * tile)
    return 4 * (tile * (6 * ch + 2 * nstate) + terms)


def tile_steps(nstate: int, chunk: int, spt: int = 1, lane_sum: bool = False,
               memory: int = WORKGROUP_MEMORY) -> int:
    """Steps per tile: the largest of TILES that divides `chunk`, whose workgroup memory fits `memory` and
    whose staged items fit the kernels' 4 registers per thread (PF ≤ MAX_ITEMS); T = 4 always does at SPT = 1
    or with LANE_SUM (N ≤ 128, chunk a multiple of 8)."""
    fits = [t for t in TILES if chunk % t == 0 and tile_memory(nstate, t, spt, lane_sum) <= memory
            and items_per_thread(nstate, t, spt) <= MAX_ITEMS]
    if not fits:
        raise ShapeError(f"selective_scan: no tile of {TILES} fits {memory} bytes of workgroup memory at "
                         f"N = {nstate}, {spt} states per thread")
    return fits[0]


def _check_inputs(op: str, u, delta, A_log, B, C, D, z, delta_bias) -> tuple[int, int, int, int]:
    expect(op, "u", u, (None, None, None))
    batch, length, channels = u.shape
    if min(u.shape) < 1:
        raise ShapeError(f"{op}: u has shape {u.shape}; batch, length and channels must be at least 1")
    expect(op, "delta", delta, u.shape)
    expect(op, "z", z, u.shape)
    expect(op, "A_log", A_log, (channels, None))
    nstate = A_log.shape[1]
    if not 1 <= nstate <= MAX_STATE:
        raise ShapeError(f"{op}: A_log has shape {A_log.shape}; the state size N must be in [1, {MAX_STATE}]")
    expect(op, "B", B, (batch, length, nstate))
    expect(op, "C", C, (batch, length, nstate))
    expect(op, "D", D, (channels,))
    expect(op, "delta_bias", delta_bias, (channels,))
    return batch, length, channels, nstate


def _scan_params(batch: int, length: int, channels: int, chunk: int) -> dict:
    nchunks = -(-length // chunk)
    return dict(batch=batch, len=length, channels=channels, chunk=chunk, nchunks=nchunks, seg_begin=0,
                seg_end=length, kc_lo=0, kc_hi=nchunks)


# Loop iterations per invocation (upper bounds, no unrolling assumed, either LANE_SUM choice, SPT of them per
# per-state helper), for Mesa
# llvmpipe's budget of 65,535 (mambactl/ops/checks.py), per tile of T steps: PF items per fetch and per stage,
# a[items] = ceil(T·CH / WG) passes over (step, channel) items, s[items] = ceil(T·N / WG) over (step, state)
# items, log2(NP) per lane sum.
def _tile_passes(nstate: int, tile: int, spt: int = 1) -> tuple[int, int]:
    ch = channels_per_group(nstate, spt)
    return -(-tile * ch // WORKGROUP), -(-tile * nstate // WORKGROUP)


def forward_loops_per_tile(nstate: int, tile: int, spt: int = 1) -> int:
    a, _ = _tile_passes(nstate, tile, spt)
    butterfly = lanes_per_channel(nstate).bit_length() - 1
    per_step = 1 + butterfly + 3 * spt  # the step, the lane sum, B_t, C_t and the terms at the thread's states
    return 1 + 2 * items_per_thread(nstate, tile, spt) + spt + tile * per_step + a * (1 + nstate)


def backward_loops_per_tile(nstate: int, tile: int, spt: int = 1) -> int:
    a, st = _tile_passes(nstate, tile, spt)
    ch = channels_per_group(nstate, spt)
    staging = 1 + 2 * items_per_thread(nstate, tile, spt) + 3 * spt
    walk = staging + tile * (1 + spt)
    recompute = tile * (1 + 2 * spt)
    sums = 2 * a * (1 + nstate) + 2 * st * (1 + ch) + tile * (1 + 4 * spt)
    return walk + staging + recompute + sums


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


def _choose_path(rt, op: str, path: str | None, nstate: int, steps: int) -> str:
    if path is not None:
        if path not in PATHS:
            raise ShapeError(f"{op}: unknown path {path!r}; one of {PATHS} or None")
        return path
    if not is_cpu(rt):
        return "tiled"
    if nstate <= SUBGROUP_MAX_STATE and cpu_subgroups(rt):
        one = subgroup_backward_loops_per_chunk(nstate, steps) + subgroup_fixed(nstate)
        if not (is_llvmpipe(rt) and one > LOOP_BUDGET):
            return "subgroup"
    # The direct backward walks a whole chunk per dispatch; where one chunk is over llvmpipe's budget the tiled
    # kernels (finer segments) take it.
    one = direct_backward_loops_per_chunk(nstate, steps) + direct_backward_fixed(nstate)
    return "tiled" if is_llvmpipe(rt) and one > LOOP_BUDGET else "direct"


def _check_subgroup(rt, op: str, nstate: int) -> None:
    if nstate > SUBGROUP_MAX_STATE:
        raise ShapeError(f"{op}: the subgroup path holds at most {SUBGROUP_MAX_STATE} states; A_log has N = {nstate}")
    require_subgroup_lanes(rt, f"{op}: the subgroup path")


# Overrides of the tiled kernels' choices, by pipeline-constant name (SPT, LANE_SUM, T): one process times
# several variants (bench/scan.py --variant), tests run each. Empty: the defaults of `_constants`.
TILED_VARIANT: dict = {}
# The forward's default where a channel's lanes fit a subgroup: 4 states per thread, sums over n by lane
# butterflies (H200, N 16: 0.49 ms per layer, 0.68 with SPT = 1 and workgroup sums). The backward keeps one
# state per thread and workgroup sums (2.6 ms; 3.3-5.8 ms with more states per thread or lane sums).
FORWARD_SPT = 4


def lane_sums_fit(rt, nstate: int, spt: int = 1) -> bool:
    """Whether a channel's LP = NP / SPT lanes fit in one subgroup (the tiled forward's LANE_SUM)."""
    lanes = lanes_per_channel(nstate) // states_per_thread(nstate, spt)
    return "subgroup" in rt.features and lanes <= rt.subgroup_size


def _constants(rt, op: str, nstate: int, chunk: int, forward: bool) -> dict:
    """The tiled forward's (`forward`) or backward's pipeline constants: the defaults, or TILED_VARIANT's."""
    v = dict(TILED_VARIANT)
    unknown = set(v) - {"SPT", "LANE_SUM", "T"}
    if unknown:
        raise ShapeError(f"{op}: unknown tiled variant constants {sorted(unknown)}")
    fits = forward and lane_sums_fit(rt, nstate, FORWARD_SPT)
    spt = states_per_thread(nstate, int(v.get("SPT", FORWARD_SPT if fits else 1)))
    if spt not in (1, 2, 4):
        raise ShapeError(f"{op}: SPT is {spt}; 1, 2 or 4 states per thread")
    lanes = lanes_per_channel(nstate) // spt
    lane_sum = forward and bool(v.get("LANE_SUM", lane_sums_fit(rt, nstate, spt)))
    if lane_sum and not lane_sums_fit(rt, nstate, spt):
        raise ShapeError(f"{op}: LANE_SUM needs {lanes} lanes per subgroup; this adapter has "
                         f"{rt.subgroup_size or 'no subgroups'}")
    # Several states per thread with workgroup sums (variants only) put 4x the channels' terms in a workgroup:
    # those take what the device has.
    memory = WORKGROUP_MEMORY
    if spt > 1 and not lane_sum:
        memory = int(rt.limits.get("max-compute-workgroup-storage-size", WORKGROUP_MEMORY))
    tile = int(v["T"]) if "T" in v else tile_steps(nstate, chunk, spt, lane_sum, memory)
    if chunk % tile or items_per_thread(nstate, tile, spt) > MAX_ITEMS or tile < 4:
        raise ShapeError(f"{op}: T = {tile} must divide chunk {chunk}, be at least 4 and stage at most "
                         f"{MAX_ITEMS} items per thread")
    return {"N": nstate, "NP": lanes_per_channel(nstate), "SPT": spt, "LP": lanes,
            "CH": channels_per_group(nstate, spt), "T": tile, "PF": items_per_thread(nstate, tile, spt),
            "LANE_SUM": lane_sum, "TERM_STEPS": 1 if lane_sum else tile}


def selective_scan(u: Tensor, delta: Tensor, A_log: Tensor, B: Tensor, C: Tensor, D: Tensor, z: Tensor,
                   delta_bias: Tensor, chunk: int | None = None, segment: int | None = None,
                   path: str | None = None) -> tuple[Tensor, ScanSaved]:
    """u, delta, z [B, L, Dc]; A_log [Dc, N]; B, C [B, L, N]; D, delta_bias [Dc] -> (y [B, L, Dc], saved).

    `chunk` (a positive multiple of 8) is the number of steps between saved states (None: DEFAULT_CHUNK).
    `segment`: steps per dispatch
    (rounded up to a tile; h carried in last_state). None: one dispatch, except on Mesa llvmpipe, whose
    per-invocation loop budget sets it (mambactl/ops/checks.py). `path`: "tiled" (GPUs), "direct" (CPU adapters)
    or None (by the adapter type); the direct forward's segments are not rounded to a tile.
    """
    op = "selective_scan"
    batch, length, channels, nstate = _check_inputs(op, u, delta, A_log, B, C, D, z, delta_bias)
    if chunk is not None and (chunk < CHUNK_MULTIPLE or chunk % CHUNK_MULTIPLE):
        raise ShapeError(f"{op}: chunk is {chunk}; it must be a positive multiple of {CHUNK_MULTIPLE}")
    rt = u.runtime
    chunk = chunk or DEFAULT_CHUNK
    chosen = _choose_path(rt, op, path, nstate, min(chunk, length))
    if chosen == "tiled" and "subgroup" not in rt.features:
        # The tiled forward's entry point uses subgroup operations (its lane sums; kernels.py leaves it out of
        # the module elsewhere); the direct forward uses none and saves the same states.
        if path == "tiled":
            raise ShapeError(f"{op}: the tiled forward needs the adapter's subgroup feature")
        chosen = "direct"
    params = _scan_params(batch, length, channels, chunk)
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
                   states=states, states4=states, last_state=last_state, ngroups=groups, per_thread=1, **params)
        return y, ScanSaved(u, delta, A_log, B, C, D, z, delta_bias, states, chunk, last_state)
    if chosen == "direct":
        seg = segment_length(rt, op, tuple(u.shape), length, direct_forward_loops_per_step(nstate), 2 * nstate,
                             segment=segment)
        for t0, t1 in segments(length, seg):
            params.update(seg_begin=t0, seg_end=t1)
            rt.run("selective_scan_forward_direct", grid_1d(batch * channels, DIRECT_FORWARD_GROUP), {"N": nstate},
                   u=u, delta=delta, A_log=A_log, B=B, C=C, D=D, z=z, delta_bias=delta_bias, y=y, states=states,
                   last_state=last_state, ngroups=0, per_thread=0, **params)
        return y, ScanSaved(u, delta, A_log, B, C, D, z, delta_bias, states, chunk, last_state)
    constants = _constants(rt, op, nstate, chunk, True)
    tile = constants["T"]
    seg = segment_length(rt, op, tuple(u.shape), length,
                         -(-forward_loops_per_tile(nstate, tile, constants["SPT"]) // tile), 64,
                         multiple=tile, segment=segment)
    for t0, t1 in segments(length, seg):
        params.update(seg_begin=t0, seg_end=t1)
        rt.run("selective_scan_forward", (-(-channels // constants["CH"]), batch), constants, u=u, delta=delta,
               A_log=A_log, B=B, C=C, D=D, z=z, delta_bias=delta_bias, y=y, states=states, last_state=last_state,
               **params)
    return y, ScanSaved(u, delta, A_log, B, C, D, z, delta_bias, states, chunk, last_state)


def selective_scan_step(state: Tensor, u: Tensor, delta: Tensor, A_log: Tensor, B: Tensor, C: Tensor, D: Tensor,
                        z: Tensor, delta_bias: Tensor) -> Tensor:
    """One decoding step. u, delta, z [B, Dc]; B, C [B, N]; state [B, Dc, N] is advanced in place.
    -> y [B, Dc] (gated), the same as the parallel scan's output at that position."""
    op = "selective_scan_step"
    expect(op, "u", u, (None, None))
    batch, channels = u.shape
    expect(op, "A_log", A_log, (channels, None))
    nstate = A_log.shape[1]
    expect(op, "state", state, (batch, channels, nstate))
    for name, t in (("delta", delta), ("z", z)):
        expect(op, name, t, (batch, channels))
    expect(op, "B", B, (batch, nstate))
    expect(op, "C", C, (batch, nstate))
    expect(op, "D", D, (channels,))
    expect(op, "delta_bias", delta_bias, (channels,))
    y = u.runtime.empty((batch, channels))
    u.runtime.run("selective_scan_step", (-(-(batch * channels) // 64),), u=u, delta=delta, A_log=A_log, B=B, C=C,
                  D=D, z=z, delta_bias=delta_bias, state=state, y=y, batch=batch, channels=channels, nstate=nstate)
    return y


def selective_scan_backward(saved: ScanSaved, dy: Tensor, grads: Mapping[str, Tensor] | None = None,
                            segment: int | None = None, path: str | None = None, per_thread: int | None = None):
    """dy [B, L, Dc] -> (du, ddelta, dA_log, dB, dC, dD, dz, ddelta_bias), shaped like the inputs.

    ddelta is the gradient w.r.t. the forward's `delta` (before bias and softplus). `grads`, a mapping with
    keys "A_log", "D" and "delta_bias", makes the parameter gradients add into those tensors (and returns them).
    `segment`: chunks per dispatch (the adjoint and the parameter sums carried between dispatches). None: one
    dispatch, except on Mesa llvmpipe, whose per-invocation loop budget sets it (mambactl/ops/checks.py).
    `path` as in `selective_scan` (either backward takes either forward's `saved`); `per_thread` forces the
    direct backward's channels per invocation (tests).
    """
    op = "selective_scan_backward"
    s = saved
    batch, length, channels, nstate = _check_inputs(op, s.u, s.delta, s.A_log, s.B, s.C, s.D, s.z, s.delta_bias)
    expect(op, "dy", dy, s.u.shape)
    params = _scan_params(batch, length, channels, s.chunk)
    expect(op, "saved states", s.states, (batch, params["nchunks"], channels, nstate))
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
    nchunks = params["nchunks"]
    du, ddelta, dz = rt.empty(s.u.shape), rt.empty(s.u.shape), rt.empty(s.u.shape)
    param_part = rt.empty((batch, channels, nstate + 2))
    chosen = _choose_path(rt, op, path, nstate, min(s.chunk, length))
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
                   u=s.u, delta=s.delta, A_log=s.A_log, B=s.B, C=s.C, D=s.D, z=s.z, delta_bias=s.delta_bias, dy=dy,
                   saved_states=s.states, saved_states4=s.states, du=du, ddelta=ddelta, dz=dz, dB_part=dB_part,
                   dC_part=dC_part, param_part=param_part, scratch4=scratch, carry=carry, ngroups=groups,
                   per_thread=1, **params)
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
                   u=s.u, delta=s.delta, A_log=s.A_log, B=s.B, C=s.C, D=s.D, z=s.z, delta_bias=s.delta_bias, dy=dy,
                   saved_states=s.states, du=du, ddelta=ddelta, dz=dz, dB_part=dB_part, dC_part=dC_part,
                   param_part=param_part, tile_states=scratch, carry=carry, ngroups=groups, per_thread=per,
                   **params)
    else:
        constants = _constants(rt, op, nstate, s.chunk, False)
        groups, tile = -(-channels // constants["CH"]), constants["T"]
        dB_part = rt.empty((groups, batch, length, nstate))
        dC_part = rt.empty((groups, batch, length, nstate))
        spt = constants["SPT"]
        tile_states = rt.empty((batch, groups, -(-min(s.chunk, length) // tile), spt, WORKGROUP))
        per_chunk = -(-min(s.chunk, length) // tile) * backward_loops_per_tile(nstate, tile, spt)
        seg = segment_length(rt, op, tuple(s.u.shape), nchunks, per_chunk, 4 * WORKGROUP, segment=segment)
        carry = rt.empty((batch, groups, WORKGROUP, CARRY_WORDS))
        for hi in range(nchunks, 0, -seg):
            params.update(kc_lo=max(0, hi - seg), kc_hi=hi)
            rt.run("selective_scan_backward", (groups, batch), constants, u=s.u, delta=s.delta, A_log=s.A_log,
                   B=s.B, C=s.C, D=s.D, z=s.z, delta_bias=s.delta_bias, dy=dy, saved_states=s.states, du=du,
                   ddelta=ddelta, dz=dz, dB_part=dB_part, dC_part=dC_part, param_part=param_part,
                   tile_states=tile_states, carry=carry, **params)
    dB, dC = rt.empty(s.B.shape), rt.empty(s.C.shape)
    count = batch * length * nstate
    rt.run("selective_scan_sum_slices", grid_1d(count), part=dB_part, total=dB, count=count, slices=groups)
    rt.run("selective_scan_sum_slices", grid_1d(count), part=dC_part, total=dC, count=count, slices=groups)
    count = channels * (nstate + 2)
    rt.run("selective_scan_param_grads", grid_1d(count), {"ACCUMULATE": accumulate}, part=param_part,
           dA_log=dA_log, dD=dD, ddelta_bias=ddelta_bias, count=count, batch=batch, nstate=nstate)
    return du, ddelta, dA_log, dB, dC, dD, dz, ddelta_bias
