"""Fill a tensor on the GPU (kernels/fill.wgsl): zeroing gradient accumulators without a host write."""

from __future__ import annotations

from mambactl.ops.checks import expect, grid_1d
from mambactl.runtime.tensor import Tensor


def fill(t: Tensor, value: float) -> Tensor:
    """Every element of t = value; zero is a buffer clear (`Runtime.clear`), any other value the fill kernel."""
    expect("fill", "t", t)
    if value == 0.0:
        t.runtime.clear(t)
    else:
        t.runtime.run("fill", grid_1d(t.size), dst=t, n=t.size, value=float(value))
    return t


def zeros(runtime, shape) -> Tensor:
    return fill(runtime.empty(shape), 0.0)
