"""Mamba-2's gated, grouped RMSNorm: out = RMSNorm_group(y · silu(z)) · w (kernels/rmsnorm_gated.wgsl).

mamba_ssm's RMSNormGated with norm_before_gate=False and group_size = d_inner / ngroups (HF MambaRMSNormGated).
"""

from __future__ import annotations

from mambactl.errors import ShapeError
from mambactl.ops.checks import expect, grid_1d
from mambactl.runtime.tensor import Tensor

_SLICE_ROWS = 256  # rows per partial sum of the weight gradient


def _check(op: str, y: Tensor, z: Tensor, w: Tensor, group_size: int) -> tuple[int, int]:
    expect(op, "y", y, (None, None))
    M, D = y.shape
    expect(op, "z", z, (M, D))
    expect(op, "w", w, (D,))
    if group_size < 1 or D % group_size:
        raise ShapeError(f"{op}: group_size {group_size} must divide the {D} channels")
    return M, D


def rmsnorm_gated(y: Tensor, z: Tensor, w: Tensor, group_size: int, eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    """y, z [M, D], w [D] -> (out [M, D], rstd [M, D / group_size]); rstd is saved for the backward."""
    M, D = _check("rmsnorm_gated", y, z, w, group_size)
    rt = y.runtime
    out, rstd = rt.empty((M, D)), rt.empty((M, D // group_size))
    rt.run("rmsnorm_gated_forward", grid_1d(M * (D // group_size), 1), y=y, z=z, w=w, out=out, rstd=rstd,
           rows=M, dim=D, group=group_size, slice_rows=0, slices=0, eps=eps)
    return out, rstd


def rmsnorm_gated_backward(y: Tensor, z: Tensor, w: Tensor, rstd: Tensor, group_size: int, dout: Tensor,
                           dw: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """-> (dy [M, D], dz [M, D], dw [D]); pass `dw` to accumulate into it."""
    op = "rmsnorm_gated_backward"
    M, D = _check(op, y, z, w, group_size)
    expect(op, "rstd", rstd, (M, D // group_size))
    expect(op, "dout", dout, (M, D))
    rt = y.runtime
    slices = -(-M // _SLICE_ROWS)
    dims = dict(rows=M, dim=D, group=group_size, slice_rows=_SLICE_ROWS, slices=slices, eps=0.0)
    dy, dz = rt.empty((M, D)), rt.empty((M, D))
    rt.run("rmsnorm_gated_backward", grid_1d(M * (D // group_size), 1), y=y, z=z, w=w, dout=dout, rstd_in=rstd,
           dy=dy, dz=dz, **dims)
    accumulate = dw is not None
    if accumulate:
        expect(op, "dw", dw, (D,))
    else:
        dw = rt.empty((D,))
    dw_part = rt.empty((slices, D))
    rt.run("rmsnorm_gated_weight_partial", (-(-D // 64), slices), y=y, z=z, dout=dout, rstd_in=rstd,
           dw_part=dw_part, **dims)
    rt.run("rmsnorm_gated_weight_sum", (-(-D // 64),), {"ACCUMULATE": accumulate}, dw_part_in=dw_part, dw=dw,
           **dims)
    return dy, dz, dw
