"""Mamba-3 mixer pieces around the scan (kernels/mamba3_prep.wgsl): the scan inputs from in_proj's output, the
RMSNorm of its B and C columns included (`mamba3_prep` / `mamba3_prep_backward`), and the output side
(`mamba3_finish` / `mamba3_finish_backward`).
See mambactl/reference/mamba3.py `_prepare` / `_finish` / `mamba3_block_backward` for the maths.

Dims: M = B·L rows; H heads of P channels (di = H·P); rank R (1 for SISO); G groups of B/C with N states;
S rotation angles. proj [M, 2·di + 2·R·G·N + 3·H + S] = [z | x | B | C | dd_dt | dd_A | trap | angle].
"""

from __future__ import annotations

from dataclasses import dataclass

from mambactl.errors import ShapeError
from mambactl.ops.checks import (SEGMENT_BUDGET, expect, grid_1d, is_cpu, is_llvmpipe, loop_budget, segment_length,
                                 segments)
from mambactl.runtime.tensor import Tensor

MAX_ANGLES = 64  # mirrors MAX_S in kernels/mamba3_prep.wgsl


@dataclass(frozen=True)
class Mamba3Dims:
    batch: int
    length: int
    heads: int
    headdim: int
    rank: int
    groups: int
    nstate: int
    angles: int
    mimo: bool

    @property
    def rows(self) -> int:
        return self.batch * self.length

    @property
    def rgn(self) -> int:
        return self.rank * self.groups * self.nstate

    @property
    def cols(self) -> int:
        return 2 * self.heads * self.headdim + 2 * self.rgn + 3 * self.heads + self.angles

    def check(self, op: str) -> None:
        if self.angles > MAX_ANGLES:
            raise ShapeError(f"{op}: {self.angles} rotation angles; at most {MAX_ANGLES}")
        if self.heads % self.groups:
            raise ShapeError(f"{op}: {self.groups} groups must divide {self.heads} heads")
        if self.nstate > MAX_NORM_STATE:
            raise ShapeError(f"{op}: a state of {self.nstate}; at most {MAX_NORM_STATE}")
        pairs_end = (self.nstate // 2 + self.angles) if self.mimo else 2 * self.angles
        if pairs_end > self.nstate or (self.mimo and self.angles > self.nstate // 2):
            raise ShapeError(f"{op}: {self.angles} angles do not fit a state of {self.nstate}")


def _prep_params(d: Mamba3Dims, a_floor: float, norm_eps: float) -> dict:
    return dict(batch=d.batch, len=d.length, heads=d.heads, rank=d.rank, ngroups=d.groups, nstate=d.nstate,
                headdim=d.headdim, angles=d.angles, mimo=int(d.mimo), cols=d.cols, a_floor=float(a_floor),
                norm_eps=float(norm_eps), splits=ROTATE_SPLITS, seg_begin=0, seg_end=d.length)


THETA_COLUMNS, THETA_LANES = 16, 16  # mirror TC, TL in kernels/mamba3_prep.wgsl (a θ walk's workgroup)
ROTATE_ROWS = 8  # mirrors RB: rows per block of mamba3_prep_rotate_backward (its bias partials' rows)
# splits of a group's heads in mamba3_prep_rotate_backward (threads per pair of state dims and block): 2 measured
# best on the H200 at the mamba3-130m shape when the kernel took a thread per state dim (rotate backward 0.19 ms per
# layer at 2, 3 or 4, 0.26 at 1); not re-measured for a thread per pair
ROTATE_SPLITS = 2
MAX_NORM_STATE = 256  # the B / C RMSNorm kernels' workgroup holds a thread per state dim


# Loop iterations of one θ-walk invocation (mamba3_prep_theta / mamba3_prep_dtheta; Mesa llvmpipe allows 65,535
# per invocation, see mambactl/ops/checks.py) over `steps` time steps: its lane's share twice, plus the lane totals.
# The channel kernels loop only over the ranks, the rotation kernels over the heads, the reduce over the heads or
# angles.
def prep_walk_loops(steps: int) -> int:
    return 2 * -(-int(steps) // THETA_LANES) + THETA_LANES


def _segments(rt, op: str, d: Mamba3Dims, segment: int | None) -> list[tuple[int, int]]:
    # per_step 1 bounds 2·ceil(steps / lanes) from above (a lane walks its share twice)
    seg = segment_length(rt, op, (d.batch, d.length, d.heads), d.length, 1, THETA_LANES, segment=segment)
    return segments(d.length, seg)


def _walk_grid(d: Mamba3Dims):
    blocks = -(-d.heads * d.angles // THETA_COLUMNS)
    return grid_1d(d.batch * blocks * THETA_COLUMNS * THETA_LANES, THETA_COLUMNS * THETA_LANES)


def _row_grid(rt, d: Mamba3Dims, width: int, ys: int, loops_per_row: int):
    """(x: `width` threads in workgroups of 64, y: `ys`, z: row blocks); a thread walks rows z, z + blocks, ....
    One row per thread on GPUs; on Mesa llvmpipe, where each workgroup costs microseconds of overhead, up to 64
    rows (kept within its loop budget at `loops_per_row` iterations per row)."""
    rows_per_thread = 1
    if is_llvmpipe(rt):
        rows_per_thread = max(1, min(64, SEGMENT_BUDGET // max(int(loops_per_row), 1)))
    blocks = min(-(-d.rows // rows_per_thread), rt.max_groups)
    if is_llvmpipe(rt):
        loop_budget(rt, "mamba3_prep", (d.batch, d.length, d.heads), -(-d.rows // blocks) * loops_per_row)
    return -(-width // 64), ys, blocks


def _mimo_or_stand_in(op: str, d: Mamba3Dims, stand_in: Tensor, **mimo):
    """MIMO: the mimo_* tensors, checked [H, R, P]. SISO: they must be None (the kernels read none of them), and
    `stand_in` (a read-only tensor the dispatch binds anyway) fills their bindings."""
    out = []
    for name, t in mimo.items():
        if d.mimo:
            out.append(expect(op, name, t, (d.heads, d.rank, d.headdim)))
        elif t is not None:
            raise ShapeError(f"{op}: {name} is given for SISO layers (they have no mimo_* parameters)")
        else:
            out.append(stand_in)
    return out


def _item_grid(rt, d: Mamba3Dims, loops_per_item: int):
    """The channel kernels' grid over M·H·P items (kernels/mamba3_prep.wgsl `item_of`), 256-thread workgroups:
    one item per thread on GPUs; on Mesa llvmpipe, where each workgroup costs microseconds of overhead, up to 64
    (kept within its loop budget at `loops_per_item` iterations per item)."""
    items = d.rows * d.heads * d.headdim
    per_thread = 1
    if is_llvmpipe(rt):
        per_thread = max(1, min(64, SEGMENT_BUDGET // max(int(loops_per_item), 1)))
        loop_budget(rt, "mamba3_prep", (d.batch, d.length, d.heads), per_thread * loops_per_item)
    threads = -(-items // per_thread)
    return grid_1d(threads, 256)


def norm_threads(d: Mamba3Dims) -> int:
    """The RMSNorm kernels' workgroup (the kernel's NW): the least power of two >= N."""
    return 1 << (d.nstate - 1).bit_length()


def _strided_grid(rt, d: Mamba3Dims, op: str, items: int, loops_per_item: int, x: int = 1, y: int = 1):
    """(x, y, workgroups) for the kernels whose workgroups walk `items` (rows or row blocks) z, z + workgroups, ...,
    within llvmpipe's loop budget at `loops_per_item` iterations per item."""
    groups = min(items, rt.max_groups)
    loop_budget(rt, op, (d.batch, d.length, d.heads), -(-items // groups) * loops_per_item)
    return x, y, groups


def pair_slots(d: Mamba3Dims) -> int:
    """⌈N/2⌉: the pairs of state dims (an odd N's last dim alone) of each (rank, group), a thread each in the
    rotation kernels (kernels/mamba3_prep.wgsl `pair_dims`)."""
    return -(-d.nstate // 2)


def rotate_blocks(d: Mamba3Dims) -> int:
    """Row blocks of mamba3_prep_rotate_backward: the rows of its bias partials."""
    return -(-d.rows // ROTATE_ROWS)


def mamba3_prep(proj: Tensor, dt_bias: Tensor, B_norm_w: Tensor, C_norm_w: Tensor, B_bias: Tensor,
                C_bias: Tensor, mimo_x: Tensor, mimo_z: Tensor, d: Mamba3Dims, a_floor: float, norm_eps: float,
                segment: int | None = None, with_v: bool = True) -> dict:
    """-> dict of q, k [M, H, R, N], v, zr [M, H, R, P], adt, dt, lam [M, H], theta [M, H, S], and the normalized
    Bn, Cn [M, R·G·N] (the rotation's backward rebuilds q, k from them and the biases). B_norm_w, C_norm_w
    [N]: the RMSNorm (epsilon norm_eps) of each (rank, group) of proj's B and C columns, read in place. mimo_x,
    mimo_z [H, R, P] for MIMO, None for SISO (v = x, zr = z there). SISO stores no zr: "zr" is proj itself, whose
    first H·P columns are z, and mamba3_finish reads them in place. SISO with `with_v` False stores no v either
    ("v" is None: v = x, which mamba3_scan then reads in place from proj's columns, v_start).

    `segment`: steps per dispatch of the θ walk (None: all, except on Mesa llvmpipe, whose loop budget sets it)."""
    op = "mamba3_prep"
    d.check(op)
    M, H, R, N, P = d.rows, d.heads, d.rank, d.nstate, d.headdim
    expect(op, "proj", proj, (M, d.cols))
    expect(op, "dt_bias", dt_bias, (H,))
    expect(op, "B_norm_w", B_norm_w, (N,))
    expect(op, "C_norm_w", C_norm_w, (N,))
    for name, t in (("B_bias", B_bias), ("C_bias", C_bias)):
        expect(op, name, t, (H, R, N))
    mimo_x, mimo_z = _mimo_or_stand_in(op, d, dt_bias, mimo_x=mimo_x, mimo_z=mimo_z)
    rt = proj.runtime
    with_v = with_v or d.mimo
    out = dict(q=rt.empty((M, H, R, N)), k=rt.empty((M, H, R, N)), v=rt.empty((M, H, R, P)) if with_v else None,
               zr=rt.empty((M, H, R, P) if d.mimo else (1,)), adt=rt.empty((M, H)), dt=rt.empty((M, H)),
               lam=rt.empty((M, H)), theta=rt.empty((M, H, max(d.angles, 1))))
    params = _prep_params(d, a_floor, norm_eps)
    if d.angles:
        for t0, t1 in _segments(rt, op, d, segment):
            params.update(seg_begin=t0, seg_end=t1)
            rt.run("mamba3_prep_theta", _walk_grid(d), proj=proj, dt_bias=dt_bias, theta=out["theta"], **params)
    params.update(seg_begin=0, seg_end=d.length)
    if with_v:
        rt.run("mamba3_prep_forward", _item_grid(rt, d, R), proj=proj, mimo_x=mimo_x, mimo_z=mimo_z, v=out["v"],
               zr=out["zr"], **params)
    Bn, Cn = out["Bn"], out["Cn"] = rt.empty((M, d.rgn)), rt.empty((M, d.rgn))
    norm_loops = 1 + 2 * R * d.groups * (1 + norm_threads(d).bit_length())
    rt.run("mamba3_prep_norm", _strided_grid(rt, d, op, d.rows, norm_loops), {"NW": norm_threads(d)}, proj=proj,
           B_norm_w=B_norm_w, C_norm_w=C_norm_w, Bn=Bn, Cn=Cn, **params)
    slots = d.rank * d.groups * pair_slots(d)
    rotate_loops = 2 + -(-H // slots) + H // d.groups
    rt.run("mamba3_prep_rotate", _row_grid(rt, d, slots, 1, rotate_loops), proj=proj, dt_bias=dt_bias, Bn=Bn,
           Cn=Cn, B_bias=B_bias, C_bias=C_bias, theta=out["theta"], q=out["q"], k=out["k"], dt=out["dt"],
           adt=out["adt"], lam=out["lam"], **params)
    if not d.mimo:
        out["zr"] = proj  # z in place (the one-element zr bound above was not written)
    return out


def mamba3_prep_backward(proj: Tensor, dt_bias: Tensor, B_norm_w: Tensor, C_norm_w: Tensor, B_bias: Tensor,
                         C_bias: Tensor, mimo_x: Tensor | None, mimo_z: Tensor | None, D: Tensor | None, prep: dict,
                         dq: Tensor, dk: Tensor, dv: Tensor | None, dzr: Tensor | None, dadt: Tensor, ddt: Tensor,
                         dlam: Tensor, dys: Tensor | None, d: Mamba3Dims, a_floor: float, norm_eps: float,
                         segment: int | None = None, dproj: Tensor | None = None) -> dict:
    """Gradients of `mamba3_prep`. mimo_x, mimo_z: None for SISO.

    SISO (z and x in place): dzr, dv, D and dys must be None and `dproj` [M, cols] given, with its z columns
    already written by `mamba3_finish_backward(..., dz_into=dproj)` and its x columns by the scan
    (`mamba3_scan_backward(..., dv_out=)`, the skip's D dy included); this writes the rest of it. MIMO: dzr,
    dv [M, H, R, P] (the scan's; D·dys, the skip's share, is added here), and dproj None (made here).

    -> dict: dproj [M, cols], every column written, dB_bias_part, dC_bias_part [rotate_blocks(d), H·R·N] and
    dB_norm_part, dC_norm_part [rotate_blocks(d), N] (∂B_bias, ∂C_bias, ∂B_norm_w, ∂C_norm_w per block of
    ROTATE_ROWS rows), ddt_rows [M, H] (dproj's dd_dt columns: ∂dt_bias per row), dvx, dzz
    [M, H, R, P] (∂mimo_x / ∂mimo_z per row; MIMO only, SISO leaves one-element scratch there); the partials are
    to be summed over their rows. `segment` as in `mamba3_prep`."""
    op = "mamba3_prep_backward"
    d.check(op)
    M, H, R, N, P, S = d.rows, d.heads, d.rank, d.nstate, d.headdim, d.angles
    rt = proj.runtime
    expect(op, "B_norm_w", B_norm_w, (N,))
    expect(op, "C_norm_w", C_norm_w, (N,))
    for name, t in (("B_bias", B_bias), ("C_bias", C_bias)):
        expect(op, name, t, (H, R, N))
    mimo_x, mimo_z = _mimo_or_stand_in(op, d, dt_bias, mimo_x=mimo_x, mimo_z=mimo_z)
    if d.mimo:
        if dproj is not None:
            raise ShapeError(f"{op}: dproj is given for MIMO layers (it is made here; their dz comes as dzr)")
        for name, t, size in (("dzr", dzr, M * H * R * P), ("dv", dv, M * H * R * P), ("dys", dys, M * H * R * P),
                              ("D", D, H)):
            if t is None or expect(op, name, t).size != size:  # [M, H, R, P] or its rows flat
                raise ShapeError(f"{op}: MIMO needs {name} of {size} elements, got "
                                 f"{'none' if t is None else t.shape}")
        dproj = rt.empty((M, d.cols))
    else:
        if any(t is not None for t in (dzr, dv, D, dys)) or dproj is None:
            raise ShapeError(f"{op}: SISO takes dz and dx in place: give dproj (its z columns written by "
                             "mamba3_finish_backward's dz_into, its x columns by mamba3_scan_backward's dv_out) "
                             "and no dzr, dv, D or dys")
        expect(op, "dproj", dproj, (M, d.cols))
    # SISO writes no ∂mimo partials: one-element stand-ins fill those bindings
    mimo_shape = (M, H, R, P) if d.mimo else (1,)
    blocks = rotate_blocks(d)
    res = dict(dproj=dproj, dB_bias_part=rt.empty((blocks, H * R * N)), dC_bias_part=rt.empty((blocks, H * R * N)),
               dB_norm_part=rt.empty((blocks, N)), dC_norm_part=rt.empty((blocks, N)), ddt_rows=rt.empty((M, H)),
               dvx=rt.empty(mimo_shape), dzz=rt.empty(mimo_shape))
    dth = rt.empty((M, H, max(S, 1)))  # ∂loss/∂θ per step, then its reverse running sum
    splits = ROTATE_SPLITS
    # ∂ of the normalized B, C, summed over each split of a group's heads
    dBn, dCn = rt.empty((splits, M, d.rgn)), rt.empty((splits, M, d.rgn))
    params = _prep_params(d, a_floor, norm_eps)
    if d.mimo:  # SISO's x and z columns are written
        rt.run("mamba3_prep_backward", _item_grid(rt, d, R), proj=proj, mimo_x=mimo_x, mimo_z=mimo_z, D=D, dv=dv,
               dzr=dzr, dys_in=dys, dproj=dproj, dvx=res["dvx"], dzz=res["dzz"], **params)
    rotate_loops = R * (-(-H // d.groups // splits) * (ROTATE_ROWS + 1) + ROTATE_ROWS + 1)
    rotate_grid = _strided_grid(rt, d, op, blocks, rotate_loops, -(-d.groups * pair_slots(d) // 64), splits)
    rt.run("mamba3_prep_rotate_backward", rotate_grid, Bn=prep["Bn"], Cn=prep["Cn"], B_bias=B_bias, C_bias=C_bias,
           theta_in=prep["theta"], dq=dq, dk=dk, dth=dth, dBn=dBn, dCn=dCn,
           dB_bias_part=res["dB_bias_part"], dC_bias_part=res["dC_bias_part"], **params)
    norm_loops = 1 + ROTATE_ROWS * (1 + 2 * R * d.groups * (1 + splits + norm_threads(d).bit_length()))
    rt.run("mamba3_prep_norm_backward", _strided_grid(rt, d, op, blocks, norm_loops), {"NW": norm_threads(d)},
           proj=proj, B_norm_w=B_norm_w, C_norm_w=C_norm_w, dBn=dBn, dCn=dCn, dproj=dproj,
           dB_norm_part=res["dB_norm_part"], dC_norm_part=res["dC_norm_part"], **params)
    if S:
        for t0, t1 in reversed(_segments(rt, op, d, segment)):
            params.update(seg_begin=t0, seg_end=t1)
            rt.run("mamba3_prep_dtheta", _walk_grid(d), dth=dth, **params)
        params.update(seg_begin=0, seg_end=d.length)
    rt.run("mamba3_prep_reduce", _row_grid(rt, d, S + H, 1, 1 + max(H, S)), proj=proj, dt_bias=dt_bias,
           dt_in=prep["dt"], lam=prep["lam"], dcum_in=dth, ddt=ddt, dadt=dadt, dlam=dlam, dproj_out=dproj,
           ddt_rows=res["ddt_rows"], **params)
    return res


def _finish_params(d: Mamba3Dims, eps: float, zstride: int = 0, dzstride: int = 0) -> dict:
    return dict(frows=d.rows, fheads=d.heads, frank=d.rank, fheaddim=d.headdim, eps=float(eps), zstride=zstride,
                dzstride=dzstride)


def _z_stride(op: str, d: Mamba3Dims, name: str, t: Tensor) -> int:
    """Floats between rows of zr (or dz): [M, H, R, P], or SISO's z columns in place in proj / dproj [M, cols]."""
    if not d.mimo and tuple(t.shape) == (d.rows, d.cols):
        return d.cols
    expect(op, name, t, (d.rows, d.heads, d.rank, d.headdim))
    return d.heads * d.rank * d.headdim


FINISH_GROUP = 64  # mirrors FW in kernels/mamba3_prep.wgsl: the finish kernels' workgroup
FINISH_LANES = 16  # lanes per (row, head, rank) item on GPUs (the kernel's FL); CPU adapters take 1


def finish_lanes(rt, lanes: int | None = None) -> int:
    """Lanes per finish item: `lanes` if given (tests run both), else FINISH_LANES on GPUs and 1 on CPU adapters
    (`rt.info.type == "CPU"`: there a barrier and a workgroup cost more than one invocation walking P)."""
    if lanes is not None:
        if lanes < 1 or FINISH_GROUP % lanes:
            raise ShapeError(f"mamba3_finish: {lanes} lanes per item must divide {FINISH_GROUP}")
        return int(lanes)
    return 1 if is_cpu(rt) else FINISH_LANES


def finish_loops(headdim: int, lanes: int) -> int:
    """Loop iterations per invocation of mamba3_finish_forward / _backward (for Mesa llvmpipe's budget): two
    strided walks over P and up to two log2(lanes)-round sums."""
    return 2 * -(-headdim // lanes) + 2 * (lanes.bit_length() - 1)


def _skip(op: str, d: Mamba3Dims, v: Tensor | None, D: Tensor | None, stand_in: Tensor) -> tuple[Tensor, Tensor]:
    """(v, D) as the finish kernels bind them: checked when the skip D v is added here, else (D None: the scan
    added it, as SISO's SSD core does) stand-ins for bindings that are not read."""
    if D is None:
        return stand_in, stand_in
    expect(op, "D", D, (d.heads,))
    return expect(op, "v", v, (d.rows, d.heads, d.rank, d.headdim)), D


def mamba3_finish(ys: Tensor, v: Tensor | None, zr: Tensor, D: Tensor | None, norm_w: Tensor | None,
                  mimo_o: Tensor | None, d: Mamba3Dims, eps: float, lanes: int | None = None) -> tuple[Tensor, dict]:
    """ys, v, zr [M, H, R, P] -> (out [M, H·P], saved: y, rstd, o): y = ys + D v, or ys itself (not copied) with
    D None (the scan added the skip: SISO's SSD core; v is not read then). mimo_o [H, R, P] for MIMO, None for
    SISO (out is o itself there: R = 1 and mimo_o = 1); SISO's zr may be proj [M, cols] (z in place:
    mamba3_prep's). `lanes`: see `finish_lanes`."""
    op = "mamba3_finish"
    M, H, R, P = d.rows, d.heads, d.rank, d.headdim
    rt = ys.runtime
    expect(op, "ys", ys, (M, H, R, P))
    (mimo_o,) = _mimo_or_stand_in(op, d, ys, mimo_o=mimo_o)
    skip = D is not None
    v, D = _skip(op, d, v, D, ys)
    zstride = _z_stride(op, d, "zr", zr)
    lanes = finish_lanes(rt, lanes)
    loop_budget(rt, op, (M, H, R, P), finish_loops(P, lanes))
    norm = norm_w is not None
    y = rt.empty((M, H, R, P)) if skip else ys
    rstd, o = rt.empty((M, H, R)), rt.empty((M, H, R, P))
    nw = norm_w if norm else D  # an unused binding when there is no norm
    rt.run("mamba3_finish_forward", grid_1d(M * H * R * lanes, FINISH_GROUP),
           {"NORM": norm, "FL": lanes, "SKIP": skip}, ys=ys, v_in=v, zr_in=zr, D=D, norm_w=nw,
           y=y if skip else rt.empty((1,)), rstd=rstd, o=o, **_finish_params(d, eps, zstride))
    if not d.mimo:
        return o.reshape(M, H * P), dict(y=y, rstd=rstd, o=o)
    out = rt.empty((M, H * P))
    rt.run("mamba3_finish_sum", grid_1d(M * H * P), mimo_o=mimo_o, o_in=o, out=out,
           **_finish_params(d, eps, zstride))
    return out, dict(y=y, rstd=rstd, o=o)


def mamba3_finish_backward(saved: dict, v: Tensor | None, zr: Tensor, D: Tensor | None, norm_w: Tensor | None,
                           mimo_o: Tensor | None, dout: Tensor, d: Mamba3Dims, eps: float,
                           lanes: int | None = None, dz_into: Tensor | None = None) -> dict:
    """dout [M, H·P] -> dict: dys, dzr [M, H, R, P]; per-row partials dnw [M·R, H·P] (with the norm),
    dmo [M, H·R·P] (MIMO; None for SISO, whose mimo_o is None) and dD [M·R, H] (None with D None: the skip was
    the scan's, and so is ∂D), to be summed over rows. `dz_into` (SISO, with zr in proj): dproj [M, cols], whose
    z columns get dz in place; dzr is None then. `lanes`: see `finish_lanes`."""
    op = "mamba3_finish_backward"
    M, H, R, P = d.rows, d.heads, d.rank, d.headdim
    rt = dout.runtime
    (mimo_o,) = _mimo_or_stand_in(op, d, dout, mimo_o=mimo_o)
    skip = D is not None
    v, D = _skip(op, d, v, D, dout)
    zstride = _z_stride(op, d, "zr", zr)
    dzr = rt.empty((M, H, R, P)) if dz_into is None else dz_into
    dzstride = _z_stride(op, d, "dz_into", dzr)
    lanes = finish_lanes(rt, lanes)
    loop_budget(rt, op, (M, H, R, P), finish_loops(P, lanes))
    norm = norm_w is not None
    res = dict(dys=rt.empty((M, H, R, P)), dzr=dzr if dz_into is None else None,
               dmo=rt.empty((M, H * R * P)) if d.mimo else None,
               dD=rt.empty((M * R, H)) if skip else None, dnw=rt.empty((M * R, H * P)) if norm else rt.empty((1,)))
    rt.run("mamba3_finish_backward", grid_1d(M * H * R * lanes, FINISH_GROUP),
           {"NORM": norm, "MIMO": d.mimo, "FL": lanes, "SKIP": skip}, y_in=saved["y"],
           rstd_in=saved["rstd"], o_in=saved["o"], v_in=v, zr_in=zr, norm_w=norm_w if norm else D, mimo_o=mimo_o,
           dout=dout, dys=res["dys"], dzr_out=dzr, dnw_part=res["dnw"],
           dmo_part=res["dmo"] if d.mimo else rt.empty((1,)), dD_part=res["dD"] if skip else rt.empty((1,)),
           **_finish_params(d, eps, zstride, dzstride))
    return res
