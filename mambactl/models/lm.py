"""The language model on the GPU: parameters, gradients, forward and backward (no general autograd).

embedding -> per layer h = h + mixer(RMSNorm(h)) -> norm_f -> logits = h Eᵀ (tied head) -> cross-entropy.
The same structure as `mambactl.reference.lm`, which is its float64 oracle. Each layer type provides a
(forward, backward) pair in `LAYERS`; the LM owns the activations saved between the two.
"""

from __future__ import annotations

import numpy as np

from mambactl.errors import ShapeError
from mambactl.models.attention import attention_layer_backward, attention_layer_forward
from mambactl.models.config import ModelConfig
from mambactl.models.mamba1 import mamba1_backward, mamba1_forward
from mambactl.models.mamba2 import mamba2_backward, mamba2_forward
from mambactl.models.mamba3 import mamba3_backward, mamba3_forward
from mambactl.models.params import parameter_specs
from mambactl.ops import cross_entropy, embedding, linear, rmsnorm
from mambactl.ops.fill import fill
from mambactl.runtime.arena import Arena
from mambactl.runtime.tensor import Tensor

LAYERS = {"mamba1": (mamba1_forward, mamba1_backward), "mamba2": (mamba2_forward, mamba2_backward),
          "mamba3": (mamba3_forward, mamba3_backward), "attention": (attention_layer_forward, attention_layer_backward)}
EMBED, NORM_F = "backbone.embeddings.weight", "backbone.norm_f.weight"


