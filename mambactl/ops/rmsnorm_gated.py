"""Mamba-2's gated, grouped RMSNorm: out = RMSNorm_group(y · silu(z)) · w (kernels/rmsnorm_gated.wgsl).

mamba_ssm's RMSNormGated with norm_before_gate=False and group_size = d_inner / ngroups (HF MambaRMSNormGated).
z may be read from columns [z_start, z_start + D) of a wider matrix (Mamba-2's in_proj output) and dz written into
columns of another (`dz_out`, the combined in_proj gradient), so the model makes no copy of either.
"""

from __future__ import annotations

from mambactl.errors import ShapeError
from mambactl.ops.checks import expect, expect_columns, grid_1d
from mambactl.ops.reduce import column_sums
from mambactl.ops.rmsnorm import per_row, rows_block
from mambactl.runtime.tensor import Tensor

GPU_BLOCK_ROWS = 8  # rows per backward workgroup: [M / 8, D] weight-gradient partials, M / 8 · groups workgroups


def _check(op: str, y: Tensor, z: Tensor, w: Tensor, group_size: int, z_start: int) -> tuple[int, int, int]:
    expect(op, "y", y, (None, None))
    M, D = y.shape
    expect(op, "z", z, (M, None))
    if z_start < 0 or z_start + D > z.shape[1]:
        raise ShapeError(f"{op}: z columns [{z_start}, {z_start + D}) outside its {z.shape[1]} columns (y has {D})")
    expect(op, "w", w, (D,))
    if group_size < 1 or D % group_size:
        raise ShapeError(f"{op}: group_size {group_size} must divide the {D} channels")
    return M, D, z.shape[1]


def rmsnorm_gated(y: Tensor, z: Tensor, w: Tensor, group_size: int, eps: float = 1e-5, *,
                  z_start: int = 0, rows_path: bool | None = None) -> tuple[Tensor, Tensor]:
    """y [M, D], z [M, P] (its columns z_start..z_start + D), w [D] -> (out [M, D], rstd [M, D / group_size]);
    rstd is saved for the backward. `rows_path`: one invocation per (row, group) (CPU adapters; ops.rmsnorm.per_row)."""
    M, D, P = _check("rmsnorm_gated", y, z, w, group_size, z_start)
    rt = y.runtime
    out, rstd = rt.empty((M, D)), rt.empty((M, D // group_size))
    items = M * (D // group_size)
    entry, grid = (("rmsnorm_gated_forward_rows", grid_1d(items, 64)) if per_row(rt, group_size, rows_path)
                   else ("rmsnorm_gated_forward", grid_1d(items, 1)))
    rt.run(entry, grid, y=y, z=z, w=w, out=out, rstd=rstd,
           rows=M, dim=D, group=group_size, block_rows=1, eps=eps, z_stride=P, z_col=z_start, dz_stride=D, dz_col=0)
    return out, rstd


def rmsnorm_gated_backward(y: Tensor, z: Tensor, w: Tensor, rstd: Tensor, group_size: int, dout: Tensor,
                           dw: Tensor | None = None, *, z_start: int = 0,
                           dz_out: tuple[Tensor, int] | None = None,
                           rows_path: bool | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """-> (dy [M, D], dz, dw [D]); pass `dw` to accumulate into it. dz is [M, D], or with `dz_out` = (matrix
    [M, Q], start) written into its columns [start, start + D) and that matrix returned. `rows_path`: as the
    forward's."""
    op = "rmsnorm_gated_backward"
    M, D, P = _check(op, y, z, w, group_size, z_start)
    expect(op, "rstd", rstd, (M, D // group_size))
    expect(op, "dout", dout, (M, D))
    if dw is not None:
        expect(op, "dw", dw, (D,))
    rt = y.runtime
    if dz_out is None:
        dz, dz_col = rt.empty((M, D)), 0
    else:
        dz, dz_col = dz_out
        expect(op, "dz_out", dz, (M, None))
        expect_columns(op, "dz_out", dz, dz_col, D)
    per_row_path = per_row(rt, group_size, rows_path)
    block = rows_block(M, group_size) if per_row_path else GPU_BLOCK_ROWS
    blocks = -(-M // block)
    dy, dw_part = rt.empty((M, D)), rt.empty((blocks, D))
    items = blocks * (D // group_size)
    entry, grid = (("rmsnorm_gated_backward_rows", grid_1d(items, 64)) if per_row_path
                   else ("rmsnorm_gated_backward", grid_1d(items, 1)))
    rt.run(entry, grid, y=y, z=z, w=w, dout=dout, rstd_in=rstd,
           dy=dy, dz=dz, dw_part=dw_part, rows=M, dim=D, group=group_size, block_rows=block, eps=0.0,
           z_stride=P, z_col=z_start, dz_stride=dz.shape[1], dz_col=dz_col)
    return dy, dz, column_sums(dw_part, dw)
