"""The SSD scan (state space duality): a general chunked core and Mamba-2's composition around it, forward and
exact backward (kernels/ssd.wgsl; the math and the kernel plan are in that file's header).

The core, `ssd_chunked` / `ssd_chunked_backward`, per batch and head (S is headdim × d_state):

    S_t = exp(adt_t) S_{t−1} + scale_t x_t B_tᵀ,   y_t = S_t C_t (+ D x_t when D is given)

with the per-step log-decay adt [B, L, H] (≤ 0) and input scale [B, L, H] given directly (Mamba-3 builds them
its own way), and optionally a diagonal weight diag [B, L, H] that step t's own term in y_t takes instead of
scale_t: y_t = exp(adt_t) S_{t−1} C_t + diag_t (B_t·C_t) x_t (+ D x_t). Mamba-3 SISO's exponential-trapezoidal
output is that with scale = γ + δ_{t+1}, diag = γ (ops/mamba3_fold.py), so it needs no correction pass. Mamba-2's `ssd_scan` / `ssd_scan_backward` are an elementwise prep (scale = Δ =
clamp(softplus(dt_raw + dt_bias)), adt = Δ A, A = −exp(A_log)), the core, and the chain rule back to dt_raw,
A_log and dt_bias.

Shapes: x, y [B, L, H, P] (the [B·L, d_inner] rows split into heads); B, C [B, L, G, N], head h reading group
h // (H / G); D [H]. Memory: the forward saves the state entering every chunk ([B, ceil(L / chunk), H, P, N]),
the state after the last step ([B, H, P, N]: decoding continues from it, Mamba-2's `ssd_step` one token at a
time), the in-chunk decay sums and diagonal weights ([B, H, n_chunks, 6, chunk]), C Bᵀ ([B, n_chunks, G, chunk, chunk]; Mamba-2 also
its Δ and Δ A, [B, L, H] each) and references to its inputs, so the backward recomputes none of them (C Bᵀ is
B·L·G·chunk floats: at the Mamba-3 shape, G = H and chunk 64, half the size of the states; recomputing it cost a
second M_CB dispatch per layer). The backward's transients: one more state tensor, dCB in up to MAX_HSPLIT
planes like C Bᵀ, and per-row pieces of ∂adt and ∂scale ([B, H, n_chunks, ·, chunk]).

All chunk-level products are one WGSL tile engine (`ssd_tile`, its MODE picking the product; the plan, the
FLOPs and the bytes of each are in kernels/ssd.wgsl and `kernel_costs`). CPU adapters with 8-lane subgroups
(lavapipe) run the same engine as `ssd_tile_lanes`: one subgroup a tile, B shared by broadcasts instead of
workgroup-memory reads (`tile_engine` picks; both are tested against float64 on any adapter that has both).

On Mesa llvmpipe (its loop budget of 65,535 iterations per shader invocation: mambactl/ops/checks.py) the walks
over chunks (the state passing, forward and backward, and the sums of the per-chunk parameter partials) go in
dispatch segments carrying their running sums in a buffer; the in-chunk kernels' loops are bounded by the chunk
(at most 1024), P and N (`kernel_loops`), and a shape past the budget there is refused before dispatch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mambactl.errors import ShapeError
from mambactl.ops.checks import (SEGMENT_BUDGET, cpu_subgroups, expect, expect_columns, grid_1d, is_cpu, loop_budget,
                                 require_subgroup_lanes, segment_length, segments)
from mambactl.ops.slice import column_scatter, column_slice
from mambactl.runtime.tensor import Tensor

WORKGROUP = 256  # mirrors kernels/ssd.wgsl's WG
PASSING_ELEMS = 4  # mirrors PASS_ELEMS there: the state walks' elements per thread (ssd_state_passing: a vec4)
MAX_CHUNK = 1024  # mirrors MAX_CHUNK there: ssd_prep / ssd_rows_backward hold a chunk in workgroup memory
DEC_ROWS = 6  # mirrors ROWS there: the rows of `dec` (scale, 4 decay sums, diagonal weight)
TILE = 64  # ssd_tile's output tile (64 × 64)
# The kernel's chunk length is an implementation choice, not part of the model: the chunked result equals the
# recurrence for any chunk (up to float rounding), as with mamba_ssm's chunk_size, which HF and mamba_ssm configs
# carry (mambactl keeps that value in ModelConfig for import and export; its kernels do not read it). With chunk
# None the ops take FORCE_CHUNK when set (tests, benchmarks), else `kernel_chunk`'s pick for the adapter and shape.
FORCE_CHUNK: int | None = None
# The tile engine: None picks `tile_engine`'s choice for the adapter; True / False force ssd_tile_lanes / ssd_tile
# (tests run both on any adapter with 8-lane subgroups).
FORCE_LANES: bool | None = None
# ssd_tile_lanes' loop iterations per invocation over ssd_tile's (an upper bound: a lane plays 32 of its threads
# one after another and adds 16 multiply iterations a k step to each step's 13 loads and loops)
LANE_LOOPS = 40
GPU_CHUNK_SHARED = 128  # GPUs, heads sharing B and C (G < H: Mamba-2); H200 measurements in kernel_chunk
GPU_CHUNK_PER_HEAD = 64  # GPUs, one group per head (G = H: Mamba-3 SISO)
CPU_CHUNK = 64  # CPU adapters: one 64-position tile per chunk (a shorter chunk leaves most of each tile padding)
NO_LIMIT = 3.0e38  # an upper clamp that never binds (a finite float32)
KSTEP = 16  # ssd_tile's K per staged step
SUB = 16  # mirrors SUB there: sub-block of the pair decays
MAX_HSPLIT = 8  # ssd_tile M_DCB: at most this many dCB planes per group (dB / dC add them per load)
# M_DCB splits a group's heads until it has about this many workgroups (H200, Mamba-2 130m, after the K loop a
# phase: 2048 -> 8 planes of 3 heads, M_DCB 0.201 -> 0.187 ms a layer; 512: 0.231; 2026-12-03, round robin)
DCB_WORKGROUPS = 2048
DCB_HEADS = 16  # and at least until each workgroup has at most this many (MAX_HSPLIT permitting)
# ssd_tile's MODE values (kernels/ssd.wgsl)
M_CB, M_Y, M_STATE, M_DXD, M_DCB, M_DB, M_DC = range(7)


# --- loop iterations per shader invocation (upper bounds, no loop unrolled), for Mesa llvmpipe's budget ---------
REDUCE = 8  # log2(WORKGROUP) rounds of workgroup_sum / exclusive_prefix
PASSING_LOOPS = 1  # ssd_state_passing per chunk (one per PASS_BUFFERS = 4 chunks, charged as one per chunk)
PASSING_BACKWARD_LOOPS = 1 + REDUCE  # ssd_state_passing_backward per chunk (at most a workgroup sum of W_c each)
# ssd_param_grads: a thread takes every 64th partial, then 6 tree rounds; charged as one loop per partial (more)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kernel_chunk(rt, length: int, heads: int, groups: int) -> int:
    """The chunk length the SSD kernels run at for this adapter and shape when the caller gives none: FORCE_CHUNK
    if set, else GPU_CHUNK_SHARED (G < H) or GPU_CHUNK_PER_HEAD (G = H) on GPUs and CPU_CHUNK on CPU adapters;
    never longer than L (one chunk then holds the whole sequence). H200, 130m shapes (B 8, L 1024, P 64, N 128),
    GPU timestamps: a Mamba-2 layer (H 24, G 1; bench/ssd.py --variants, fwd + bwd) 2.94 / 2.56 / 2.56 ms at
    chunk 256 / 128 / 64, one process (128 keeps half the states 64 does);
    Mamba-3 SISO (G = H = 24), a step's SSD kernels 66.7 ms at chunk 64, 72.2 at 128 (profile_step)."""
    if FORCE_CHUNK is not None:
        chunk = int(FORCE_CHUNK)
    elif is_cpu(rt):
        chunk = CPU_CHUNK
    else:
        chunk = GPU_CHUNK_PER_HEAD if groups == heads else GPU_CHUNK_SHARED
    return max(1, min(chunk, length))


