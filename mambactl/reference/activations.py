"""Element-wise functions and their derivatives; softplus has PyTorch's threshold-20 semantics."""

import numpy as np


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def sigmoid_backward(x, dy):
    s = sigmoid(x)
    return dy * s * (1.0 - s)


def silu(x):
    return x * sigmoid(x)


def silu_backward(x, dy):
    s = sigmoid(x)
    return dy * s * (1.0 + x * (1.0 - s))


def softplus(x):
    """PyTorch: x above threshold 20, else log1p(exp(x))."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def softplus_backward(x, dy):
    return dy * np.where(x > 20.0, 1.0, sigmoid(x))


def exp(x):
    return np.exp(x)


def exp_backward(x, dy):
    return dy * np.exp(x)


def add(a, b):
    return a + b


def mul(a, b):
    return a * b


def mul_backward(a, b, dy):
    return dy * b, dy * a
