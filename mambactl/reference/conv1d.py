import numpy as np

from mambactl.reference.activations import silu, silu_backward


def conv1d(x, w, b=None):
    """Causal depthwise conv, PyTorch taps: x [B, L, C], w [C, 1, K] (or [C, K]), b [C] -> [B, L, C].

    y[b, t, c] = Σ_k w[c, k] · x[b, t - K + 1 + k, c] (+ b[c]); inputs before t = 0 are zero.
    """
    w = w.reshape(w.shape[0], -1)
    K = w.shape[1]
    L = x.shape[1]
    xp = np.concatenate([np.zeros((x.shape[0], K - 1, x.shape[2]), x.dtype), x], axis=1)
    y = sum(w[:, k] * xp[:, k : k + L, :] for k in range(K))
    return y if b is None else y + b


def conv1d_backward(x, w, dy):
    """-> (dx [B, L, C], dw [C, K], db [C])."""
    w2 = w.reshape(w.shape[0], -1)
    K = w2.shape[1]
    L = x.shape[1]
    xp = np.concatenate([np.zeros((x.shape[0], K - 1, x.shape[2]), x.dtype), x], axis=1)
    dxp = np.zeros_like(xp)
    dw = np.zeros_like(w2)
    for k in range(K):
        dxp[:, k : k + L, :] += w2[:, k] * dy
        dw[:, k] = np.sum(dy * xp[:, k : k + L, :], axis=(0, 1))
    return dxp[:, K - 1 :, :], dw.reshape(w.shape), dy.sum(axis=(0, 1))


def conv1d_silu(x, w, b=None):
    """-> SiLU(conv1d(x, w, b))."""
    return silu(conv1d(x, w, b))


def conv1d_silu_backward(x, w, b, dact, dact2=None):
    """Backward of act = SiLU(y), y = conv1d(x, w, b), whose gradient is dact (+ dact2 where act has a second
    consumer) -> (dx, dw, db) as conv1d_backward."""
    return conv1d_backward(x, w, silu_backward(conv1d(x, w, b), dact if dact2 is None else dact + dact2))
