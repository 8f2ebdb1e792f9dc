"""A pool of GPU storage buffers, reused by size so a training step allocates nothing after the first."""

from __future__ import annotations

import heapq
import itertools
from collections import defaultdict

import wgpu

STORAGE_USAGE = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST


def rounded_size(nbytes: int) -> int:
    """Pool buckets are 256-byte multiples (and never 0: wgpu forbids empty bindings)."""
    return max(256, -(-nbytes // 256) * 256)


class BufferPool:
    """Free buffers by size. `acquire` takes the oldest free buffer of a size, so a step that allocates and
    frees the same sizes at the same points binds the same buffers every time, whatever order Python freed
    them in (the runtime's bind-group cache hits)."""

    def __init__(self, device):
        self.device = device
        self.free: dict[int, list] = defaultdict(list)  # size -> heap of (serial, buffer)
        self.serial: dict[int, int] = {}  # id(buffer) -> creation order
        # Every buffer made, so none is ever finalized while the pool lives: a tensor caught in a reference cycle
        # (an exception's traceback) is collected together with its buffer, in no set order, and wgpu releasing the
        # buffer before the tensor gives it back would leave a dead buffer in the free lists.
        self.owned: list = []
        self._next = itertools.count()
        self.allocated_bytes = 0

    def acquire(self, nbytes: int):
        size = rounded_size(nbytes)
        bucket = self.free[size]
        if bucket:
            return heapq.heappop(bucket)[1]
        self.allocated_bytes += size
        buffer = self.device.create_buffer(size=size, usage=STORAGE_USAGE)
        self.serial[id(buffer)] = next(self._next)
        self.owned.append(buffer)
        return buffer

    def release(self, buffer) -> None:
        heapq.heappush(self.free[buffer.size], (self.serial[id(buffer)], buffer))