def step_lanes(rt) -> int:
    """ssd_step's threads per row of the state (STEP_LANES there): 32 on GPUs, 1 on CPU adapters."""
    return 1 if is_cpu(rt) else 32


def passing_span() -> int:
    """State elements per workgroup of the state walks (and so per W_c partial of the backward's in w_part)."""
    return WORKGROUP * PASSING_ELEMS


def _min_split(hpg: int) -> int:
    """At most DCB_HEADS heads per M_DCB workgroup where MAX_HSPLIT planes allow (its loops grow with them)."""
    return min(hpg, MAX_HSPLIT, _cdiv(hpg, DCB_HEADS))


def _hsplit(batch: int, nchunks: int, heads: int, groups: int, chunk: int) -> tuple[int, int]:
    """M_DCB's (planes, heads per plane): split a group's heads until the grid has ~DCB_WORKGROUPS workgroups."""
    tiles = _cdiv(chunk, TILE)
    grid = tiles * (tiles + 1) // 2 * nchunks * groups * batch
    hpg = heads // groups
    split = max(_min_split(hpg), min(hpg, MAX_HSPLIT, _cdiv(DCB_WORKGROUPS, grid)))
    per = _cdiv(hpg, split)
    return _cdiv(hpg, per), per


def kernel_loops(chunk: int, headdim: int, nstate: int, heads: int = 1, groups: int = 1) -> dict[str, int]:
    """Loop iterations per invocation of the kernels whose loops are bounded by the chunk, P, N and the heads per
    group (the walks over chunks are per chunk: PASSING_LOOPS, PASSING_BACKWARD_LOOPS, and one per (batch, chunk)
    partial in ssd_param_grads). `chunk` is the effective one (min(chunk, L)). ssd_tile: the largest over its
    modes, each k step with its loaders' per-element loops (scalar path: 4 per operand, 4 for weights, 4 per
    dCB plane)."""
    q, hpg = chunk, heads // groups
    seg = MAX_CHUNK // WORKGROUP  # ssd_prep / ssd_rows_backward walk MAX_SEG position slots a thread (registers)
    tiles_q, tiles_p = _cdiv(q, TILE), _cdiv(headdim, TILE)
    npairs = tiles_q * (tiles_q + 1) // 2
    mids = _cdiv(q, SUB)  # the t_mid sums
    rows = 16 + 4 * (1 + 4)  # a row_sum (16) and the row dots' loads (4 rows of 4)
    plain = 1 + 4 + 4 + 4  # a k step: the loop, A's 4 loads, its 4 weights, B's 4 loads
    pairs = 1 + 4 * MAX_HSPLIT + 4 + 4  # a k step reading the dCB planes
    by_mode = {
        "cb": _cdiv(nstate, KSTEP) * plain + 4,
        "y": mids + (_cdiv(nstate, KSTEP) + _cdiv(q, KSTEP)) * plain + 2 * rows + 4 * 4,
        "state": _cdiv(q, KSTEP) * plain + 4,
        "dxd": mids + (_cdiv(nstate, KSTEP) + _cdiv(q, KSTEP)) * plain + 3 * rows + 64 + 4 * 8,
        "dcb": _cdiv(hpg, _min_split(hpg)) * (mids + _cdiv(headdim, KSTEP) * plain + 16 * 4 + 2 * 16 + 2 * 16 + 4 + _cdiv(q, WORKGROUP))
        + 4,
        # M_DC's state phase head by head, each with a row_sum (M_DB's one K range of hpg·P takes no more)
        "dbc": _cdiv(q, KSTEP) * pairs + hpg * (_cdiv(headdim, KSTEP) * plain + rows + 1) + 4,
    }
    return {
        "ssd_prep": 2 * seg + 2 * REDUCE + 2 * SUB,
        "ssd_tile": max(by_mode.values()),
        "ssd_tile_lanes": LANE_LOOPS * max(by_mode.values()),
        # per position: the P-tile pieces, U's tiles of N, the ∂diag tiles, the crossings
        "ssd_rows_backward": _cdiv(headdim * nstate, WORKGROUP) + seg * (2 * tiles_p + _cdiv(nstate, TILE))
        + 2 * REDUCE + seg + seg * npairs + tiles_q * tiles_p,
        "ssd_mamba2_backward": seg + 2 * REDUCE,
        "ssd_step": nstate,  # on CPU adapters one thread walks a row of S (step_lanes)
    }


