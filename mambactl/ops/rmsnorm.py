"""RMSNorm over the last dim (kernels/rmsnorm.wgsl)."""

from __future__ import annotations

from mambactl.ops.checks import SEGMENT_BUDGET, expect, grid_1d, is_cpu
from mambactl.ops.reduce import column_sums
from mambactl.runtime.tensor import Tensor


def _per_row(rt, D: int, rows_path: bool | None) -> bool:
    """One invocation per row (the *_rows entry points): on CPU adapters, while a row's two loops of D
    iterations stay within llvmpipe's loop budget; `rows_path` forces either."""
    return is_cpu(rt) and 2 * D <= SEGMENT_BUDGET if rows_path is None else rows_path


def _grid(rt, entry: str, M: int, per_row: bool):
    return (entry + "_rows", grid_1d(M, 64)) if per_row else (entry, grid_1d(M, 1))


def rmsnorm(x: Tensor, w: Tensor, eps: float = 1e-5, rows_path: bool | None = None) -> tuple[Tensor, Tensor]:
    """x [M, D], w [D] -> (y [M, D], rstd [M]); rstd is saved for the backward. `rows_path`: see _per_row."""
    expect("rmsnorm", "x", x, (None, None))
    M, D = x.shape
    expect("rmsnorm", "w", w, (D,))
    rt = x.runtime
    y, rstd = rt.empty((M, D)), rt.empty((M,))
    rt.run(*_grid(rt, "rmsnorm_forward", M, _per_row(rt, D, rows_path)), x=x, w=w, y=y, rstd=rstd, rows=M, dim=D,
           eps=eps)
    return y, rstd


def rmsnorm_backward(x: Tensor, w: Tensor, rstd: Tensor, dy: Tensor, dw: Tensor | None = None,
                     rows_path: bool | None = None) -> tuple[Tensor, Tensor]:
    """-> (dx [M, D], dw [D]); pass `dw` to accumulate into it. `rows_path`: see _per_row."""
    expect("rmsnorm_backward", "x", x, (None, None))
    M, D = x.shape
    expect("rmsnorm_backward", "w", w, (D,))
    expect("rmsnorm_backward", "rstd", rstd, (M,))
    expect("rmsnorm_backward", "dy", dy, (M, D))
    if dw is not None:
        expect("rmsnorm_backward", "dw", dw, (D,))
    rt = x.runtime
    dx, dw_rows = rt.empty((M, D)), rt.empty((M, D))
    rt.run(*_grid(rt, "rmsnorm_backward", M, _per_row(rt, D, rows_path)), x=x, w=w, rstd_in=rstd, dy=dy, dx=dx,
           dw_rows=dw_rows, rows=M, dim=D, eps=0.0)
    return dx, column_sums(dw_rows, dw)
