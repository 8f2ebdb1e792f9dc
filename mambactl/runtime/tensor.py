"""A GPU tensor: a pooled storage buffer plus a shape and a dtype (float32, int32 or uint32), row-major."""

from __future__ import annotations

import math

import numpy as np

DTYPES = (np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.uint32))


class Tensor:
    __slots__ = ("runtime", "buffer", "shape", "dtype", "size", "_owner")

    def __init__(self, runtime, buffer, shape, dtype, owner: "Tensor | None" = None):
        self.runtime = runtime
        self.buffer = buffer
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.size = math.prod(self.shape)  # elements; read for every binding of every dispatch, so kept
        self._owner = owner  # a view keeps its owner alive; only owners return buffers to the pool

    @property
    def nbytes(self) -> int:
        return self.size * 4

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numpy(self) -> np.ndarray:
        """Copy back to the host (flushes pending GPU work first)."""
        return self.runtime.read(self)

    def reshape(self, *shape) -> "Tensor":
        """A view with another shape over the same buffer (nothing is copied)."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            shape = tuple(self.size // known if s == -1 else s for s in shape)
        if math.prod(shape) != self.size:
            raise ValueError(f"cannot reshape {self.shape} to {shape}")
        return Tensor(self.runtime, self.buffer, shape, self.dtype, owner=self._owner or self)

    def __repr__(self) -> str:
        return f"Tensor(shape={self.shape}, dtype={self.dtype.name})"

    def __del__(self):
        if self._owner is None and self.buffer is not None:
            self.runtime.pool.release(self.buffer)
