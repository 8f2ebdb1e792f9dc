"""RMSNorm over the last dim (kernels/rmsnorm.wgsl), alone or with the residual add around it fused in
(`add_rmsnorm`; `rmsnorm_backward(add_to=...)`)."""

from __future__ import annotations

from mambactl.ops.checks import SEGMENT_BUDGET, expect, grid_1d, rows_kernel
from mambactl.ops.reduce import column_sums
from mambactl.runtime.tensor import Tensor

# Rows per backward workgroup on GPUs, whose weight-gradient terms it sums in place: [M / 8, D] partials instead
# of [M, D], and still M / 8 workgroups (1,024 at 8,192 rows).
GPU_BLOCK_ROWS = 8


def per_row(rt, D: int, rows_path: bool | None, textured: tuple = ()) -> bool:
    """One invocation per row of D (the *_rows entry points, a row's two loops of D iterations): checks.rows_kernel."""
    return rows_kernel(rt, 2 * D, rows_path, textured)


def rows_block(M: int, D: int) -> int:
    """Rows per invocation of a per-row backward: as many as leave ≥ 512 invocations and fit llvmpipe's loop
    budget at two loops of D a row."""
    return max(1, min(M // 512, SEGMENT_BUDGET // (2 * D + 1)))


def _forward(x: Tensor, residual: Tensor | None, w: Tensor, eps: float, rows_path: bool | None):
    op = "rmsnorm" if residual is None else "add_rmsnorm"
    expect(op, "x", x, (None, None))
    M, D = x.shape
    if residual is not None:
        expect(op, "residual", residual, (M, D))
    expect(op, "w", w, (D,))
    rt = x.runtime
    y, rstd = rt.empty((M, D)), rt.empty((M,))
    h = rt.empty((M, D)) if residual is not None else y  # without ADD neither is read
    add = residual is not None
    residual = x if residual is None else residual  # without ADD not read
    per_row_path = per_row(rt, D, rows_path, (x, residual, w))
    entry, grid = ("rmsnorm_forward_rows", grid_1d(M, 64)) if per_row_path else ("rmsnorm_forward", grid_1d(M, 1))
    rt.run(entry, grid, {"ADD": add}, x=x, residual=residual, h=h, w=w, y=y, rstd=rstd, x_tex=x,
           residual_tex=residual, w_tex=w, rows=M, dim=D, eps=eps, block_rows=1)
    return h, y, rstd


def rmsnorm(x: Tensor, w: Tensor, eps: float = 1e-5, rows_path: bool | None = None) -> tuple[Tensor, Tensor]:
    """x [M, D], w [D] -> (y [M, D], rstd [M]); rstd is saved for the backward. `rows_path`: see per_row."""
    _, y, rstd = _forward(x, None, w, eps, rows_path)
    return y, rstd


def add_rmsnorm(x: Tensor, residual: Tensor, w: Tensor, eps: float = 1e-5,
                rows_path: bool | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """h = x + residual, then RMSNorm of h, in one pass: -> (h, y, rstd). The backward is rmsnorm_backward of h."""
    return _forward(x, residual, w, eps, rows_path)


def rmsnorm_backward(x: Tensor, w: Tensor, rstd: Tensor, dy: Tensor, dw: Tensor | None = None,
                     rows_path: bool | None = None, add_to: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """-> (dx [M, D], dw [D]); pass `dw` to accumulate into it, `add_to` [M, D] to get dx + add_to (the residual
    stream's gradient from its other consumer, fused). `rows_path`: see per_row."""
    expect("rmsnorm_backward", "x", x, (None, None))
    M, D = x.shape
    expect("rmsnorm_backward", "w", w, (D,))
    expect("rmsnorm_backward", "rstd", rstd, (M,))
    expect("rmsnorm_backward", "dy", dy, (M, D))
    if add_to is not None:
        expect("rmsnorm_backward", "add_to", add_to, (M, D))
    if dw is not None:
        expect("rmsnorm_backward", "dw", dw, (D,))
    rt = x.runtime
    add = add_to is not None
    add_to = dy if add_to is None else add_to  # without ADD not read
    per_row_path = per_row(rt, D, rows_path, (x, w, dy, add_to))
    block = rows_block(M, D) if per_row_path else GPU_BLOCK_ROWS
    blocks = -(-M // block)
    dx, dw_part = rt.empty((M, D)), rt.empty((blocks, D))
    entry, grid = ("rmsnorm_backward_rows", grid_1d(blocks, 64)) if per_row_path else ("rmsnorm_backward", grid_1d(blocks, 1))
    rt.run(entry, grid, {"ADD": add}, x=x, w=w, rstd_in=rstd, dy=dy, dx=dx, dw_part=dw_part, add_to=add_to, x_tex=x,
           w_tex=w, dy_tex=dy, add_to_tex=add_to, rows=M, dim=D, eps=0.0, block_rows=block)
    return dx, column_sums(dw_part, dw)
