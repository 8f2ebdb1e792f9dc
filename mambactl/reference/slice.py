import numpy as np


def column_slice(x, start, width):
    """x [M, P] -> x[:, start:start+width] (a strided gather, correct for every M)."""
    return x[:, start : start + width].copy()


def column_slice_backward(dy, start, total_width):
    """Scatter dy [M, W] into zeros [M, total_width] at column `start`."""
    dx = np.zeros((dy.shape[0], total_width), dy.dtype)
    dx[:, start : start + dy.shape[1]] = dy
    return dx


def column_split(x, widths, start=0):
    """x [M, P] -> [x[:, start : start + w0], the next w1 columns, ...]."""
    edges = np.cumsum([start] + list(widths))
    return [x[:, a:b].copy() for a, b in zip(edges[:-1], edges[1:])]


def column_concat(parts):
    """[M, P_i] ... -> [M, Σ P_i]."""
    return np.concatenate(parts, axis=1)
