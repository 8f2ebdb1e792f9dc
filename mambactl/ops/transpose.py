"""Transpose a matrix on the GPU (kernels/transpose.wgsl): ops/linear.py's large forwards read Wᵀ."""

from __future__ import annotations

from mambactl.errors import ShapeError
from mambactl.ops.checks import expect
from mambactl.runtime.tensor import Tensor

TILE = 32  # mirrors TILE in kernels/transpose.wgsl


def transpose(x: Tensor) -> Tensor:
    """x [R, C] -> [C, R], a new tensor."""
    expect("transpose", "x", x, (None, None))
    rows, cols = x.shape
    if min(rows, cols) < 1:
        raise ShapeError(f"transpose: empty matrix {x.shape}")
    out = x.runtime.empty((cols, rows))
    x.runtime.run("transpose", (-(-cols // TILE), -(-rows // TILE)), src=x, dst=out, rows=rows, cols=cols)
    return out
