"""Mamba-3 scan (exponential-trapezoidal, SISO and MIMO), forward and exact backward (kernels/mamba3_scan.wgsl).

The same computation as mambactl/reference/mamba3.py's `mamba3_scan` / `mamba3_scan_backward`:

    α = exp(adt),  β = (1 − λ) Δ α,  γ = λ Δ,
    h_t = α_t h_{t−1} + β_t Σ_r v_{t−1,r} k_{t−1,r}ᵀ + γ_t Σ_r v_{t,r} k_{t,r}ᵀ,  y_{t,R} = h_t q_{t,R},

with q, k [B, L, H, R, N], v and y [B, L, H, R, P], adt = A·Δ, dt = Δ, lam = λ [B, L, H] (SISO is R = 1).

SISO (R = 1) runs as a Mamba-2 SSD: with δ_t = (1 − λ_t) Δ_t (0 after the last step) and s_t = λ_t Δ_t + δ_{t+1}
the recurrence is g_t = α_t g_{t−1} + s_t v_t k_tᵀ, h_t = g_t − δ_{t+1} v_t k_tᵀ = α_t g_{t−1} + γ_t v_t k_tᵀ, so
`mamba3_fold_scale` gives s and the diagonal weight γ = λ Δ, and the chunked SSD core (mambactl/ops/ssd.py
`ssd_chunked`, x = v, B = k with one group per head, C = q, log-decay adt, step t's own term weighted by γ_t)
gives h_t q_t directly (kernels/mamba3_fold.wgsl); the backward is the core's and `mamba3_fold_backward`
(elementwise over [B, L, H]). Its memory is the core's (the state entering each chunk, [B, ceil(L / chunk), H, P,
N], the state after the last step, which is h there since δ after it is 0, the decay sums and q kᵀ per chunk)
plus s and γ [B, L, H]; `chunk` is the core's chunk (at most MAX_CHUNK = 1024).

MIMO (R > 1: Σ_r v_r k_rᵀ is R outer products per step, which the core's one-key-per-step form does not take)
runs the recurrent kernels below. Their forward (on every adapter, unless one step's k and q overflow 16 KiB of
workgroup memory) splits each value channel's state row over FWD_TILES threads and stages time tiles of k, q, v
in workgroup memory (the kernel's header).

Memory of the recurrent (MIMO) path: the forward keeps the (SSD-form) state entering each chunk of `chunk` steps, [B, ceil(L / chunk), H, P, N],
and the state after the last step [B, H, P, N]; the backward recomputes the states in between. One workgroup of
BACKWARD_THREADS threads per (batch, head, block of TILE_N state columns) walks the value channels in blocks of
BWD_CHANNELS, each thread holding 4 channels × 4 columns of the state and adjoint in registers; per step the sums
over channels (dq, dk), over columns (dv) and the scalars go through workgroup memory once per rank, in a fixed
order. Its transients (`backward_buffers`): one chunk of recomputed states per workgroup
([B, H, ceil(N / TILE_N), min(chunk, L), 16, BACKWARD_THREADS]), dv per column block
([ceil(N / TILE_N), B, L, H, R, P], only when N > TILE_N) and three scalars per step, head and warp slice
([B, L, H, 8·ceil(N / TILE_N), 3]), added in order by second dispatches: nothing of B·L·H·P·N size, and
deterministic (no atomics). At mamba-130m training (B 8, L 1024, H 24, P 64, N 128) the largest, g_scratch, is
400 MB.
"""

from __future__ import annotations

from dataclasses import dataclass

from mambactl.errors import ShapeError
from mambactl.ops.checks import expect, expect_columns, grid_1d, segment_length, segments
from mambactl.ops.mamba3_fold import mamba3_fold_backward, mamba3_fold_scale
from mambactl.ops import ssd
from mambactl.ops.ssd import MAX_CHUNK, SSDSaved, kernel_chunk, ssd_chunked, ssd_chunked_backward
from mambactl.runtime.tensor import Tensor

