"""Causal multi-head attention mixer on the GPU (for hybrids): forward and backward through the ops.

qkv_proj -> [q | k | v] columns, heads contiguous within each -> rotary embedding on q and k (optional) ->
flash attention per head -> out_proj. The LM's pre-RMSNorm and residual wrap it like every layer.
`p` and `g` map this layer's mixer names without prefix ("qkv_proj.weight", "out_proj.weight", optional
biases) to parameter and gradient tensors; gradients are accumulated into `g`.
Decoding: the state is a KV cache started from the forward's k (after rotary) and v; each step projects the
new token and runs one `attention_step` (rotary at its position, append, attend over every cached position).
"""

from __future__ import annotations

from mambactl.models.config import ModelConfig
from mambactl.ops import attention as attn
from mambactl.ops import linear, slice
from mambactl.runtime.tensor import Tensor


def attention_layer_forward(p: dict, x: Tensor, batch: int, length: int, cfg: ModelConfig):
    """x [B·L, d_model] -> (y [B·L, d_model], saved)."""
    a, d = cfg.attention, cfg.d_model
    heads = (batch, length, a.n_heads, cfg.attention_head_dim)
    qkv = linear.linear(x, p["qkv_proj.weight"], p.get("qkv_proj.bias"))
    q, k, v = (slice.column_slice(qkv, i * d, d).reshape(heads) for i in range(3))
    if a.rope:
        q, k = attn.rope(q, a.rope_base), attn.rope(k, a.rope_base)
    o, attn_saved = attn.attention(q, k, v)
    o = o.reshape(-1, d)
    out = linear.linear(o, p["out_proj.weight"], p.get("out_proj.bias"))
    return out, dict(x=x, o=o, attn=attn_saved)


def attention_layer_backward(p: dict, g: dict, saved: dict, dout: Tensor, cfg: ModelConfig) -> Tensor:
    """dout [B·L, d_model] -> dx [B·L, d_model]; parameter gradients are added into `g`."""
    a, d, s = cfg.attention, cfg.d_model, saved
    do, _, _ = linear.linear_backward(s["o"], p["out_proj.weight"], dout, dw=g["out_proj.weight"],
                                      db=g.get("out_proj.bias"))
    dq, dk, dv = attn.attention_backward(s["attn"], do.reshape(s["attn"].q.shape))
    if a.rope:
        dq, dk = attn.rope_backward(dq, a.rope_base), attn.rope_backward(dk, a.rope_base)
    dqkv = slice.column_concat([t.reshape(-1, d) for t in (dq, dk, dv)])
    dx, _, _ = linear.linear_backward(s["x"], p["qkv_proj.weight"], dqkv, dw=g["qkv_proj.weight"],
                                      db=g.get("qkv_proj.bias"))
    return dx


def attention_layer_decode_state(saved: dict, cfg: ModelConfig) -> dict:
    """The recurrent state after a parallel forward: a KV cache holding the prompt's k (after rotary) and v."""
    return {"cache": attn.kv_cache(saved["attn"].k, saved["attn"].v)}


def attention_layer_step(p: dict, x: Tensor, state: dict, cfg: ModelConfig) -> Tensor:
    """One token per batch row: x [B, d_model] -> [B, d_model]; the KV cache in `state` gains one position."""
    a = cfg.attention
    qkv = linear.linear(x, p["qkv_proj.weight"], p.get("qkv_proj.bias"))
    o = attn.attention_step(qkv, state["cache"], a.rope_base if a.rope else None)
    return linear.linear(o, p["out_proj.weight"], p.get("out_proj.bias"))