class LanguageModel:
    """Parameters and gradient accumulators as GPU tensors, keyed by mamba_ssm / HF parameter names."""

    def __init__(self, cfg: ModelConfig, runtime, weights: dict[str, np.ndarray]):
        self.cfg, self.rt = cfg, runtime
        self.specs = parameter_specs(cfg)
        for s in self.specs:
            if s.name not in weights:
                raise ShapeError(f"missing parameter {s.name} (expected shape {s.shape})")
            if tuple(weights[s.name].shape) != s.shape:
                raise ShapeError(f"parameter {s.name} has shape {tuple(weights[s.name].shape)}, expected {s.shape}")
        # Parameters and gradients are views of two Arenas (runtime/arena.py) laid out alike, decayed tensors
        # first: zeroing the gradients, their global norm and the AdamW update are then one dispatch per decay
        # class instead of one per tensor. Names, shapes and the optimizer's per-tensor order stay as before.
        order = sorted(self.specs, key=lambda s: s.no_decay)
        param_arena, grad_arena = Arena(runtime, [s.shape for s in order]), Arena(runtime, [s.shape for s in order])
        self.params = dict(zip((s.name for s in order), param_arena.tensors))
        self.grads = dict(zip((s.name for s in order), grad_arena.tensors))
        self._grad_chunks = grad_arena.chunks
        for s in self.specs:
            runtime.write(self.params[s.name], np.asarray(weights[s.name], np.float32))
        self.params = {s.name: self.params[s.name] for s in self.specs}
        self.grads = {s.name: self.grads[s.name] for s in self.specs}

    def zero_grad(self) -> None:
        for chunk in self._grad_chunks:
            fill(chunk, 0.0)

    def _layer(self, table: dict, i: int) -> dict:
        prefix = f"backbone.layers.{i}.mixer."
        return {k[len(prefix):]: v for k, v in table.items() if k.startswith(prefix)}

    def forward(self, ids: np.ndarray, targets: np.ndarray | None = None, last_only: bool = False):
        """ids, targets [B, L] ints (targets may hold -100). -> (loss Tensor [1] or None, logits [B·L, V], saved).
        Nothing is read back: the caller reads the loss when it wants to. `last_only` (no targets): logits [B, V]
        of each sequence's last position alone (a decoder's prefill: the head then runs on B rows, not B·L)."""
        cfg, rt = self.cfg, self.rt
        ids = np.asarray(ids)
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ShapeError(f"forward: ids must be [batch, length] with length >= 1, got shape {ids.shape}")
        B, L = ids.shape
        if last_only and targets is not None:
            raise ShapeError("forward: last_only computes no loss; give no targets")
        # The forward's uploads happen before recording starts; the embedding backward's plan (a host sort of the
        # ids, three uploads) waits until the layers are recorded, so the GPU is already running them meanwhile.
        gids = rt.from_numpy(embedding.check_ids(ids.reshape(-1), cfg.padded_vocab_size))
        saved = dict(ids=ids)
        if targets is not None:
            targets = np.asarray(targets, np.int32).reshape(-1)
            if targets.size != B * L:
                raise ShapeError(f"forward: targets have {targets.size} elements, ids have {B * L}")
            saved.update(targets=rt.from_numpy(targets), count=cross_entropy.count_targets(targets))
        h = embedding.embedding(gids, self.params[EMBED])
        layers, out = [], None
        for i, kind in enumerate(cfg.layers):
            # h = h + the previous mixer's output, fused into this layer's norm
            h, xn, rstd = norm_with_residual(h, out, self.params[f"backbone.layers.{i}.norm.weight"], cfg.norm_eps)
            out, layer_saved = LAYERS[kind][0](self._layer(self.params, i), xn, B, L, cfg)
            layers.append((h, rstd, layer_saved))
        if targets is not None:
            saved["embedding_plan"] = embedding.EmbeddingGradPlan(rt, ids.reshape(-1))
        h, hf, rstd_f = norm_with_residual(h, out, self.params[NORM_F], cfg.norm_eps)
        if last_only:
            last, row = rt.empty((B, cfg.d_model)), 4 * cfg.d_model  # bytes a row
            for b in range(B):  # row b·L + L − 1 of hf
                rt.copy(hf, last, row, src_offset=((b + 1) * L - 1) * row, dst_offset=b * row)
            return None, linear.linear(last, self.params[EMBED]), dict(saved, layers=layers)
        logits = linear.linear(hf, self.params[EMBED])
        saved.update(layers=layers, h=h, rstd_f=rstd_f, hf=hf, logits=logits)
        loss = None
        if targets is not None:
            loss, saved["lse"] = cross_entropy.cross_entropy(logits, saved["targets"], saved["count"])
        return loss, logits, saved

    def backward(self, saved: dict, grad_count: int | None = None) -> None:
        """Add the gradient of the loss to `self.grads`. With gradient accumulation, pass the number of
        counted targets over all micro-batches as `grad_count` so the sum is the gradient of the global mean."""
        cfg, s = self.cfg, saved
        if "targets" not in s:
            raise ShapeError("backward: forward was called without targets")
        count = grad_count or s["count"]
        dlogits = cross_entropy.cross_entropy_backward(s["logits"], s["targets"], s["lse"], count)
        dhf, _, _ = linear.linear_backward(s["hf"], self.params[EMBED], dlogits, dw=self.grads[EMBED])
        dh, _ = rmsnorm.rmsnorm_backward(s["h"], self.params[NORM_F], s["rstd_f"], dhf, dw=self.grads[NORM_F])
        for i in reversed(range(cfg.n_layer)):
            h_in, rstd, layer_saved = s["layers"][i]
            dxn = LAYERS[cfg.layers[i]][1](self._layer(self.params, i), self._layer(self.grads, i), layer_saved, dh, cfg)
            norm = f"backbone.layers.{i}.norm.weight"  # dh: the residual stream's gradient, added in the kernel
            dh, _ = rmsnorm.rmsnorm_backward(h_in, self.params[norm], rstd, dxn, dw=self.grads[norm], add_to=dh)
        embedding.embedding_backward(s["embedding_plan"], dh, self.grads[EMBED])

    def weights_numpy(self) -> dict[str, np.ndarray]:
        return {k: t.numpy() for k, t in self.params.items()}

    def grads_numpy(self) -> dict[str, np.ndarray]:
        return {k: t.numpy() for k, t in self.grads.items()}


def norm_with_residual(h: Tensor, out: Tensor | None, w: Tensor, eps: float):
    """-> (h + out, RMSNorm(h + out), rstd) in one pass; without `out` (before the first layer), h as it is."""
    if out is None:
        return (h, *rmsnorm.rmsnorm(h, w, eps))
    return rmsnorm.add_rmsnorm(h, out, w, eps)