MAX_STATE = 128  # mirrors MAX_N in kernels/mamba3_scan.wgsl (a private array per thread)
MAX_RANK = 16    # mirrors MAX_R
DEFAULT_CHUNK = 64  # MIMO's steps between saved states when the caller gives none
THREADS = 64     # workgroup size of the forward entries
BACKWARD_THREADS = 256  # mirrors BW: threads per backward workgroup (16 × 16, each 4 channels × 4 columns)
BWD_CHANNELS = 64  # mirrors BPB: value channels per block of the backward (walked in order by one workgroup)
TILE_N = 64      # mirrors BNB: state columns per backward workgroup
FWD_CHANNELS = 32  # mirrors FP: value channels per workgroup of the tiled forward
FWD_TILES = 8      # mirrors FNT: state tiles (threads per channel) of the tiled forward
FWD_THREADS = FWD_CHANNELS * FWD_TILES  # mirrors FW
FWD_MAX_ROWS = 16  # mirrors MAX_TR: steps × rank per time tile
FWD_BUF = 4096     # mirrors FBUF: floats of workgroup memory (16 KiB)
_ALL = 0xFFFFFFFF  # "to the end" for the kernel's segment bounds


@dataclass
class Mamba3ScanSaved:
    """What the backward needs: the forward's inputs (not copied) and the chunk entry states."""

    q: Tensor
    k: Tensor
    v: Tensor
    adt: Tensor
    dt: Tensor
    lam: Tensor
    states: Tensor  # [B, n_chunks, H, P, N]: the SSD state g before step c·chunk
    chunk: int
    last_state: Tensor  # [B, H, P, N]: g after the last step (= h there)
    core: SSDSaved | None = None  # SISO: the SSD core's (x = v, B = k, C = q, scale and diag: mamba3_fold_scale)
    v_start: int | None = None  # SISO: v's first column in a wider matrix v [B, L, W] (None: v is [B, L, H, R, P])
    headdim: int | None = None  # P where v_start is set

    def dims(self, op: str) -> tuple[int, int, int, int, int, int]:
        """(batch, length, heads, rank, nstate, headdim), the saved inputs checked as the forward took them."""
        return _check_inputs(op, self.q, self.k, self.v, self.adt, self.dt, self.lam, self.v_start, self.headdim)


def _check_inputs(op: str, q, k, v, adt, dt, lam, v_start: int | None = None,
                  headdim: int | None = None) -> tuple[int, int, int, int, int, int]:
    expect(op, "q", q, (None, None, None, None, None))
    batch, length, heads, rank, nstate = q.shape
    if min(q.shape) < 1:
        raise ShapeError(f"{op}: q has shape {q.shape}; every dimension must be at least 1")
    if nstate > MAX_STATE:
        raise ShapeError(f"{op}: q has shape {q.shape}; the state size N must be at most {MAX_STATE}")
    if rank > MAX_RANK:
        raise ShapeError(f"{op}: q has shape {q.shape}; the rank R must be at most {MAX_RANK}")
    expect(op, "k", k, q.shape)
    if v_start is None:
        expect(op, "v", v, (batch, length, heads, rank, None))
        headdim = v.shape[4]
    else:  # SISO's v = x read in place from in_proj's output
        if rank != 1:
            raise ShapeError(f"{op}: v_start is for SISO (rank 1); q has rank {rank}")
        expect(op, "v", v, (batch, length, None))
        expect_columns(op, "v", v, v_start, heads * (headdim or 0))
    if headdim is None or headdim < 1:
        raise ShapeError(f"{op}: the head dimension is {headdim}; it must be at least 1")
    for name, t in (("adt", adt), ("dt", dt), ("lam", lam)):
        expect(op, name, t, (batch, length, heads))
    return batch, length, heads, rank, nstate, headdim


