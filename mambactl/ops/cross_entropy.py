"""Fused softmax cross-entropy with an ignore index, mean over counted rows (kernels/cross_entropy.wgsl)."""

from __future__ import annotations

import numpy as np

from mambactl.ops.checks import I32, expect, grid_1d, rows_kernel
from mambactl.ops.reduce import reduce_sum
from mambactl.runtime.tensor import Tensor

IGNORE_INDEX = -100


def _per_row(rt, logits: Tensor, rows_path: bool | None) -> bool:
    """One invocation per row (the *_rows entry points: a loop of V iterations, the logits read through a
    texture): checks.rows_kernel."""
    return rows_kernel(rt, logits.shape[1], rows_path, (logits,))


def cross_entropy(logits: Tensor, targets: Tensor, count: int, ignore_index: int = IGNORE_INDEX,
                  rows_path: bool | None = None):
    """logits [M, V], targets [M] int32, count = number of rows whose target != ignore_index (known on
    the host from the batch). -> (loss [1] = mean CE over counted rows, lse [M] saved for the backward).
    `rows_path` forces the one-invocation-per-row forward (True) or the workgroup-per-row one (False); None:
    per row on CPU adapters."""
    expect("cross_entropy", "logits", logits, (None, None))
    M, V = logits.shape
    expect("cross_entropy", "targets", targets, (M,), I32)
    rt = logits.runtime
    lse, loss_rows = rt.empty((M,)), rt.empty((M,))
    per_row = _per_row(rt, logits, rows_path)
    entry, groups = ("cross_entropy_forward_rows", grid_1d(M, 64)) if per_row else ("cross_entropy_forward", grid_1d(M, 1))
    rt.run(entry, groups, logits=logits, logits_tex=logits, targets=targets, lse=lse, loss=loss_rows,
           rows=M, vocab=V, ignore_index=ignore_index, scale=0.0)
    loss = reduce_sum(loss_rows, scale=1.0 / max(count, 1))
    return loss, lse


def cross_entropy_backward(logits: Tensor, targets: Tensor, lse: Tensor, count: int,
                           ignore_index: int = IGNORE_INDEX, rows_path: bool | None = None) -> Tensor:
    """-> dlogits [M, V] = (softmax − onehot) / count on counted rows, 0 on ignored rows. `rows_path` as in
    `cross_entropy`."""
    M, V = logits.shape
    expect("cross_entropy_backward", "targets", targets, (M,), I32)
    expect("cross_entropy_backward", "lse", lse, (M,))
    rt = logits.runtime
    dlogits = rt.empty((M, V))
    per_row = _per_row(rt, logits, rows_path)
    params = dict(targets=targets, lse_in=lse, rows=M, vocab=V, ignore_index=ignore_index, scale=1.0 / max(count, 1))
    if per_row:
        rt.run("cross_entropy_backward_rows", grid_1d(M, 64), logits_tex=logits, dlogits=dlogits, **params)
    elif V % 4 == 0:  # a row of 4k logits is a whole number of vec4s
        rt.run("cross_entropy_backward_vec4", grid_1d(M * V // 4), logits4=logits, dlogits4=dlogits, **params)
    else:
        rt.run("cross_entropy_backward", grid_1d(M * V), logits=logits, dlogits=dlogits, **params)
    return dlogits


def count_targets(targets: np.ndarray, ignore_index: int = IGNORE_INDEX) -> int:
    return int(np.count_nonzero(np.asarray(targets) != ignore_index))
