"""Many tensors as views of a few large buffers, so one dispatch covers all of them.

A training step touches every parameter tensor four times outside the layers (zero its gradient, add its square
into the global norm, update it with its moments); with 200+ tensors that was 200+ tiny dispatches each. An
`Arena` lays the tensors out in one buffer (more only where the device's storage binding limit is smaller than
the total), each starting on an ALIGN-byte boundary so kernels can bind it at its offset, with the gaps between
them zero. `spans` then merges consecutive views into views covering them and their gaps: fill, Σx² and the AdamW
update keep zero gaps zero (and add nothing for them), so one dispatch per span is exact.
"""

from __future__ import annotations

import math

from mambactl.runtime.gpu import grid_1d
from mambactl.runtime.tensor import Tensor

ALIGN = 256  # bytes: WebGPU's largest allowed minStorageBufferOffsetAlignment, and vec4-aligned
SLOT = ALIGN // 4  # elements: every view starts on a slot and owns whole slots


class Arena:
    """Zeroed float32 tensors of `shapes`, in that order, as views of `chunks` (flat owner tensors within the
    device's buffer and binding limits). `tensors[i]` has `shapes[i]`."""

    def __init__(self, runtime, shapes):
        limit = min(int(runtime.limits["max-buffer-size"]), runtime.max_binding) // ALIGN * ALIGN // 4
        slot = SLOT
        placed, sizes, used = [], [], 0  # (chunk, start element) per tensor; elements per chunk
        for shape in shapes:
            n = max(1, -(-math.prod(shape) // slot)) * slot  # an empty tensor still gets a slot of its own
            if used and used + n > limit:
                sizes.append(used)
                used = 0
            placed.append((len(sizes), used))
            used += n
        sizes.append(used)
        self.chunks = [runtime.empty((n,)) for n in sizes]
        for i, chunk in enumerate(self.chunks):
            chunk.arena_chunk = i
            runtime.run("fill", grid_1d(chunk.size), dst=chunk, n=chunk.size, value=0.0)
        self.tensors = [self.chunks[c].view(start, shape) for (c, start), shape in zip(placed, shapes)]

    @classmethod
    def like(cls, runtime, tensors: list[Tensor]) -> list[Tensor]:
        """Zeroed tensors of `tensors`' shapes laid out as they are: views of a new Arena where `tensors` are all
        the views of an Arena (in any order), else one pooled tensor each."""
        if tensors and all(arena_chunk(t) is not None for t in tensors):
            order = sorted(range(len(tensors)), key=lambda i: (arena_chunk(tensors[i]), tensors[i].offset))
            arena = cls(runtime, [tensors[i].shape for i in order])
            if all(a.offset == tensors[i].offset and arena_chunk(a) == arena_chunk(tensors[i])
                   for a, i in zip(arena.tensors, order)):
                out = [None] * len(tensors)
                for a, i in zip(arena.tensors, order):
                    out[i] = a
                return out
        out = [runtime.empty(t.shape) for t in tensors]
        for t in out:
            if t.size:
                runtime.run("fill", grid_1d(t.size), dst=t, n=t.size, value=0.0)
        return out


def arena_chunk(t: Tensor) -> int | None:
    """The number of the Arena chunk `t` is a view of, or None where it is no Arena view."""
    return t._owner.arena_chunk if t._owner is not None else None


def spans(*lists: list[Tensor], keys: list | None = None) -> list[tuple[int, tuple[Tensor, ...]]]:
    """Merge position-wise corresponding tensors (same shapes) into spans. The positions are taken in the order of
    the first list's layout (Arena views by chunk and offset, then the rest in list order); position i joins the
    span of the position before it when keys agree and, in every list, its tensor is a view of the same Arena chunk
    and lies after the previous one at the same distance as in the first list. -> per span (the list index of its
    first tensor, one flat view per list), the views covering the run and the gaps inside it. A tensor that is no
    Arena view is a span of its own. The order depends only on the layout, so sums over spans are deterministic."""
    n = len(lists[0])

    def layout(i: int):
        t = lists[0][i]
        chunk = arena_chunk(t)
        return (0, chunk, t.offset, i) if chunk is not None else (1, 0, 0, i)

    order = sorted(range(n), key=layout)

    def joins(j: int) -> bool:
        i, h = order[j], order[j - 1]
        if keys is not None and keys[i] != keys[h]:
            return False
        step = lists[0][i].offset - lists[0][h].offset
        for ts in lists:
            a, b = ts[h], ts[i]
            owner = b._owner
            if (arena_chunk(b) is None or a._owner is not owner or b.offset - a.offset != step
                    or step < a.nbytes):
                return False
        return True

    out, start = [], 0
    for j in range(1, n + 1):
        if j < n and joins(j):
            continue
        span = []
        for ts in lists:
            first, last = ts[order[start]], ts[order[j - 1]]
            elements = (last.offset + last.nbytes - first.offset) // 4
            if arena_chunk(first) is not None:  # to the end of the last slot (zero): a span's length is a
                elements = -(-elements // SLOT) * SLOT  # multiple of 64 elements
            span.append(Tensor(first.runtime, first.buffer, (elements,), first.dtype, owner=first._owner or first,
                               offset=first.offset))
        out.append((order[start], tuple(span)))
        start = j
    return out