def _params(batch, length, heads, rank, nstate, headdim, chunk) -> dict:
    return dict(batch=batch, len=length, heads=heads, rank=rank, nstate=nstate, headdim=headdim, chunk=chunk,
                nchunks=-(-length // chunk), seg_begin=0, seg_end=length, pb_lo=0, pb_hi=_ALL, kc_lo=0, kc_hi=_ALL,
                rec_lo=0, rec_hi=_ALL, adj_lo=0, adj_hi=_ALL, carry_in=0, carry_out=0, tile=1)


def forward_tile(rank: int, nstate: int) -> int:
    """Steps per time tile of the tiled forward (0: not even one step's k, q, v fit its workgroup memory, and the
    per-channel forward runs instead): T·R ≤ FWD_MAX_ROWS and T·(R·(2N + FWD_CHANNELS) + 3) ≤ FWD_BUF."""
    return min(FWD_MAX_ROWS // rank, FWD_BUF // (rank * (2 * nstate + FWD_CHANNELS) + 3))


# Loop iterations per invocation (upper bounds, no unrolling assumed), for Mesa llvmpipe's budget of 65,535
# (mambactl/ops/checks.py). The per-channel forward, per step: the t loop, the chunk-entry store (N), the g update
# (N·(1 + R)) and the output (R·(1 + N·(1 + R))).
def forward_loops_per_step(rank: int, nstate: int) -> int:
    if forward_tile(rank, nstate) == 0:
        return 1 + nstate + nstate * (1 + rank) + rank * (1 + nstate * (1 + rank))
    # The tiled forward, per step: the step loop, the chunk-entry store (MAX_NT), the g update (MAX_NT·(1 + R)),
    # the output (R·(1 + MAX_NT)); per tile (charged to each step, as if T = 1): staging (≤ 17), the y partials
    # (≤ MAX_TR) and their sums (≤ 2·(1 + FNT)), the tile loop.
    nt = -(-MAX_STATE // FWD_TILES)
    return 1 + nt + nt * (1 + rank) + rank * (1 + nt) + 17 + FWD_MAX_ROWS + 2 * (1 + FWD_TILES) + 1


# Backward, per step of the recompute (16 state elements per thread): the step loop, u's init (16), its rank loop
# (R·(1 + 16)) and the update (16).
def backward_recompute_loops_per_step(rank: int, nstate: int) -> int:
    return 1 + 16 + rank * 17 + 16


# Backward, per step of the adjoint: the step loop, the state loads (16), u / dq's init (16), their rank loop
# (R·(1 + 16)), the update (16), and R passes through workgroup memory: the pass loop, the k / v / dy loads (4), the
# partial stores (4 + 4) and the reduction (at most 8, the scalars').
def backward_adjoint_loops_per_step(rank: int, nstate: int) -> int:
    return 1 + 16 + 16 + rank * 17 + 16 + rank * (1 + 4 + 4 + 4 + 8)


_FIXED = 4 * MAX_STATE + 64  # per dispatch: the state's init and store, the p-block and chunk loops


def mamba3_scan(q: Tensor, k: Tensor, v: Tensor, adt: Tensor, dt: Tensor, lam: Tensor,
                chunk: int | None = None, segment: int | None = None, *, D: Tensor | None = None,
                v_start: int | None = None, headdim: int | None = None) -> tuple[Tensor, Mamba3ScanSaved]:
    """-> (y [B, L, H, R, P], saved). `chunk` (positive) is the number of steps between saved states (SISO: the
    SSD core's chunk, min(chunk, MAX_CHUNK, L); the result does not depend on it beyond float rounding). None:
    SISO takes the core's pick for the adapter and shape (ops/ssd.py `kernel_chunk`), MIMO DEFAULT_CHUNK (both
    ops/ssd.py's FORCE_CHUNK when set); the model config's chunk_size (mamba_ssm's) is not read. adt ≤ 0 (a decay).

    `segment`: steps per dispatch of the walks over time (SISO: the core's walk over chunks goes in dispatches of
    ceil(segment / chunk) chunks). None: all in one dispatch, except on Mesa llvmpipe, whose per-invocation loop
    budget sets it (mambactl/ops/checks.py).

    SISO only: D [H] adds the skip D v to y inside the core (y = h q + D v), and with `v_start` (and `headdim`
    P) v is a wider matrix [B, L, W] whose columns [v_start, v_start + H·P) are v, read in place (the block's
    in_proj output); y is [B, L, H, 1, P] either way."""
    op = "mamba3_scan"
    dims = _check_inputs(op, q, k, v, adt, dt, lam, v_start, headdim)
    if chunk is not None and int(chunk) < 1:
        raise ShapeError(f"{op}: chunk is {chunk}; it must be a positive number of steps")
    batch, length, heads, rank, nstate, headdim = dims
    if rank == 1:
        if D is not None:
            expect(op, "D", D, (heads,))
        if chunk is None:
            chunk = kernel_chunk(q.runtime, length, heads, heads)
        return _siso_scan(q, k, v, adt, dt, lam, int(chunk), segment, D, v_start, headdim)
    if D is not None:
        raise ShapeError(f"{op}: D is for SISO (rank 1); MIMO's skip is mamba3_finish's")
    if chunk is None:
        chunk = DEFAULT_CHUNK if ssd.FORCE_CHUNK is None else ssd.FORCE_CHUNK
    params = _params(*dims, int(chunk))
    rt = q.runtime
    y = rt.empty(v.shape)
    states = rt.empty((batch, params["nchunks"], heads, headdim, nstate))
    last_state = rt.empty((batch, heads, headdim, nstate))
    seg = segment_length(rt, op, tuple(q.shape), length, forward_loops_per_step(rank, nstate), _FIXED,
                         segment=segment)
    tile = forward_tile(rank, nstate)
    if tile:
        entry = "mamba3_scan_forward_tiled"
        grid = grid_1d(batch * heads * -(-headdim // FWD_CHANNELS) * FWD_THREADS, FWD_THREADS)
        params.update(tile=tile)
    else:
        entry, grid = "mamba3_scan_forward", grid_1d(batch * heads * headdim, THREADS)
    for t0, t1 in segments(length, seg):
        params.update(seg_begin=t0, seg_end=t1)
        rt.run(entry, grid, q=q, k=k, v=v, adt=adt, dt=dt, lam=lam, y=y, states=states, last_state=last_state,
               **params)
    return y, Mamba3ScanSaved(q, k, v, adt, dt, lam, states, int(chunk), last_state)


def _siso_views(q: Tensor, k: Tensor, v: Tensor, v_start: int | None) -> tuple[Tensor, Tensor, Tensor]:
    """q, k [B, L, H, 1, N], v [B, L, H, 1, P] -> the core's C, B [B, L, H, N] (one group per head) and x
    [B, L, H, P] (v as it is with v_start): views, nothing copied."""
    b, l, h, _, n = q.shape
    return q.reshape(b, l, h, n), k.reshape(b, l, h, n), v if v_start is not None else v.reshape(b, l, h, v.shape[4])


def _core_segment(segment: int | None, chunk: int) -> int | None:
    """Steps per dispatch -> the core's chunks per dispatch."""
    return None if segment is None else max(1, -(-int(segment) // chunk))


def _siso_scan(q, k, v, adt, dt, lam, chunk: int, segment: int | None, D, v_start: int | None,
               headdim: int) -> tuple[Tensor, Mamba3ScanSaved]:
    q4, k4, v4 = _siso_views(q, k, v, v_start)
    scale, diag = mamba3_fold_scale(dt, lam)
    chunk = min(chunk, MAX_CHUNK)
    y, core = ssd_chunked(v4, adt, scale, k4, q4, D, chunk=chunk, segment=_core_segment(segment, chunk), diag=diag,
                          x_start=v_start, headdim=headdim if v_start is not None else None)
    b, l, h = adt.shape
    return y.reshape(b, l, h, 1, headdim), Mamba3ScanSaved(q, k, v, adt, dt, lam, core.states, core.chunk,
                                                           core.last_state, core, v_start, headdim)


def _siso_scan_backward(s: Mamba3ScanSaved, dy: Tensor, segment: int | None, dD, dv_out):
    b, l, h, _, p = dy.shape
    grads = None if dD is None else {"D": dD}
    dv, dadt, dscale, dk, dq, _, ddiag = ssd_chunked_backward(s.core, dy.reshape(b, l, h, p), grads,
                                                              _core_segment(segment, s.chunk), dv_out)
    ddt, dlam = mamba3_fold_backward(s.dt, s.lam, dscale, ddiag)
    if dv_out is None:
        dv = dv.reshape(b, l, h, 1, p)
    return dq.reshape(s.q.shape), dk.reshape(s.k.shape), dv, dadt, ddt, dlam


def backward_buffers(batch: int, length: int, heads: int, rank: int, nstate: int, headdim: int,
                     chunk: int) -> dict[str, tuple[int, ...]]:
    """The recurrent backward's transient tensors (name -> shape) besides its outputs: what
    `mamba3_scan_backward` allocates for MIMO (R > 1), for planning memory without a device (at R = 1 the
    figures are those of the recurrent kernels; SISO runs the SSD core, see mambactl/ops/ssd.py)."""
    tiles = -(-nstate // TILE_N)
    shapes = {"g_scratch": (batch, heads, tiles, min(chunk, length), 16, BACKWARD_THREADS),
              "part_s": (batch, length, heads, tiles * 8, 3)}
    if tiles > 1:
        shapes["dv_part"] = (tiles, batch, length, heads, rank, headdim)
    return shapes


def _backward_segments(rt, op: str, shape, length: int, rank: int, nstate: int, headdim: int, chunk: int,
                       segment: int | None):
    """The backward's dispatches as parameter updates: one covering everything, or (on llvmpipe, or with
    `segment` steps) per p-block and chunk, the recompute and then the adjoint in segments of steps."""
    span = min(chunk, length)
    per_rec, per_adj = backward_recompute_loops_per_step(rank, nstate), backward_adjoint_loops_per_step(rank, nstate)
    whole = _FIXED + -(-headdim // BWD_CHANNELS) * length * (per_rec + per_adj)
    if segment is None and segment_length(rt, op, shape, whole, 1) >= whole:
        return [{}]  # one dispatch: not llvmpipe, or it all fits the budget
    rec = segment_length(rt, op, shape, span, per_rec, _FIXED, segment=segment)
    adj = segment_length(rt, op, shape, span, per_adj, _FIXED, segment=segment)
    nchunks = -(-length // chunk)
    out = []
    for pb in range(-(-headdim // BWD_CHANNELS)):
        first = True
        for kc in range(nchunks, 0, -1):
            steps = min(chunk, length - (kc - 1) * chunk)
            common = dict(pb_lo=pb, pb_hi=pb + 1, kc_lo=kc - 1, kc_hi=kc)
            for j in range(0, steps, rec):
                out.append(dict(common, rec_lo=j, rec_hi=j + rec, adj_lo=0, adj_hi=0, carry_in=0, carry_out=0))
            for j in range(steps, 0, -adj):
                out.append(dict(common, rec_lo=0, rec_hi=0, adj_lo=max(0, j - adj), adj_hi=j,
                                carry_in=int(not first), carry_out=1))
                first = False
    return out


def mamba3_scan_backward(saved: Mamba3ScanSaved, dy: Tensor, segment: int | None = None, *,
                         dD: Tensor | None = None, dv_out: tuple[Tensor, int] | None = None):
    """dy [B, L, H, R, P] -> (dq, dk, dv, dadt, ddt, dlam), shaped as the inputs (dv [B, L, H, R, P]). Exact.

    `segment`: steps per dispatch of the recompute and of the adjoint (G carried between dispatches in a
    [B, H, P, N] buffer; SISO: the core's walks over chunks, as in `mamba3_scan`). None: one dispatch, except on
    Mesa llvmpipe (see `mamba3_scan`). SISO only: with the forward's D, ∂D is added into `dD` [H] (required
    then); `dv_out` = (matrix [B, L, W], start) puts dv (the skip's D dy included) into its columns
    [start, start + H·P) and nothing else of it, and dv is that matrix."""
    op = "mamba3_scan_backward"
    s = saved
    dims = s.dims(op)
    batch, length, heads, rank, nstate, headdim = dims
    expect(op, "dy", dy, (batch, length, heads, rank, headdim))
    has_d = s.core is not None and s.core.D is not None
    if has_d != (dD is not None):
        raise ShapeError(f"{op}: dD is {'missing' if has_d else 'given'}; give it exactly when the forward had D")
    if dD is not None:
        expect(op, "dD", dD, (heads,))
    if s.core is not None:
        return _siso_scan_backward(s, dy, segment, dD, dv_out)
    if dv_out is not None:
        raise ShapeError(f"{op}: dv_out is for SISO (rank 1)")
    params = _params(*dims, s.chunk)
    expect(op, "saved states", s.states, (batch, params["nchunks"], heads, headdim, nstate))
    rt = dy.runtime
    plan = backward_buffers(*dims, s.chunk)
    tiles = -(-nstate // TILE_N)
    g_scratch, part_s = rt.empty(plan["g_scratch"]), rt.empty(plan["part_s"])
    dq, dk, dv = rt.empty(s.q.shape), rt.empty(s.k.shape), rt.empty(s.v.shape)
    dv_part = rt.empty(plan["dv_part"]) if tiles > 1 else dv
    segments = _backward_segments(rt, op, tuple(s.q.shape), length, rank, nstate, headdim, s.chunk, segment)
    g_carry = rt.empty((batch, heads, headdim, nstate)) if len(segments) > 1 else s.last_state  # unused if one
    for seg in segments:
        rt.run("mamba3_scan_backward", grid_1d(batch * heads * tiles * BACKWARD_THREADS, BACKWARD_THREADS),
               q=s.q, k=s.k, v=s.v, adt=s.adt, dt=s.dt, lam=s.lam, dy=dy, saved_states=s.states,
               g_scratch=g_scratch, dv_part=dv_part, dq=dq, dk=dk, part_s=part_s, g_carry=g_carry,
               **{**params, **seg})
    if tiles > 1:
        rows = batch * length * heads * rank * headdim
        rt.run("mamba3_scan_sum_channels", grid_1d(rows), part=dv_part, total=dv, rows=1, width=rows, slices=tiles)
    rows = batch * length * heads
    dadt, ddt, dlam = (rt.empty(s.adt.shape) for _ in range(3))
    rt.run("mamba3_scan_scalars", grid_1d(rows), part=part_s, lam=s.lam, dt=s.dt, dadt=dadt, ddt=ddt, dlam=dlam,
           count=rows, steps=length, nheads=heads, nslices=tiles * 8)
    return dq, dk, dv, dadt, ddt, dlam


def _step_params(batch, heads, rank, nstate, headdim, angles, mimo) -> dict:
    return dict(sbatch=batch, sheads=heads, srank=rank, snstate=nstate, sheaddim=headdim, sangles=angles,
                smimo=int(mimo))


def mamba3_rotate_step(q: Tensor, k: Tensor, theta0: Tensor, theta_inc: Tensor, angles: int,
                       mimo: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Decoding: q, k [B, H, R, N] turned by their own angle increment θ_inc [B, H, max(S, 1)] -> (q, k turned on
    by the angle θ0 [B, H, max(S, 1)] reached before this token, θ0 + θ_inc). Pairs as kernels/mamba3_prep.wgsl."""
    op = "mamba3_rotate_step"
    expect(op, "q", q, (None, None, None, None))
    batch, heads, rank, nstate = q.shape
    expect(op, "k", k, q.shape)
    for name, t in (("theta0", theta0), ("theta_inc", theta_inc)):
        expect(op, name, t, (batch, heads, max(angles, 1)))
    rt = q.runtime
    q_out, k_out, theta_out = rt.empty(q.shape), rt.empty(k.shape), rt.empty(theta0.shape)
    if angles == 0:
        theta_out = theta0
    rt.run("mamba3_scan_rotate", grid_1d(batch * heads * rank * nstate), q=q, k=k, theta0=theta0,
           theta_inc=theta_inc, theta_out=theta_out, q_out=q_out, k_out=k_out,
           **_step_params(batch, heads, rank, nstate, 1, angles, mimo))
    return q_out, k_out, theta_out


def mamba3_scan_step(state: Tensor, q: Tensor, k: Tensor, v: Tensor, adt: Tensor, dt: Tensor, lam: Tensor,
                     k_prev: Tensor, v_prev: Tensor) -> Tensor:
    """One decoding step per batch row: q, k, k_prev [B, H, R, N], v, v_prev [B, H, R, P], adt, dt, lam [B, H];
    state h [B, H, P, N] (e.g. the forward's `saved.last_state`) advances in place,
    h = α h + β Σ_r v_prev k_prevᵀ + γ Σ_r v kᵀ. -> y [B, H, R, P] = h q, the parallel scan's output there."""
    op = "mamba3_scan_step"
    expect(op, "state", state, (None, None, None, None))
    batch, heads, headdim, nstate = state.shape
    expect(op, "q", q, (batch, heads, None, nstate))
    rank = q.shape[2]
    if nstate > MAX_STATE or rank > MAX_RANK or min(q.shape) < 1:
        raise ShapeError(f"{op}: q has shape {q.shape}; N must be at most {MAX_STATE} and R at most {MAX_RANK}")
    for name, t in (("k", k), ("k_prev", k_prev)):
        expect(op, name, t, q.shape)
    for name, t in (("v", v), ("v_prev", v_prev)):
        expect(op, name, t, (batch, heads, rank, headdim))
    for name, t in (("adt", adt), ("dt", dt), ("lam", lam)):
        expect(op, name, t, (batch, heads))
    rt = q.runtime
    y = rt.empty(v.shape)
    lanes = ssd.step_lanes(rt)  # threads per row of h, as ssd_step
    rt.run("mamba3_scan_step", grid_1d(batch * heads * headdim * lanes), {"STEP_LANES": lanes}, q=q, k=k, v=v,
           adt=adt, dt=dt, lam=lam,
           k_prev=k_prev, v_prev=v_prev, ssm_state=state, y=y,
           **_step_params(batch, heads, rank, nstate, headdim, 0, False))
    return y
