"""The language model (mamba_ssm `MambaLMHeadModel` / HF `MambaForCausalLM`) forward and backward.

embedding -> per layer x = x + mixer(RMSNorm(x)) -> norm_f -> logits = h Eᵀ (head tied to the embedding E,
padded vocab rows included) -> mean next-token cross-entropy (ignore_index -100).
Parameter names are those of `mambactl.models.params.parameter_specs`; a layer type maps to a pair
(block, block_backward) in `BLOCKS`, each taking that layer's mixer params without the name prefix.
"""

from mambactl.reference.attention import attention_block, attention_block_backward
from mambactl.reference.cross_entropy import cross_entropy, cross_entropy_backward
from mambactl.reference.embedding import embedding, embedding_backward
from mambactl.reference.linear import linear, linear_backward
from mambactl.reference.mamba1 import mamba1_block, mamba1_block_backward
from mambactl.reference.mamba2 import mamba2_block, mamba2_block_backward
from mambactl.reference.mamba3 import mamba3_block, mamba3_block_backward
from mambactl.reference.rmsnorm import rmsnorm, rmsnorm_backward

BLOCKS = {"mamba1": (mamba1_block, mamba1_block_backward), "mamba2": (mamba2_block, mamba2_block_backward),
          "mamba3": (mamba3_block, mamba3_block_backward), "attention": (attention_block, attention_block_backward)}

EMBED, NORM_F = "backbone.embeddings.weight", "backbone.norm_f.weight"


def _mixer_params(params, i):
    prefix = f"backbone.layers.{i}.mixer."
    return {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}


def lm_forward(params, cfg, ids, targets=None):
    """ids, targets [B, L] ints (targets may hold -100) -> (logits [B, L, V_padded], loss or None, saved)."""
    Bsz, L = ids.shape
    d, eps, E = cfg.d_model, cfg.norm_eps, params[EMBED]
    x = embedding(ids.reshape(-1), E)  # residual stream [B·L, d]
    layers = []
    for i, kind in enumerate(cfg.layers):
        block = BLOCKS[kind][0]
        xn = rmsnorm(x, params[f"backbone.layers.{i}.norm.weight"], eps)
        y, s = block(_mixer_params(params, i), xn.reshape(Bsz, L, d), cfg)
        layers.append((x, s))
        x = x + y.reshape(-1, d)
    h = rmsnorm(x, params[NORM_F], eps)
    logits = linear(h, E)
    loss = None if targets is None else cross_entropy(logits, targets.reshape(-1))
    saved = dict(ids=ids, targets=targets, layers=layers, x=x, h=h, logits=logits)
    return logits.reshape(Bsz, L, -1), loss, saved


def lm_backward(params, cfg, saved):
    """Gradient of the mean loss -> dict name -> array for every parameter (same names and shapes)."""
    s = saved
    if s["targets"] is None:
        raise ValueError("lm_backward needs the targets given to lm_forward")
    Bsz, L = s["ids"].shape
    d, eps, E = cfg.d_model, cfg.norm_eps, params[EMBED]
    grads = {}
    dlogits = cross_entropy_backward(s["logits"], s["targets"].reshape(-1))
    dh, dE_head, _ = linear_backward(s["h"], E, dlogits)
    dx, grads[NORM_F] = rmsnorm_backward(s["x"], params[NORM_F], dh, eps)
    for i in reversed(range(cfg.n_layer)):
        block_backward = BLOCKS[cfg.layers[i]][1]
        x_in, block_saved = s["layers"][i]
        dxn, mixer_grads = block_backward(_mixer_params(params, i), block_saved, dx.reshape(Bsz, L, d), cfg)
        dx_norm, grads[f"backbone.layers.{i}.norm.weight"] = rmsnorm_backward(
            x_in, params[f"backbone.layers.{i}.norm.weight"], dxn.reshape(-1, d), eps)
        dx = dx + dx_norm
        grads.update({f"backbone.layers.{i}.mixer.{k}": v for k, v in mixer_grads.items()})
    grads[EMBED] = dE_head + embedding_backward(s["ids"].reshape(-1), dx, E.shape[0])
    return grads
