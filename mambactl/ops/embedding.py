"""Embedding lookup and its scatter-add backward (kernels/embedding.wgsl)."""

from __future__ import annotations

import numpy as np

from mambactl.errors import ShapeError
from mambactl.ops.checks import U32, expect, grid_1d, segment_length
from mambactl.runtime.tensor import Tensor


def check_ids(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """Host-side validation before upload: token ids must index the table."""
    ids = np.asarray(ids)
    if ids.size == 0:
        raise ShapeError("embedding: empty token sequence")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ShapeError(f"embedding: token ids must be integers, got {ids.dtype}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ShapeError(f"embedding: token id {lo if lo < 0 else hi} outside the vocabulary [0, {vocab_size})")
    return ids.astype(np.uint32)


def embedding(ids: Tensor, table: Tensor) -> Tensor:
    """ids [T] uint32 (validated with `check_ids`), table [V, D] -> [T, D]."""
    expect("embedding", "ids", ids, (None,), U32)
    expect("embedding", "table", table, (None, None))
    T, D = ids.shape[0], table.shape[1]
    out = table.runtime.empty((T, D))
    table.runtime.run("embedding_forward", grid_1d(T * D), ids=ids, table=table, out=out, tokens=T, dim=D, unique=0,
                      seg_begin=0, seg_len=0)
    return out


class EmbeddingGradPlan:
    """The CSR of token positions grouped by id, built on the host once per batch from the ids."""

    def __init__(self, runtime, ids: np.ndarray):
        ids = np.asarray(ids, dtype=np.int64).ravel()
        order = np.argsort(ids, kind="stable")
        uniq, starts = np.unique(ids[order], return_index=True)
        self.tokens = ids.size
        self.unique = uniq.size
        self.max_count = int(np.diff(np.append(starts, ids.size)).max()) if ids.size else 0  # most repeats of an id
        self.unique_ids = runtime.from_numpy(uniq.astype(np.uint32))
        self.starts = runtime.from_numpy(np.append(starts, ids.size).astype(np.uint32))
        self.positions = runtime.from_numpy(order.astype(np.uint32))


def embedding_backward(plan: EmbeddingGradPlan, dy: Tensor, d_table: Tensor, segment: int | None = None) -> Tensor:
    """d_table [V, D] += scatter of dy [T, D] by token id (accumulates; zero it first if needed).

    `segment`: positions of one id summed per dispatch. None: all, except on Mesa llvmpipe, whose per-invocation
    loop budget (mambactl/ops/checks.py) splits a token repeated more than ~32k times over several dispatches."""
    expect("embedding_backward", "dy", dy, (plan.tokens, None))
    D = dy.shape[1]
    expect("embedding_backward", "d_table", d_table, (None, D))
    seg = segment_length(dy.runtime, "embedding_backward", tuple(dy.shape), plan.max_count, 1, 8, segment=segment)
    for s0 in range(0, max(plan.max_count, 1), seg):
        dy.runtime.run("embedding_backward", grid_1d(plan.unique * D), dy=dy, unique_ids=plan.unique_ids,
                       starts=plan.starts, positions=plan.positions, d_table=d_table, tokens=plan.tokens, dim=D,
                       unique=plan.unique, seg_begin=s0, seg_len=seg)
    return d_table
