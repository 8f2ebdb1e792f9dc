"""Argument checks shared by every op wrapper: raise ShapeError naming the op and tensor before dispatch."""

from __future__ import annotations

import numpy as np

from mambactl.errors import ShapeError
from mambactl.runtime.gpu import grid_1d  # noqa: F401  (re-exported for the op wrappers)
from mambactl.runtime.tensor import Tensor

F32, I32, U32 = np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.uint32)


def expect(op: str, name: str, t, shape=None, dtype=F32) -> Tensor:
    """`shape` may contain None for "any size here"."""
    if not isinstance(t, Tensor):
        raise ShapeError(f"{op}: {name} must be a GPU Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        raise ShapeError(f"{op}: {name} has dtype {t.dtype.name}, expected {np.dtype(dtype if not isinstance(dtype, tuple) else dtype[0]).name}")
    if shape is not None:
        ok = len(shape) == t.ndim and all(s is None or s == d for s, d in zip(shape, t.shape))
        if not ok:
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise ShapeError(f"{op}: {name} has shape {t.shape}, expected {want}")
    return t