def kernel_costs(batch: int, length: int, heads: int, headdim: int, groups: int, nstate: int,
                 chunk: int, engine: str = "ssd_tile") -> dict[str, tuple[float, float]]:
    """The predicted work of one forward + backward: {"ssd_tile[MODE=k,...]" or entry: (FLOPs, bytes)} as
    bench/ssd.py keys its dispatches (`engine`: the tile engine's entry point, `tile_engine`'s pick; both do the
    same work). FLOPs count the multiply-adds the tiles do (2 each, padding and the
    masked-out half of diagonal tiles included); bytes each operand read and each output written once (the
    re-reads of an operand by several workgroups, which L2 serves, are not counted)."""
    B, L, H, P, G, N, Q = batch, length, heads, headdim, groups, nstate, chunk
    nc = _cdiv(L, Q)
    tq, tp, tn = _cdiv(Q, TILE), _cdiv(P, TILE), _cdiv(N, TILE)
    npairs = tq * (tq + 1) // 2
    T2 = TILE * TILE * 2  # FLOPs per unit of K in one tile
    f4, bch, bcg = 4, B * nc * H, B * nc * G
    causal_blocks = npairs * TILE  # Σ over row tiles of the K of their pair phases (in positions)
    states = B * nc * H * P * N * f4
    xs, bc, cb = B * L * H * P * f4, B * L * G * N * f4, bcg * Q * Q * f4
    planes, _ = _hsplit(B, nc, H, G, Q)
    group_grad = bcg * tn * (causal_blocks * T2 + tq * T2 * (H // G) * P)  # dB or dC
    y_pairs = (bch * tp * (tq * T2 * N + causal_blocks * T2), 2 * xs + bc + states + cb)
    dxd = (bch * tp * (tq * T2 * N + causal_blocks * T2), 3 * xs + bc + states + cb)
    costs = {
        f"{engine}[MODE={M_CB}]": (bcg * npairs * T2 * N, 2 * bc + cb),
        f"{engine}[MODE={M_STATE}]": (bch * tp * tn * T2 * Q, xs + bc + states),
        f"{engine}[GRAD,MODE={M_STATE}]": (bch * tp * tn * T2 * Q, xs + bc + states),
        f"{engine}[MODE={M_DB}]": (group_grad, xs + bc + states + cb * planes),
        f"{engine}[MODE={M_DC}]": (group_grad, xs + 2 * bc + states + cb * planes),  # C twice: dC and U
        "ssd_state_passing": (0, 2 * states),
        "ssd_state_passing_backward": (0, 3 * states),
    }
    for flags in ("", "HAS_D,", "HAS_DIAG,", "HAS_D,HAS_DIAG,"):  # D and diag change no product's size
        costs[f"{engine}[{flags}MODE={M_Y}]"] = y_pairs
        costs[f"{engine}[{flags}MODE={M_DXD}]"] = dxd
    for flags in ("", "HAS_DIAG,"):
        costs[f"{engine}[{flags}MODE={M_DCB}]"] = (bch * npairs * T2 * P, 2 * xs + cb * (1 + planes))
    return costs


def tile_engine(rt, loops: dict[str, int]) -> str:
    """The tile engine's entry point: ssd_tile_lanes on CPU adapters with 8-lane subgroups where its loops stay
    within llvmpipe's budget (`loops`: kernel_loops at the shape), else ssd_tile; FORCE_LANES forces either."""
    if FORCE_LANES is None:
        lanes = cpu_subgroups(rt) and loops["ssd_tile_lanes"] <= SEGMENT_BUDGET
    else:
        lanes = FORCE_LANES
        if lanes:
            require_subgroup_lanes(rt, "ssd_tile_lanes")
    return "ssd_tile_lanes" if lanes else "ssd_tile"


def _loops(dims: dict) -> dict[str, int]:
    return kernel_loops(dims["chunk"], dims["headdim"], dims["nstate"], dims["heads"], dims["ngroups"])


def _check_loops(rt, op: str, shape, loops: dict[str, int], kernels) -> None:
    """Refuse (on llvmpipe, before anything is recorded) a shape whose in-chunk loops pass the budget
    ("ssd_tile" stands for the engine `tile_engine` picks)."""
    for name in kernels:
        name = tile_engine(rt, loops) if name == "ssd_tile" else name
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
    dec: Tensor  # [B, H, n_chunks, 6, chunk]: the in-chunk decay sums and diag (ssd_prep), kept for the backward
    cb: Tensor  # [B, n_chunks, G, chunk, chunk]: C Bᵀ per chunk (M_CB), kept for the backward
    diag: Tensor | None = None  # [B, L, H]: the diagonal weight, or None (scale's)
    x_start: int | None = None  # x's first column in a wider matrix x [B, L, W] (None: x is [B, L, H, P])
    headdim: int | None = None  # P where x_start is set

    def core_dims(self, op: str) -> tuple[int, int, int, int, int, int]:
        """(batch, length, heads, headdim, groups, nstate), the saved inputs checked as the forward took them."""
        return _check_core(op, self.x, self.adt, self.scale, self.B, self.C, self.D, self.diag, self.x_start,
                           self.headdim)


@dataclass
class Mamba2SSDSaved:
    """What `ssd_scan_backward` needs: Mamba-2's inputs (not copied) and what the core kept (`core`: its chunk
    entry states, decay sums and C Bᵀ, and the Δ and Δ A it ran with)."""

    x: Tensor
    dt_raw: Tensor
    A_log: Tensor
    B: Tensor
    C: Tensor
    D: Tensor
    dt_bias: Tensor
    dt_limit: tuple[float, float]
    core: SSDSaved  # the core's saved (x, adt = Δ A, scale = Δ, B, C, D, states, dec, C Bᵀ)

    @property
    def states(self) -> Tensor:  # [B, n_chunks, H, P, N]: the state entering chunk c
        return self.core.states

    @property
    def chunk(self) -> int:
        return self.core.chunk

    @property
    def last_state(self) -> Tensor:  # [B, H, P, N]: the state after the last step (to continue, `ssd_step`)
        return self.core.last_state


def _check_core(op: str, x, adt, scale, B, C, D, diag=None, x_start: int | None = None,
                headdim: int | None = None) -> tuple[int, int, int, int, int, int]:
    """(batch, length, heads, headdim, groups, nstate). x is [B, L, H, P], or with `x_start` a wider matrix
    [B, L, W] whose columns [x_start, x_start + H·headdim) are x (H from adt)."""
    if x_start is None:
        expect(op, "x", x, (None, None, None, None))
        batch, length, heads, headdim = x.shape
        if min(x.shape) < 1:
            raise ShapeError(f"{op}: x has shape {x.shape}; batch, length, heads and headdim must be at least 1")
    else:
        expect(op, "adt", adt, (None, None, None))
        batch, length, heads = adt.shape
        if min(adt.shape) < 1 or headdim is None or headdim < 1:
            raise ShapeError(f"{op}: adt has shape {adt.shape} and headdim is {headdim}; batch, length, heads and "
                             "headdim must be at least 1")
        expect(op, "x", x, (batch, length, None))
        expect_columns(op, "x", x, x_start, heads * headdim)
    expect(op, "adt", adt, (batch, length, heads))
    expect(op, "scale", scale, (batch, length, heads))
    expect(op, "B", B, (batch, length, None, None))
    groups, nstate = B.shape[2], B.shape[3]
    if groups < 1 or nstate < 1 or heads % groups:
        raise ShapeError(f"{op}: B has shape {B.shape}; its groups must divide the {heads} heads and N be >= 1")
    expect(op, "C", C, B.shape)
    if D is not None:
        expect(op, "D", D, (heads,))
    if diag is not None:
        expect(op, "diag", diag, (batch, length, heads))
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
                nchunks=nchunks, dt_min=float(lo), dt_max=float(min(hi, NO_LIMIT)), seg_lo=0, seg_hi=nchunks,
                dt_stride=heads, dt_col=0, x_stride=heads * headdim, x_col=0, dx_stride=heads * headdim, dx_col=0)


def _check_chunk(op: str, rt, chunk: int | None, length: int, heads: int, groups: int) -> int:
    """The chunk the kernels run at: the caller's, else kernel_chunk's pick; in [1, MAX_CHUNK], at most L."""
    if chunk is None:
        chunk = kernel_chunk(rt, length, heads, groups)
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
    # P·N not a multiple of 4: scalar accesses (kernels/ssd.wgsl says why); else no constants, the profiled name
    consts = {"PASS_SCALAR": True} if pn % 4 else None
    for lo, hi in segments(nc, seg):
        rt.run("ssd_state_passing", (_cdiv(pn, passing_span()), dims["heads"], dims["batch"]), consts, dec=dec,
               statesv=states, last_state=last_state, **{**dims, "seg_lo": lo, "seg_hi": hi})


def state_passing_backward(rt, dims: dict, dec: Tensor, dstates: Tensor, saved_states: Tensor, w_part: Tensor,
                           shape=None, segment: int | None = None) -> None:
    """ssd_state_passing_backward, last chunk to first, in dispatch segments as `state_passing` (dE carried
    between segments in a [B, H, P·N] buffer)."""
    nc, pn = dims["nchunks"], dims["headdim"] * dims["nstate"]
    seg = segment_length(rt, "ssd_chunked_backward (ssd_state_passing_backward)", shape, nc,
                         PASSING_BACKWARD_LOOPS, segment=segment)
    carry = rt.empty((dims["batch"], dims["heads"], pn) if seg < nc else (1,))
    for lo, hi in reversed(segments(nc, seg)):
        rt.run("ssd_state_passing_backward", (_cdiv(pn, passing_span()), dims["heads"], dims["batch"]),
               dec=dec, states=dstates, saved_states=saved_states, w_part=w_part, carry=carry,
               **{**dims, "seg_lo": lo, "seg_hi": hi})


def param_grads(rt, dims: dict, param_part: Tensor, outs: list[Tensor], accumulate: bool, shape=None,
                segment: int | None = None, op: str = "ssd_chunked_backward") -> None:
    """ssd_param_grads: the B·nchunks partials [B·nchunks, H, len(outs)] added in order into outs (1 or 2
    tensors [H]), in dispatch segments as `state_passing` (the sums so far carried in an [H, len(outs)] buffer)."""
    total, k = dims["batch"] * dims["nchunks"], len(outs)
    seg = segment_length(rt, f"{op} (ssd_param_grads)", shape, total, 1, segment=segment)
    carry = rt.empty((dims["heads"], k, 64) if seg < total else (1,))  # the 64 lanes' running sums
    for lo, hi in segments(total, seg):
        rt.run("ssd_param_grads", (dims["heads"], 1, 1), {"ACCUMULATE": accumulate, "NPARAM": k},
               param_part=param_part, grad_0=outs[0], grad_1=outs[-1], carry=carry,
               **{**dims, "seg_lo": lo, "seg_hi": hi})


def _prep(rt, dims: dict, adt, scale, diag=None) -> Tensor:
    """The scale, the in-chunk decay sums of adt and the diagonal weight (diag, else the scale again):
    [B, H, n_chunks, 6, chunk] (kernels/ssd.wgsl's `dec`)."""
    dec = rt.empty((dims["batch"], dims["heads"], dims["nchunks"], DEC_ROWS, dims["chunk"]))
    rt.run("ssd_prep", (dims["nchunks"], dims["heads"], dims["batch"]), {"HAS_DIAG": diag is not None},
           adt_in=adt, scale_in=scale, diag_in=scale if diag is None else diag, dec_out=dec, **dims)
    return dec


def _tile(rt, dims: dict, mode: int, grid, dec: Tensor, consts: dict | None = None, **bufs) -> None:
    """One dispatch of the tile engine (`tile_engine`'s: kernels/ssd.wgsl's ssd_tile or ssd_tile_lanes, the same
    grid). Bindings the mode does not use get one-element scratches (read-only ones may share `dec`; writable ones
    get their own)."""
    vec4 = _vec4(dims)  # x's and dx's rows are aligned wherever it holds (ssd_chunked / _backward copy if not)
    args = {name: bufs.get(name, dec) for name in ("xv", "dyv", "bv", "cv", "pairv", "stv", "skip")}
    for name in ("tile_out", "row_part", "row_part2", "tile_part", "x_part"):
        args[name] = bufs[name] if name in bufs else rt.empty((1,))
    planes, per = bufs.get("split", (1, 1))
    entry = tile_engine(rt, _loops(dims))
    consts = {"MODE": mode, "VEC4": vec4, **(consts or {})}
    if entry == "ssd_tile_lanes" and mode == M_DCB:
        consts["F_SKEW"] = 0  # no bank conflicts to spread on a CPU: T's row of 4 columns as one vec4 store
    rt.run(entry, grid, consts, dec=dec, decv=dec, **args,
           **{k: dims[k] for k in ("batch", "len", "heads", "ngroups", "headdim", "nstate", "chunk", "nchunks",
                                   "x_stride", "x_col", "dx_stride", "dx_col")},
           hsplit=planes, heads_per_split=per)


def _vec4(dims: dict) -> bool:
    """Whether P, N, the chunk and L allow the tile engine's vec4 loads (x and dx in wider matrices also need
    their row strides and first columns multiples of 4: `_breaks_vec4`)."""
    return all(dims[k] % 4 == 0 for k in ("headdim", "nstate", "chunk", "len"))


def _breaks_vec4(dims: dict, matrix: Tensor, start: int) -> bool:
    """Whether x or dx as columns [start, ...) of matrix [B, L, W] would break the vec4 accesses the shape
    allows: they are then copied to or from [B, L, H·P] once (lavapipe's scalar loads are per-lane loops)."""
    return _vec4(dims) and (matrix.shape[2] % 4 != 0 or start % 4 != 0)


def _aligned_x(dims: dict, x: Tensor, x_start: int) -> tuple[Tensor, int]:
    """(x, x_start) to read: x as it is, or a copy [B, L, H·P] where its rows break vec4 (`_breaks_vec4`)."""
    if not _breaks_vec4(dims, x, x_start):
        return x, x_start
    batch, length, width = x.shape
    cols = dims["heads"] * dims["headdim"]
    return column_slice(x.reshape(-1, width), x_start, cols).reshape(batch, length, cols), 0


def _grids(dims: dict) -> dict:
    b, h, g, nc = dims["batch"], dims["heads"], dims["ngroups"], dims["nchunks"]
    tq, tp, tn = _cdiv(dims["chunk"], TILE), _cdiv(dims["headdim"], TILE), _cdiv(dims["nstate"], TILE)
    npairs = tq * (tq + 1) // 2
    return {"pairs": (npairs, nc * g, b), "rows_p": (tq * tp, nc * h, b), "state": (tp * tn, nc * h, b),
            "rows_n": (tq * tn, nc * g, b), "npairs": npairs, "tq": tq, "tp": tp}


def _chunk_products(rt, dims: dict, dec, B, C) -> Tensor:
    """CB = C Bᵀ per (batch, chunk, group): [B, nchunks, G, Q, Q] (tiles above the diagonal unwritten)."""
    cb = rt.empty((dims["batch"], dims["nchunks"], dims["ngroups"], dims["chunk"], dims["chunk"]))
    _tile(rt, dims, M_CB, _grids(dims)["pairs"], dec, bv=B, cv=C, tile_out=cb)
    return cb


def ssd_chunked(x: Tensor, adt: Tensor, scale: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
                chunk: int | None = None, segment: int | None = None, diag: Tensor | None = None,
                x_start: int | None = None, headdim: int | None = None) -> tuple[Tensor, SSDSaved]:
    """The SSD core: x [B, L, H, P], adt, scale [B, L, H], B, C [B, L, G, N], D [H] or None ->
    (y [B, L, H, P], saved) with S_t = exp(adt_t) S_{t−1} + scale_t x_t B_tᵀ, y_t = S_t C_t (+ D x_t); with
    diag [B, L, H], y_t = exp(adt_t) S_{t−1} C_t + diag_t (B_t·C_t) x_t (+ D x_t).

    adt must be ≤ 0 (a decay; the in-chunk decay sums rely on it). `chunk` (1..1024) is the kernel's chunk length
    (None: `kernel_chunk`'s pick for the adapter and shape; the result does not depend on it beyond float
    rounding); any L works (the last chunk is masked). `segment`: chunks per dispatch of the state passing
    (None: all, except on Mesa llvmpipe, whose loop budget sets it; mambactl/ops/checks.py). saved.last_state
    [B, H, P, N] is the state after the last step.

    With `x_start` (and `headdim` P), x is a wider matrix [B, L, W] whose columns [x_start, x_start + H·P) are
    x, read in place (Mamba-3's in_proj output); y is [B, L, H, P] either way."""
    op = "ssd_chunked"
    batch, length, heads, headdim, groups, nstate = _check_core(op, x, adt, scale, B, C, D, diag, x_start, headdim)
    rt = x.runtime
    chunk = _check_chunk(op, rt, chunk, length, heads, groups)
    dims = _dims(batch, length, heads, headdim, groups, nstate, chunk)
    if x_start is not None:
        x, x_start = _aligned_x(dims, x, x_start)
        dims.update(x_stride=x.shape[2], x_col=x_start)
    shape = (batch, length, heads, headdim)
    _check_loops(rt, op, shape, kernel_loops(chunk, headdim, nstate, heads, groups), ("ssd_prep", "ssd_tile"))
    grids = _grids(dims)
    dec = _prep(rt, dims, adt, scale, diag)
    cb = _chunk_products(rt, dims, dec, B, C)
    states = rt.empty((batch, dims["nchunks"], heads, headdim, nstate))
    _tile(rt, dims, M_STATE, grids["state"], dec, xv=x, bv=B, tile_out=states)
    last_state = rt.empty((batch, heads, headdim, nstate))
    state_passing(rt, dims, dec, states, last_state, shape, segment)
    y = rt.empty(shape)
    _tile(rt, dims, M_Y, grids["rows_p"], dec, {"HAS_D": D is not None, "HAS_DIAG": diag is not None},
          xv=x, cv=C, pairv=cb, stv=states, skip=dec if D is None else D, tile_out=y)
    return y, SSDSaved(x, adt, scale, B, C, D, states, chunk, last_state, dec, cb, diag, x_start,
                       None if x_start is None else headdim)


def ssd_chunked_backward(saved: SSDSaved, dy: Tensor, grads: Mapping[str, Tensor] | None = None,
                         segment: int | None = None, dx_out: tuple[Tensor, int] | None = None):
    """dy [B, L, H, P] -> (dx, dadt, dscale, dB, dC, dD, ddiag), shaped like the core's inputs (dx [B, L, H, P];
    dD None without D, ddiag None without diag).

    `grads`, a mapping with key "D" (when the forward had D), makes dD add into that tensor (and returns it).
    `segment`: chunks (and (batch, chunk) partials) per dispatch of the walks over chunks, as in `ssd_chunked`.
    `dx_out` = (matrix [B, L, W], start): dx goes into its columns [start, start + H·P) (in_proj's gradient, in
    place), nothing else of it is written, and dx is that matrix.
    """
    op = "ssd_chunked_backward"
    s = saved
    batch, length, heads, headdim, groups, nstate = s.core_dims(op)
    expect(op, "dy", dy, (batch, length, heads, headdim))
    dims = _dims(batch, length, heads, headdim, groups, nstate, s.chunk)
    if s.x_start is not None:
        dims.update(x_stride=s.x.shape[2], x_col=s.x_start)
    scatter = None  # dx_out whose rows break vec4 alignment: dx is made contiguous and copied there
    if dx_out is not None:
        matrix, start = dx_out
        expect(op, "dx_out", matrix, (batch, length, None))
        expect_columns(op, "dx_out", matrix, start, heads * headdim)
        if _breaks_vec4(dims, matrix, start):
            scatter, dx_out = dx_out, None
        else:
            dims.update(dx_stride=matrix.shape[2], dx_col=start)
    nc = dims["nchunks"]
    expect(op, "saved states", s.states, (batch, nc, heads, headdim, nstate))
    has_d, has_diag = s.D is not None, s.diag is not None
    accumulate = bool(grads) and has_d
    if accumulate:
        if "D" not in grads:
            raise ShapeError(f"{op}: grads lacks ['D']; give the D gradient to accumulate into")
        dD = expect(op, "grads['D']", grads["D"], (heads,))
    rt = dy.runtime
    shape = tuple(dy.shape)
    _check_loops(rt, op, shape, kernel_loops(s.chunk, headdim, nstate, heads, groups),
                 ("ssd_prep", "ssd_tile", "ssd_rows_backward"))
    expect(op, "saved dec", s.dec, (batch, heads, nc, DEC_ROWS, s.chunk))
    expect(op, "saved cb", s.cb, (batch, nc, groups, s.chunk, s.chunk))
    grids = _grids(dims)
    tq, tp, npairs = grids["tq"], grids["tp"], grids["npairs"]
    dec, cb = s.dec, s.cb  # the forward's: the decay sums and C Bᵀ are not recomputed
    # The in-chunk part of dE, turned in place into dS_c = dE_{c+1}, with the partials of W_c.
    dstates = rt.empty(s.states.shape)
    _tile(rt, dims, M_STATE, grids["state"], dec, {"GRAD": True}, dyv=dy, cv=s.C, tile_out=dstates)
    state_tiles = _cdiv(headdim * nstate, passing_span())
    w_part = rt.empty((batch, heads, nc, state_tiles))
    state_passing_backward(rt, dims, dec, dstates, s.states, w_part, shape, segment)
    rows = (batch, heads, nc, tp, s.chunk)
    # U_t = dy_t·y_off_t, y_off_t = exp(cs_t) E C_t, by column tiles of N: M_DC's state phase takes the group's
    # heads one by one (head h's part of dC is exp(cs_t) E_hᵀ dy_t) and dots each with C_t (H200, Mamba-2 130m
    # layer: 4.6 ms a step less than a pass of M_Y without pairs for U, 2026-12-02)
    u_part = rt.empty((batch, heads, nc, _cdiv(nstate, TILE), s.chunk))
    dx = rt.empty((batch, length, heads, headdim)) if dx_out is None else dx_out[0]
    xd_part, v_part = rt.empty(rows), rt.empty(rows)
    diag_part = rt.empty(rows if has_diag else (1,))
    d_part = rt.empty((batch, nc, heads, tq * tp))
    _tile(rt, dims, M_DXD, grids["rows_p"], dec, {"HAS_D": has_d, "HAS_DIAG": has_diag}, xv=s.x, dyv=dy, bv=s.B,
          pairv=cb, stv=dstates, skip=s.D if has_d else dec, tile_out=dx, row_part=xd_part, row_part2=v_part,
          x_part=diag_part, tile_part=d_part)  # x_part: M_DXD writes its ∂diag pieces there
    split = _hsplit(batch, nc, heads, groups, s.chunk)
    dcb = rt.empty((split[0], batch, nc, groups, s.chunk, s.chunk))
    x_part = rt.empty((batch, heads, nc, npairs, s.chunk))
    _tile(rt, dims, M_DCB, (npairs, nc * groups * split[0], batch), dec, {"HAS_DIAG": has_diag}, xv=s.x, dyv=dy,
          pairv=cb, tile_out=dcb, x_part=x_part, split=split)
    dB, dC = rt.empty(s.B.shape), rt.empty(s.C.shape)
    _tile(rt, dims, M_DB, grids["rows_n"], dec, xv=s.x, cv=s.C, pairv=dcb, stv=dstates, tile_out=dB, split=split)
    _tile(rt, dims, M_DC, grids["rows_n"], dec, dyv=dy, bv=s.B, cv=s.C, pairv=dcb, stv=s.states, tile_out=dC,
          row_part=u_part, split=split)
    if scatter is not None:
        matrix, start = scatter
        column_scatter(dx.reshape(batch * length, -1), matrix.reshape(batch * length, -1), start)
        dx = matrix
    dadt, dscale = rt.empty(s.adt.shape), rt.empty(s.scale.shape)
    ddiag = rt.empty(s.adt.shape) if has_diag else None
    param_part = rt.empty((batch, nc, heads) if has_d else (1,))
    rt.run("ssd_rows_backward", (nc, heads, batch), {"HAS_D": has_d, "HAS_DIAG": has_diag},
           u_part=u_part,
           row_part=xd_part, row_part2=v_part, row_part3=diag_part, w_part=w_part, x_part=x_part, tile_part=d_part,
           dadt=dadt, dscale=dscale, ddiag=ddiag if has_diag else rt.empty((1,)), param_part=param_part, **dims)
    if not has_d:
        return dx, dadt, dscale, dB, dC, None, ddiag
    if not accumulate:
        dD = rt.empty((heads,))
    param_grads(rt, dims, param_part, [dD], accumulate, shape, segment)
    return dx, dadt, dscale, dB, dC, dD, ddiag


def _mamba2_prep(rt, dims: dict, dt_raw, dt_bias, A_log) -> tuple[Tensor, Tensor]:
    """(adt = Δ A, scale = Δ) [B, L, H] by ssd_mamba2_prep."""
    adt, scale = rt.empty(dt_raw.shape), rt.empty(dt_raw.shape)
    rt.run("ssd_mamba2_prep", grid_1d(dt_raw.size), dt_raw=dt_raw, dt_bias=dt_bias, A_log=A_log, adt_out=adt,
           scale_out=scale, **dims)
    return adt, scale


def ssd_scan(x: Tensor, dt_raw: Tensor, A_log: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor,
             chunk: int | None = None, dt_limit: tuple[float, float] = (0.0, NO_LIMIT),
             segment: int | None = None) -> tuple[Tensor, Mamba2SSDSaved]:
    """Mamba-2's scan: x [B, L, H, P], dt_raw [B, L, H], A_log, D, dt_bias [H], B, C [B, L, G, N] ->
    (y [B, L, H, P], saved): the core with scale = Δ = clamp(softplus(dt_raw + dt_bias), dt_limit) and
    adt = Δ A, A = −exp(A_log).

    `chunk` (1..1024) is the kernel's chunk length (None: `kernel_chunk`'s pick; not the model config's
    chunk_size, which only travels with the model); any L works (the last chunk is masked). `dt_limit` = (lo, hi)
    clamps Δ after the softplus (mamba_ssm's dt_limit; hi may be inf). `segment`: chunks per dispatch of the
    state passing (None: all, except on Mesa llvmpipe, whose loop budget sets it; mambactl/ops/checks.py)."""
    op = "ssd_scan"
    batch, length, heads, headdim, groups, nstate = _check_inputs(op, x, dt_raw, A_log, B, C, D, dt_bias)
    chunk = _check_chunk(op, x.runtime, chunk, length, heads, groups)
    dims = _dims(batch, length, heads, headdim, groups, nstate, chunk, dt_limit)
    # The core's in-chunk loops, refused under this op's name before anything is recorded.
    _check_loops(x.runtime, op, tuple(x.shape), kernel_loops(chunk, headdim, nstate, heads, groups),
                 ("ssd_prep", "ssd_tile"))
    adt, scale = _mamba2_prep(x.runtime, dims, dt_raw, dt_bias, A_log)
    y, core = ssd_chunked(x, adt, scale, B, C, D, chunk=chunk, segment=segment)
    return y, Mamba2SSDSaved(x, dt_raw, A_log, B, C, D, dt_bias, (dims["dt_min"], dims["dt_max"]), core)


def ssd_step(state: Tensor, x: Tensor, dt_raw: Tensor, A_log: Tensor, B: Tensor, C: Tensor, D: Tensor,
             dt_bias: Tensor, dt_limit: tuple[float, float] = (0.0, NO_LIMIT), dt_start: int | None = None) -> Tensor:
    """One decoding step per batch row. x [B, H·P], dt_raw [B, H] (or, with `dt_start`, wider rows [B, W] whose
    columns [dt_start, dt_start + H) are read: in_proj's output as it is), B, C [B, G·N], A_log, D, dt_bias [H];
    state [B, H, P, N] (e.g. a forward's `saved.last_state`) is advanced in place. -> y [B, H·P], the parallel
    scan's output at that position: Δ = clamp(softplus(dt_raw + dt_bias), dt_limit),
    S = exp(Δ A) S + Δ x Bᵀ, y = S C + D x."""
    op = "ssd_step"
    expect(op, "state", state, (None, None, None, None))
    batch, heads, headdim, nstate = state.shape
    if min(state.shape) < 1:
        raise ShapeError(f"{op}: state has shape {state.shape}; every dimension must be at least 1")
    expect(op, "x", x, (batch, heads * headdim))
    if dt_start is None:
        expect(op, "dt_raw", dt_raw, (batch, heads))
    else:
        expect(op, "dt_raw", dt_raw, (batch, None))
        expect_columns(op, "dt_raw", dt_raw, dt_start, heads)
    expect(op, "B", B, (batch, None))
    if B.shape[1] % nstate or B.shape[1] < nstate or heads % (B.shape[1] // nstate):
        raise ShapeError(f"{op}: B has shape {B.shape}; its width must be G·{nstate}, G dividing the {heads} heads")
    groups = B.shape[1] // nstate
    expect(op, "C", C, B.shape)
    for name, t in (("A_log", A_log), ("D", D), ("dt_bias", dt_bias)):
        expect(op, name, t, (heads,))
    dims = _dims(batch, 1, heads, headdim, groups, nstate, 1, dt_limit)
    if dt_start is not None:
        dims.update(dt_stride=dt_raw.shape[1], dt_col=dt_start)
    rt = x.runtime
    _check_loops(rt, op, tuple(state.shape), kernel_loops(1, headdim, nstate), ("ssd_step",))
    y = rt.empty(x.shape)
    lanes = step_lanes(rt)
    rt.run("ssd_step", grid_1d(batch * heads * headdim * lanes), {"STEP_LANES": lanes}, x=x, dt_raw=dt_raw, dt_bias=dt_bias, A_log=A_log,
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
    dx, dadt, dscale, dB, dC, dD, _ = ssd_chunked_backward(s.core, dy, {"D": dD} if accumulate else None, segment)
    ddt_raw = rt.empty(s.dt_raw.shape)
    param_part = rt.empty((batch, dims["nchunks"], heads, 2))
    rt.run("ssd_mamba2_backward", (dims["nchunks"], heads, batch), dt_raw=s.dt_raw, dt_bias=s.dt_bias, A_log=s.A_log,
           dadt=dadt, dscale=dscale, ddt_raw=ddt_raw, param_part=param_part, **dims)
    if not accumulate:
        dA_log, ddt_bias = rt.empty((heads,)), rt.empty((heads,))
    param_grads(rt, dims, param_part, [dA_log, ddt_bias], accumulate, tuple(dy.shape), segment, op)
    return dx, ddt_raw, dA_log, dB, dC, dD, ddt_bias
