import numpy as np


def rmsnorm(x, w, eps=1e-5):
    """x [M, D], w [D] -> x / sqrt(mean(x²) + eps) · w."""
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * r * w


def rmsnorm_backward(x, w, dy, eps=1e-5):
    """-> (dx [M, D], dw [D])."""
    D = x.shape[-1]
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    g = dy * w
    dx = r * g - x * r**3 * np.sum(g * x, axis=-1, keepdims=True) / D
    dw = np.sum(dy * x * r, axis=tuple(range(x.ndim - 1)))
    return dx, dw
