"""Multi-head softmax attention (causal by default) and rotary embedding on the GPU (kernels/attention.wgsl).

q, k, v [B, L, H, Dh] with 1 ≤ Dh ≤ 128; scale 1/sqrt(Dh); each head attends over the keys of its own head.
Flash-attention tiling: scores exist one [64 × 32] tile per workgroup at a time. The forward keeps only the
output and the per-row logsumexp ([B, H, L]); the backward recomputes the weights tile by tile (dQ by query
tiles, dK and dV by key tiles, each summed inside one workgroup: deterministic, no atomics). Its transient
buffer is δ = rowsum(dO ∘ O) ([B, H, L]).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mambactl.errors import ShapeError
from mambactl.ops.checks import expect, grid_1d
from mambactl.runtime.tensor import Tensor

MAX_HEAD_DIM = 128  # the kernels' accumulators cover dims tx·4 and 64 + tx·4 of 16 threads
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


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True) -> tuple[Tensor, AttentionSaved]:
    """q, k, v [B, L, H, Dh] -> (o [B, L, H, Dh], saved)."""
    op = "attention"
    batch, length, heads, head_dim = _check_heads(op, "q", q)
    expect(op, "k", k, q.shape)
    expect(op, "v", v, q.shape)
    rt = q.runtime
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
