"""Race-free two-pass reductions (kernels/reduce.wgsl): sums and sums of squares."""

from __future__ import annotations

import math

from mambactl.ops.checks import cpu_subgroups, expect, is_cpu, require_subgroup_lanes
from mambactl.runtime.arena import spans
from mambactl.runtime.tensor import Tensor

_MAX_PARTIALS = 1024  # workgroups per tensor in pass 1; each walks the tensor with a grid stride
_MAX_GROUPS = 65535  # one dispatch dimension


def _partial_groups(n: int, subgroup: bool) -> int:
    """Workgroups (= partials) for n elements: ≤ 1024 elements each. The tree kernel caps them at
    _MAX_PARTIALS (256 threads each: 262k threads keep enough loads in flight for a 129M-element gradient
    arena on a large GPU); the subgroup kernel's 8 lanes take 128 each, up to one dispatch
    dimension of workgroups (so each lane walks ≤ n / 524,280 elements, far inside llvmpipe's loop budget for
    any tensor a buffer holds)."""
    return max(1, min(_MAX_GROUPS if subgroup else _MAX_PARTIALS, -(-n // 1024)))


def _reduce(tensors: list[Tensor], square: bool, scale: float, subgroup: bool | None) -> Tensor:
    rt = tensors[0].runtime
    # CPU adapters with 8-lane subgroups (Mesa lavapipe): the barrier-free pass 1 (kernels/reduce.wgsl says why)
    if subgroup is None:
        subgroup = cpu_subgroups(rt)
    elif subgroup:
        require_subgroup_lanes(rt, "reduce: the subgroup pass")
    entry = "reduce_partial_subgroup" if subgroup else "reduce_partial"
    groups = [_partial_groups(t.size, subgroup) for t in tensors]
    partials = rt.empty((sum(groups),))
    offset = 0
    for t, g in zip(tensors, groups):
        expect("reduce", "x", t)
        rt.run(entry, (g,), {"SQUARE": square}, x=t, partials=partials, n=t.size, offset=offset,
               out_index=0, scale=1.0)
        offset += g
    out = rt.empty((1,))
    rt.run("reduce_final", (1,), partials_in=partials, out=out, n=offset, offset=0, out_index=0, scale=scale)
    return out


def reduce_sum(x: Tensor, scale: float = 1.0, subgroup: bool | None = None) -> Tensor:
    """-> [1] = scale · Σ x. `subgroup` forces either first pass (tests; None: by the adapter)."""
    return _reduce([x], False, scale, subgroup)


def sum_of_squares(tensors: list[Tensor], subgroup: bool | None = None) -> Tensor:
    """-> [1] = Σ over all tensors of Σ x² (the squared global gradient norm), in a fixed order. `subgroup` as
    in reduce_sum. Consecutive views of an Arena (models/lm.py's gradients) are one pass-1 dispatch: the zero gaps
    between them add nothing."""
    tensors = [expect("sum_of_squares", "x", t) for t in tensors]
    return _reduce([span for _, (span,) in spans(tensors)], True, 1.0, subgroup)


_ONE_PASS_ROWS = 32  # up to this many rows one thread per column sums them all


def column_sums(x: Tensor, out: Tensor | None = None) -> Tensor:
    """x [R, n] -> [n] = Σ_r x[r, :] (added into `out` when given). Two passes over blocks of ⌈√R⌉ rows (one pass
    for R ≤ 32), so a tall matrix (a gradient summed over B·L rows) keeps the GPU busy, neither pass walks more than
    ⌈√R⌉ rows per thread, and the order of summation is fixed."""
    expect("column_sums", "x", x, (None, None))
    R, n = x.shape
    rt = x.runtime
    accumulate = out is not None
    if accumulate:
        expect("column_sums", "out", out, (n,))
    else:
        out = rt.empty((n,))
    if R > _ONE_PASS_ROWS:
        block = math.isqrt(R - 1) + 1
        blocks = -(-R // block)
        partial = rt.empty((blocks, n))
        _column_sums_pass(x, partial, block, blocks, False)
        x, R = partial, blocks
    _column_sums_pass(x, out, R, 1, accumulate)
    return out


def _column_sums_pass(x: Tensor, sums: Tensor, block_rows: int, blocks: int, accumulate: bool) -> None:
    """One pass: sums [blocks, n] (+)= the column sums of x [R, n] over blocks of `block_rows` rows. CPU adapters
    read x through a texture (column_sums_texels) where n is a multiple of 4 and x fits one."""
    rt = x.runtime
    R, n = x.shape
    if is_cpu(rt) and n % 4 == 0 and rt.fits_texture(x):
        rt.run("column_sums_texels", (-(-n // 256), blocks), {"ACCUMULATE": accumulate}, matrix_tex=x, sums4=sums,
               rows=R, cols=n, block_rows=block_rows)
        return
    rt.run("column_sums", (-(-n // 64), blocks), {"ACCUMULATE": accumulate}, matrix=x, sums=sums, rows=R, cols=n,
           block_rows=block_rows)
