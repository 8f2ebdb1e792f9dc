"""Multi-head (causal) softmax attention with optional rotary embedding, and the attention mixer layer.

q, k, v are [B, L, H, Dh]: head h of position t is columns [h·Dh, (h+1)·Dh) of that position's row, as the
fused projection lays them out. Each head attends over the keys of the same head with scale 1/sqrt(Dh):
    o_t = Σ_{s ≤ t} softmax_s(q_t·k_s / sqrt(Dh)) v_s.
Rotary embedding (GPT-NeoX / HF Llama `rotate_half` convention) turns the pair (j, j + Dh/2) of position t
by the angle t · base^(−2j/Dh).
Decoding (`attention_step`): the new token's q attends over the cached keys and values of the positions
before it plus its own, with q and k rotated by its position: the parallel forward's row at that position.
The layer: qkv = x W_qkvᵀ (+ b) whose columns split into q | k | v, rope on q and k, attention, then out_proj.
`params` holds "qkv_proj.weight" [3·d_model, d_model], "out_proj.weight" [d_model, d_model] and, with the
`bias` option, "qkv_proj.bias" [3·d_model] and "out_proj.bias" [d_model]; grads use the same names.
"""

import numpy as np

from mambactl.reference.linear import linear, linear_backward
from mambactl.reference.slice import column_concat, column_slice


def _probs(q, k, causal):
    """Softmax weights [B, H, L_q, L_k] over the keys of each head."""
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        L = q.shape[1]
        scores = np.where(np.tril(np.ones((L, L), bool)), scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    e = np.exp(scores)
    return e / e.sum(axis=-1, keepdims=True)


def attention(q, k, v, causal=True):
    """q, k, v [B, L, H, Dh] -> o [B, L, H, Dh]."""
    return np.einsum("bhqk,bkhd->bqhd", _probs(q, k, causal), v)


def attention_backward(q, k, v, do, causal=True):
    """do [B, L, H, Dh] -> (dq, dk, dv), each [B, L, H, Dh]; the weights are recomputed from q and k."""
    P = _probs(q, k, causal)
    dv = np.einsum("bhqk,bqhd->bkhd", P, do)
    dP = np.einsum("bqhd,bkhd->bhqk", do, v)
    dS = P * (dP - np.sum(dP * P, axis=-1, keepdims=True)) / np.sqrt(q.shape[-1])
    dq = np.einsum("bhqk,bkhd->bqhd", dS, k)
    dk = np.einsum("bhqk,bqhd->bkhd", dS, q)
    return dq, dk, dv


def _rotate(x, base, sign, start=0):
    """Turn each pair (j, j + Dh/2) of x [B, L, H, Dh] by sign · t · base^(−2j/Dh) at position t (from start)."""
    L, Dh = x.shape[1], x.shape[-1]
    half = Dh // 2
    angle = np.arange(start, start + L)[:, None] * base ** (-2.0 * np.arange(half) / Dh)  # [L, Dh/2]
    c, s = np.cos(angle)[None, :, None, :], sign * np.sin(angle)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def rope(x, base=10000.0):
    """x [B, L, H, Dh] (Dh even) -> the rotated x, same shape."""
    return _rotate(x, base, 1.0)


def rope_backward(dy, base=10000.0):
    """The rotation is orthogonal: its gradient turns dy back by the opposite angle."""
    return _rotate(dy, base, -1.0)


def attention_step(qkv, k_cache, v_cache, heads, rope_base=None):
    """One decoding step. qkv [B, 3·H·Dh]: each sequence's new token projected (q | k | v, heads contiguous);
    k_cache, v_cache [B, T, H, Dh]: the T positions before it (k after rotary). With `rope_base`, q and k turn
    by position T. -> (o [B, H·Dh], k_cache and v_cache [B, T + 1, H, Dh] with the new position appended)."""
    Bsz, d = qkv.shape[0], qkv.shape[1] // 3
    T = k_cache.shape[1]
    q, k, v = (qkv[:, i * d:(i + 1) * d].reshape(Bsz, 1, heads, d // heads) for i in range(3))
    if rope_base is not None:
        q, k = _rotate(q, rope_base, 1.0, T), _rotate(k, rope_base, 1.0, T)
    k_cache, v_cache = np.concatenate([k_cache, k], axis=1), np.concatenate([v_cache, v], axis=1)
    o = attention(q, k_cache, v_cache, causal=False)  # every cached position is at or before the query
    return o.reshape(Bsz, d), k_cache, v_cache


def attention_block(params, x, cfg):
    """x [B, L, d_model] -> (y [B, L, d_model], saved for the backward)."""
    Bsz, L, d = x.shape
    a = cfg.attention
    H = a.n_heads
    x2 = x.reshape(-1, d)
    qkv = linear(x2, params["qkv_proj.weight"], params.get("qkv_proj.bias"))  # [B·L, 3d]: q | k | v
    q, k, v = (column_slice(qkv, i * d, d).reshape(Bsz, L, H, d // H) for i in range(3))
    if a.rope:
        q, k = rope(q, a.rope_base), rope(k, a.rope_base)
    o = attention(q, k, v).reshape(-1, d)
    y = linear(o, params["out_proj.weight"], params.get("out_proj.bias"))
    return y.reshape(Bsz, L, d), dict(x2=x2, q=q, k=k, v=v, o=o)


def attention_block_backward(params, saved, dy, cfg):
    """dy [B, L, d_model] -> (dx [B, L, d_model], grads: dict name -> array, shaped as params)."""
    s, a = saved, cfg.attention
    Bsz, L, d = dy.shape
    grads = {}
    do, grads["out_proj.weight"], db = linear_backward(s["o"], params["out_proj.weight"], dy.reshape(-1, d))
    if "out_proj.bias" in params:
        grads["out_proj.bias"] = db
    dq, dk, dv = attention_backward(s["q"], s["k"], s["v"], do.reshape(s["q"].shape))
    if a.rope:
        dq, dk = rope_backward(dq, a.rope_base), rope_backward(dk, a.rope_base)
    dqkv = column_concat([g.reshape(-1, d) for g in (dq, dk, dv)])
    dx, grads["qkv_proj.weight"], db = linear_backward(s["x2"], params["qkv_proj.weight"], dqkv)
    if "qkv_proj.bias" in params:
        grads["qkv_proj.bias"] = db
    return dx.reshape(Bsz, L, d), grads
