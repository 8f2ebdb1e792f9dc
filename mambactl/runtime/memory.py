"""A pool of GPU storage buffers, reused by size so a training step allocates nothing after the first."""

from __future__ import annotations

from collections import defaultdict

import wgpu

STORAGE_USAGE = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST


def rounded_size(nbytes: int) -> int:
    """Pool buckets are 256-byte multiples (and never 0: wgpu forbids empty bindings)."""
    return max(256, -(-nbytes // 256) * 256)


class BufferPool:
    def __init__(self, device):
        self.device = device
        self.free: dict[int, list] = defaultdict(list)
        self.allocated_bytes = 0

    def acquire(self, nbytes: int):
        size = rounded_size(nbytes)
        bucket = self.free[size]
        if bucket:
            return bucket.pop()
        self.allocated_bytes += size
        return self.device.create_buffer(size=size, usage=STORAGE_USAGE)

    def release(self, buffer) -> None:
        self.free[buffer.size].append(buffer)

    def trim(self) -> None:
        """Drop every idle buffer (e.g. between runs of different shapes)."""
        for bucket in self.free.values():
            for buf in bucket:
                self.allocated_bytes -= buf.size
                buf.destroy()
        self.free.clear()
