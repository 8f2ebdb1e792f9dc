"""Recurrent decoding: a parallel prefill of the prompt, then one step per new token (O(1) work in a Mamba
layer, O(positions so far) in an attention layer).

Every layer type gives (decode_state, step): `decode_state(saved, cfg)` turns what its parallel forward
saved into the recurrent state (for Mamba-1: the conv window and the SSM state; for attention: a KV cache
that grows with the sequence), and `step(p, x, state, cfg)` advances one token. The logits of step-by-step
decoding equal the parallel forward's at every position.
"""

from __future__ import annotations

import numpy as np

from mambactl.errors import MambactlError
from mambactl.models.attention import attention_layer_decode_state, attention_layer_step
from mambactl.models.lm import EMBED, NORM_F, LanguageModel, norm_with_residual
from mambactl.models.mamba1 import mamba1_decode_state, mamba1_step
from mambactl.models.mamba2 import mamba2_decode_state, mamba2_step
from mambactl.models.mamba3 import mamba3_decode_state, mamba3_step
from mambactl.ops import embedding, linear

DECODERS = {"mamba1": (mamba1_decode_state, mamba1_step), "mamba2": (mamba2_decode_state, mamba2_step),
            "mamba3": (mamba3_decode_state, mamba3_step),
            "attention": (attention_layer_decode_state, attention_layer_step)}


class RecurrentDecoder:
    """Holds one recurrent state per layer for a batch of sequences decoded in lockstep."""

    def __init__(self, lm: LanguageModel):
        self.lm = lm
        self.states: list[dict] | None = None

    def prefill(self, ids: np.ndarray) -> np.ndarray:
        """ids [B, L] -> logits [B, V_padded] of the last position; the states are ready for `step`."""
        lm = self.lm
        _, logits, saved = lm.forward(ids)
        self.states = [DECODERS[kind][0](layer_saved, lm.cfg)
                       for kind, (_, _, layer_saved) in zip(lm.cfg.layers, saved["layers"])]
        B, L = np.asarray(ids).shape
        return logits.numpy().reshape(B, L, -1)[:, -1]

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """tokens [B] -> logits [B, V_padded] of the next position (one token per sequence)."""
        if self.states is None:
            raise MambactlError("decoder: call prefill before step")
        lm, cfg = self.lm, self.lm.cfg
        gids = lm.rt.from_numpy(embedding.check_ids(np.asarray(tokens).reshape(-1), cfg.padded_vocab_size))
        h, out = embedding.embedding(gids, lm.params[EMBED]), None
        for i, kind in enumerate(cfg.layers):  # the residual add is fused into the next norm, as in LanguageModel
            h, xn, _ = norm_with_residual(h, out, lm.params[f"backbone.layers.{i}.norm.weight"], cfg.norm_eps)
            out = DECODERS[kind][1](lm._layer(lm.params, i), xn, self.states[i], cfg)
        _, hf, _ = norm_with_residual(h, out, lm.params[NORM_F], cfg.norm_eps)
        return linear.linear(hf, lm.params[EMBED]).numpy()
