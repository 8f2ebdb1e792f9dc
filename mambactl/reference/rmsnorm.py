import numpy as np


def rmsnorm(x, w, eps=1e-5):
    """x [M, D], w [D] -> x / sqrt(mean(x²) + eps) · w."""
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * r * w


def add_rmsnorm(x, residual, w, eps=1e-5):
    """-> (h, rmsnorm(h, w, eps)) with h = x + residual."""
    h = x + residual
    return h, rmsnorm(h, w, eps)


def rmsnorm_backward(x, w, dy, eps=1e-5, add_to=None):
    """-> (dx [M, D], dw [D]); with add_to, dx + add_to (the gradient reaching x from another consumer)."""
    D = x.shape[-1]
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    g = dy * w
    dx = r * g - x * r**3 * np.sum(g * x, axis=-1, keepdims=True) / D
    dw = np.sum(dy * x * r, axis=tuple(range(x.ndim - 1)))
    return (dx if add_to is None else dx + add_to), dw
