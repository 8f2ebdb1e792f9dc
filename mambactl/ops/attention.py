"""Multi-head softmax attention (causal by default) and rotary embedding on the GPU (kernels/attention.wgsl).

q, k, v [B, L, H, Dh] with 1 ≤ Dh ≤ 128; scale 1/sqrt(Dh); each head attends over the keys of its own head.
Flash-attention tiling: scores exist one [64 × 32] tile per workgroup at a time. The forward keeps only the
output and the per-row logsumexp ([B, H, L]); the backward recomputes the weights tile by tile (dQ by query
tiles, dK and dV by key tiles, each summed inside one workgroup: deterministic, no atomics). Its transient
buffer is δ = rowsum(dO ∘ O) ([B, H, L]).

Decoding keeps a KV cache: keys (after rotary) and values [B, capacity, H, Dh] of the positions so far.
`kv_cache` starts it from a parallel forward's k and v; each `attention_step` appends one position per
sequence (rotating q and k by that position) and attends over all of them. When the cache is full its capacity
doubles (one copy of what it holds: amortised O(1) per token, never more than twice the memory in use); the
one limit is the device's storage binding size, which a step that would pass it reports as a ShapeError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mambactl.errors import ShapeError
from mambactl.ops.checks import expect, grid_1d, loop_budget
from mambactl.runtime.tensor import Tensor

MAX_HEAD_DIM = 128  # the kernels' accumulators cover dims tx·4 and 64 + tx·4 of 16 threads
CACHE_CHUNK = 64  # a new KV cache holds its prompt plus at least this many positions, rounded up to a multiple
QUERY_TILE = 64  # mirrors BQ in kernels/attention.wgsl
KEY_TILE = 32  # mirrors BK


@dataclass
class AttentionSaved:
    """What the backward needs: the forward's inputs (not copied), its output and the row logsumexp."""

    q: Tensor
    k: Tensor
    v: Tensor
    o: Tensor
    lse: Tensor  # [B, H, L]
    causal: bool


def _check_heads(op: str, name: str, t: Tensor, shape=None) -> tuple[int, int, int, int]:
    expect(op, name, t, shape or (None, None, None, None))
    batch, length, heads, head_dim = t.shape
    if min(batch, length, heads) < 1 or not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ShapeError(f"{op}: {name} has shape {t.shape}; batch, length and heads must be at least 1 and "
                         f"the head dim in [1, {MAX_HEAD_DIM}]")
    return batch, length, heads, head_dim


def _params(batch: int, length: int, heads: int, head_dim: int) -> dict:
    return dict(batch=batch, len=length, heads=heads, scale=1.0 / math.sqrt(head_dim))


