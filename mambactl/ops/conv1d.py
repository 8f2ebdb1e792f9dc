"""Causal depthwise conv1d with PyTorch taps (kernels/conv1d.wgsl)."""

from __future__ import annotations

from mambactl.ops.checks import expect, grid_1d
from mambactl.runtime.tensor import Tensor


def _dims(op: str, x: Tensor, w: Tensor):
    expect(op, "x", x, (None, None, None))
    B, L, C = x.shape
    expect(op, "w", w, (C, None))
    return B, L, C, w.shape[1]


def conv1d(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """x [B, L, C], w [C, K] (the [C, 1, K] weight flattened), b [C] -> y [B, L, C]."""
    B, L, C, K = _dims("conv1d", x, w)
    expect("conv1d", "b", b, (C,))
    y = x.runtime.empty(x.shape)
    x.runtime.run("conv1d_forward", grid_1d(x.size), x=x, w=w, bias=b, y=y, batch=B, len=L, channels=C, taps=K)
    return y


def conv1d_backward(x: Tensor, w: Tensor, dy: Tensor, dw: Tensor | None = None, db: Tensor | None = None):
    """-> (dx [B, L, C], dw [C, K], db [C]); pass dw and db together to accumulate into them."""
    B, L, C, K = _dims("conv1d_backward", x, w)
    expect("conv1d_backward", "dy", dy, x.shape)
    rt = x.runtime
    dx = rt.empty(x.shape)
    dims = dict(batch=B, len=L, channels=C, taps=K)
    rt.run("conv1d_backward_input", grid_1d(x.size), w=w, dy=dy, dx=dx, **dims)
    accumulate = dw is not None
    if accumulate:
        expect("conv1d_backward", "dw", dw, (C, K))
        expect("conv1d_backward", "db", db, (C,))
    else:
        dw, db = rt.empty((C, K)), rt.empty((C,))
    rt.run("conv1d_backward_weight", (-(-C // 64), K), {"ACCUMULATE": accumulate}, x=x, dy=dy, dw=dw, db=db, **dims)
    return dx, dw, db
