"""Column slice / scatter / concat of row-major matrices (kernels/slice.wgsl)."""

from __future__ import annotations

from mambactl.errors import ShapeError
from mambactl.ops.checks import expect, grid_1d
from mambactl.ops.fill import zeros
from mambactl.runtime.tensor import Tensor


def column_slice(x: Tensor, start: int, width: int) -> Tensor:
    """x [M, P] -> x[:, start:start+width] as a new [M, width] tensor."""
    expect("column_slice", "x", x, (None, None))
    M, P = x.shape
    if start < 0 or width < 1 or start + width > P:
        raise ShapeError(f"column_slice: columns [{start}, {start + width}) outside a matrix of {P} columns")
    out = x.runtime.empty((M, width))
    x.runtime.run("column_slice", grid_1d(M * width), src=x, dst=out, rows=M, src_cols=P, dst_cols=width,
                  start=start, width=width)
    return out


def column_scatter(src: Tensor, dst: Tensor, start: int, accumulate: bool = False) -> Tensor:
    """dst[:, start:start+W] = src [M, W] (or += with accumulate). Returns dst."""
    expect("column_scatter", "src", src, (None, None))
    M, W = src.shape
    expect("column_scatter", "dst", dst, (M, None))
    if start < 0 or start + W > dst.shape[1]:
        raise ShapeError(f"column_scatter: columns [{start}, {start + W}) outside a matrix of {dst.shape[1]} columns")
    src.runtime.run("column_scatter", grid_1d(M * W), {"ACCUMULATE": accumulate}, src=src, dst=dst, rows=M,
                    src_cols=W, dst_cols=dst.shape[1], start=start, width=W)
    return dst


def column_slice_backward(dy: Tensor, start: int, total_width: int, dx: Tensor | None = None) -> Tensor:
    """Gradient of column_slice: dy [M, W] lands in columns [start, start+W) of dx [M, total_width].
    Without `dx` a zeroed matrix is made; with it, dy is added in place."""
    if dx is None:
        dx = zeros(dy.runtime, (dy.shape[0], total_width))
    return column_scatter(dy, dx, start, accumulate=True)


def column_concat(parts: list[Tensor]) -> Tensor:
    """[M, P_i]... -> [M, Σ P_i]; every column is written once."""
    M = parts[0].shape[0]
    out = parts[0].runtime.empty((M, sum(p.shape[1] for p in parts)))
    start = 0
    for p in parts:
        column_scatter(p, out, start)
        start += p.shape[1]
    return out
