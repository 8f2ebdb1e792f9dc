import numpy as np


def cross_entropy(logits, targets, ignore_index=-100):
    """logits [M, V], targets [M] -> mean over counted rows of logsumexp(logits) - logits[target]."""
    keep = targets != ignore_index
    m = logits.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True)))[:, 0]
    picked = logits[np.arange(len(targets)), np.where(keep, targets, 0)]
    return float(np.sum(np.where(keep, lse - picked, 0.0)) / max(int(keep.sum()), 1))


def cross_entropy_backward(logits, targets, ignore_index=-100):
    """-> dlogits [M, V] = (softmax - onehot) / count on counted rows, 0 on ignored rows."""
    keep = targets != ignore_index
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(targets))[keep], targets[keep]] -= 1.0
    p[~keep] = 0.0
    return p / max(int(keep.sum()), 1)