# Loop iterations of one invocation (upper bounds, no unrolling assumed), for Mesa llvmpipe's budget of 65,535
# (mambactl/ops/checks.py): a score product is 23 per 16 dims; the forward and dQ walk ceil(L / KEY_TILE) key
# tiles, dK/dV ceil(L / QUERY_TILE) query tiles; a decoding step walks the cache in blocks of 256 positions.
def attention_loops(length: int, head_dim: int) -> int:
    score = 23 * -(-head_dim // 16)
    key_tiles, query_tiles = -(-length // KEY_TILE), -(-length // QUERY_TILE)
    return max(key_tiles * (score + 90), key_tiles * (2 * score + 70), query_tiles * (2 * score + 220)) + 64


def attention_step_loops(positions: int, head_dim: int) -> int:
    return -(-positions // 256) * (2 * head_dim + 12) + 64


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> tuple[Tensor, AttentionSaved]:
    """q, k, v [B, L, H, Dh] -> (o [B, L, H, Dh], saved)."""
    op = "attention"
    batch, length, heads, head_dim = _check_heads(op, "q", q)
    expect(op, "k", k, q.shape)
    expect(op, "v", v, q.shape)
    rt = q.runtime
    loop_budget(rt, op, tuple(q.shape), attention_loops(length, head_dim))
    o = rt.empty(q.shape)
    lse = rt.empty((batch, heads, length))
    # The forward reaches dout's binding through the staging code it shares with the backward, never reads it.
    rt.run("attention_forward", (-(-length // QUERY_TILE), heads, batch), {"DH": head_dim, "CAUSAL": causal},
           q=q, k=k, v=v, dout=q, out=o, lse_out=lse, **_params(batch, length, heads, head_dim))
    return o, AttentionSaved(q, k, v, o, lse, causal)


def attention_backward(saved: AttentionSaved, do: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """do [B, L, H, Dh] -> (dq, dk, dv), each [B, L, H, Dh]."""
    s = saved
    expect("attention_backward", "do", do, s.q.shape)
    batch, length, heads, head_dim = s.q.shape
    rt = do.runtime
    loop_budget(rt, "attention_backward", tuple(do.shape), attention_loops(length, head_dim))
    params = _params(batch, length, heads, head_dim)
    consts = {"DH": head_dim, "CAUSAL": s.causal}
    delta = rt.empty((batch, heads, length))
    rt.run("attention_backward_delta", grid_1d(batch * length * heads), consts, o=s.o, dout=do, delta_out=delta,
           **params)
    dq, dk, dv = rt.empty(s.q.shape), rt.empty(s.q.shape), rt.empty(s.q.shape)
    common = dict(q=s.q, k=s.k, v=s.v, dout=do, lse=s.lse, delta=delta, **params)
    rt.run("attention_backward_dq", (-(-length // QUERY_TILE), heads, batch), consts, out=dq, **common)
    rt.run("attention_backward_dkv", (-(-length // KEY_TILE), heads, batch), consts, dk=dk, dv=dv, **common)
    return dq, dk, dv


def _rope(op: str, x: Tensor, base: float, inverse: bool) -> Tensor:
    batch, length, heads, head_dim = _check_heads(op, "x", x)
    if head_dim % 2:
        raise ShapeError(f"{op}: x has shape {x.shape}; rotary embedding needs an even head dim")
    if not base > 1:
        raise ShapeError(f"{op}: base is {base}; it must be > 1")
    y = x.runtime.empty(x.shape)
    pairs = x.size // 2
    x.runtime.run("rope", grid_1d(pairs), {"DH": head_dim, "INVERSE": inverse}, x=x, y=y, pairs=pairs, len=length,
                  heads=heads, log2_base=math.log2(base))
    return y


def rope(x: Tensor, base: float = 10000.0) -> Tensor:
    """Rotary embedding: x [B, L, H, Dh] (Dh even) -> rotated x, same shape (HF Llama's rotate_half layout)."""
    return _rope("rope", x, base, inverse=False)


def rope_backward(dy: Tensor, base: float = 10000.0) -> Tensor:
    """dy [B, L, H, Dh] -> dx: the rotation is orthogonal, so its gradient turns back by the opposite angle."""
    return _rope("rope_backward", dy, base, inverse=True)


@dataclass
class KVCache:
    """Keys (after rotary) and values of the decoded positions, each [B, capacity, H, Dh]; the first `length`
    positions of every sequence are filled, the rest is room for the next steps."""

    k: Tensor
    v: Tensor
    length: int

    @property
    def capacity(self) -> int:
        return self.k.shape[1]


def _position_limit(like: Tensor) -> tuple[int, int]:
    """(bytes, positions): the most one cache buffer for a [B, *, H, Dh] tensor may hold on this device."""
    batch, _, heads, head_dim = like.shape
    rt = like.runtime
    limit = min(rt.max_binding, int(rt.limits["max-buffer-size"]))
    return limit, limit // (batch * heads * head_dim * 4)


def _cache_buffers(op: str, like: Tensor, capacity: int) -> tuple[Tensor, Tensor]:
    """Two empty [B, capacity, H, Dh] tensors; a ShapeError if they would pass the device's limit."""
    batch, _, heads, head_dim = like.shape
    limit, positions = _position_limit(like)
    if capacity > positions:
        raise ShapeError(f"{op}: a KV cache of {capacity} positions × {batch} sequences × {heads} heads × "
                         f"{head_dim} floats is over this device's storage binding limit of {limit} bytes "
                         f"(at most {positions} positions)")
    shape = (batch, capacity, heads, head_dim)
    return like.runtime.empty(shape), like.runtime.empty(shape)


def _copy_positions(src: Tensor, dst: Tensor, length: int) -> None:
    """dst[:, :length] = src[:, :length] for [B, *, H, Dh] tensors of any capacities (one copy per sequence)."""
    batch, _, heads, head_dim = src.shape
    row = heads * head_dim * 4
    for b in range(batch):
        src.runtime.copy(src, dst, length * row, b * src.shape[1] * row, b * dst.shape[1] * row)


def kv_cache(k: Tensor, v: Tensor) -> KVCache:
    """A KV cache holding k, v [B, L, H, Dh] (e.g. a parallel forward's, k after rotary), with room to grow."""
    op = "kv_cache"
    _, length, _, _ = _check_heads(op, "k", k)
    expect(op, "v", v, k.shape)
    room = -(-(length + CACHE_CHUNK) // CACHE_CHUNK) * CACHE_CHUNK
    ck, cv = _cache_buffers(op, k, max(length, min(room, _position_limit(k)[1])))
    _copy_positions(k, ck, length)
    _copy_positions(v, cv, length)
    return KVCache(ck, cv, length)


def _reserve(op: str, cache: KVCache, positions: int) -> None:
    """Grow the cache (doubling, or to the device's limit) until it holds `positions`."""
    if positions <= cache.capacity:
        return
    doubled = min(2 * cache.capacity, _position_limit(cache.k)[1])
    ck, cv = _cache_buffers(op, cache.k, max(positions, doubled))
    _copy_positions(cache.k, ck, cache.length)
    _copy_positions(cache.v, cv, cache.length)
    cache.k, cache.v = ck, cv


def attention_step(qkv: Tensor, cache: KVCache, rope_base: float | None = None) -> Tensor:
    """One decoding step: qkv [B, 3·H·Dh] is each sequence's new token projected (q | k | v, heads contiguous).
    With `rope_base`, q and k turn by the token's position (cache.length); k and v are appended to the cache
    (which grows when full) and o [B, H·Dh] = softmax(q·kᵀ / sqrt(Dh)) v over every cached position."""
    op = "attention_step"
    batch, _, heads, head_dim = cache.k.shape
    expect(op, "qkv", qkv, (batch, 3 * heads * head_dim))
    if rope_base is not None:
        if head_dim % 2:
            raise ShapeError(f"{op}: the cache has head dim {head_dim}; rotary embedding needs an even head dim")
        if not rope_base > 1:
            raise ShapeError(f"{op}: rope_base is {rope_base}; it must be > 1")
    loop_budget(qkv.runtime, op, (batch, cache.length + 1, heads, head_dim),
                attention_step_loops(cache.length + 1, head_dim))
    _reserve(op, cache, cache.length + 1)
    rt = qkv.runtime
    o = rt.empty((batch, heads * head_dim))
    rt.run("attention_step", (heads, batch), {"DH": head_dim, "ROPE": rope_base is not None}, qkv=qkv,
           k_cache=cache.k, v_cache=cache.v, out=o, heads=heads, len=cache.length,
           capacity=cache.capacity, scale=1.0 / math.sqrt(head_dim), log2_base=math.log2(rope_base or 2.0))
    cache.length += 1
    return o
