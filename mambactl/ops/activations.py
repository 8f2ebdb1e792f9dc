"""Element-wise ops (kernels/activations.wgsl): silu, softplus, sigmoid, exp, add, mul and their backward."""

from __future__ import annotations

from mambactl.ops.checks import expect, grid_1d
from mambactl.runtime.tensor import Tensor


def _unary(entry: str, x: Tensor) -> Tensor:
    expect(entry, "x", x)
    y = x.runtime.empty(x.shape)
    x.runtime.run(entry, grid_1d(x.size), x=x, y=y, n=x.size)
    return y


def _unary_backward(entry: str, x: Tensor, dy: Tensor) -> Tensor:
    expect(entry, "x", x)
    expect(entry, "dy", dy, x.shape)
    dx = x.runtime.empty(x.shape)
    x.runtime.run(entry, grid_1d(x.size), x=x, dy=dy, dx=dx, n=x.size)
    return dx


def silu(x: Tensor) -> Tensor:
    return _unary("silu_forward", x)


def silu_backward(x: Tensor, dy: Tensor) -> Tensor:
    return _unary_backward("silu_backward", x, dy)


def softplus(x: Tensor) -> Tensor:
    return _unary("softplus_forward", x)


def softplus_backward(x: Tensor, dy: Tensor) -> Tensor:
    return _unary_backward("softplus_backward", x, dy)


def sigmoid(x: Tensor) -> Tensor:
    return _unary("sigmoid_forward", x)


def sigmoid_backward(x: Tensor, dy: Tensor) -> Tensor:
    return _unary_backward("sigmoid_backward", x, dy)


def exp(x: Tensor) -> Tensor:
    return _unary("exp_forward", x)


def exp_backward(x: Tensor, dy: Tensor) -> Tensor:
    return _unary_backward("exp_backward", x, dy)


def _binary(entry: str, a: Tensor, b: Tensor) -> Tensor:
    expect(entry, "a", a)
    expect(entry, "b", b, a.shape)
    y = a.runtime.empty(a.shape)
    a.runtime.run(entry, grid_1d(a.size), x=a, other=b, y=y, n=a.size)
    return y


def add(a: Tensor, b: Tensor) -> Tensor:
    return _binary("add_forward", a, b)


def mul(a: Tensor, b: Tensor) -> Tensor:
    return _binary("mul_forward", a, b)


def mul_backward(a: Tensor, b: Tensor, dy: Tensor) -> tuple[Tensor, Tensor]:
    expect("mul_backward", "a", a)
    expect("mul_backward", "b", b, a.shape)
    expect("mul_backward", "dy", dy, a.shape)
    da, db = a.runtime.empty(a.shape), a.runtime.empty(a.shape)
    a.runtime.run("mul_backward", grid_1d(a.size), x=a, other=b, dy=dy, dx=da, d_other=db, n=a.size)
    return da, db
