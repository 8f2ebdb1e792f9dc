"""A GPU tensor: a pooled storage buffer plus a shape and a dtype (float32, int32 or uint32), row-major.

A view may start at a byte offset into its owner's buffer (`Tensor.view`; kernels bind it there); the tensors of
an `Arena` (runtime/arena.py) are such views of one buffer, so one dispatch can cover all of them."""

from __future__ import annotations

import math

import numpy as np

DTYPES = (np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.uint32))


class Tensor:
    __slots__ = ("runtime", "buffer", "shape", "dtype", "size", "offset", "_owner", "arena_chunk")

    def __init__(self, runtime, buffer, shape, dtype, owner: "Tensor | None" = None, offset: int = 0):
        self.runtime = runtime
        self.buffer = buffer
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.size = math.prod(self.shape)  # elements; read for every binding of every dispatch, so kept
        self.offset = int(offset)  # bytes from the buffer's start (a multiple of the storage offset alignment)
        self._owner = owner  # a view keeps its owner alive; only owners return buffers to the pool
        # set on an Arena's buffers (runtime/arena.py): their number in the Arena, whose views are ordered by it;
        # the bytes between an Arena's views are zero
        self.arena_chunk: int | None = None

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
        return Tensor(self.runtime, self.buffer, shape, self.dtype, owner=self._owner or self, offset=self.offset)

    def view(self, start: int, shape) -> "Tensor":
        """A view of `shape` starting `start` elements into this tensor (nothing is copied). Kernels bind it at
        its byte offset, so (offset + 4·start) must be a multiple of the device's storage offset alignment."""
        shape = tuple(int(s) for s in shape)
        if start < 0 or start + math.prod(shape) > self.size:
            raise ValueError(f"view of {shape} at element {start} outside a tensor of {self.size} elements")
        return Tensor(self.runtime, self.buffer, shape, self.dtype, owner=self._owner or self,
                      offset=self.offset + 4 * int(start))

    def __repr__(self) -> str:
        return f"Tensor(shape={self.shape}, dtype={self.dtype.name})"

    def __del__(self):
        if self._owner is None and self.buffer is not None:
            self.runtime.pool.release(self.buffer)
