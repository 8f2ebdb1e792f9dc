"""Recurrent decoding: a parallel prefill of the prompt, then one step per new token (O(1) work in a Mamba
layer, O(positions so far) in an attention layer).

Every layer type gives (decode_state, step): `decode_state(saved, cfg)` turns what its parallel forward
saved into the recurrent state (for Mamba-1: the conv window and the SSM state; for attention: a KV cache
that grows with the sequence), and `step(p, x, state, cfg)` advances one token. The logits of step-by-step
decoding equal the parallel forward's at every position.

A Mamba layer's step is the same work every time (its state advances in place), so when every layer is one the
decoder captures its second step as a graph (runtime.Graph) and replays it for the rest: a token then costs the
encoding of its ~10 dispatches a layer, not the ops' Python (the host was most of a token's time on an H200).
An attention layer's step is not (its KV cache grows, its position changes), so models with one record every step.
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
REPLAYABLE = ("mamba1", "mamba2", "mamba3")  # layer types whose step is the same work every time


class RecurrentDecoder:
    """Holds one recurrent state per layer for a batch of sequences decoded in lockstep. `replay` False records
    every step through the ops (the default: True where every layer is in REPLAYABLE)."""

    def __init__(self, lm: LanguageModel, replay: bool | None = None):
        self.lm = lm
        self.states: list[dict] | None = None
        self.replay = all(kind in REPLAYABLE for kind in lm.cfg.layers) if replay is None else replay
        self._steps = 0  # since the prefill
        self._batch = 0  # sequences, set by the prefill
        self._graph = None  # (graph, its token-ids tensor, its logits tensor)

    def prefill(self, ids: np.ndarray) -> np.ndarray:
        """ids [B, L] -> logits [B, V_padded] of the last position; the states are ready for `step`."""
        lm = self.lm
        _, logits, saved = lm.forward(ids, last_only=True)
        self.states = [DECODERS[kind][0](layer_saved, lm.cfg)
                       for kind, (_, _, layer_saved) in zip(lm.cfg.layers, saved["layers"])]
        self._steps, self._graph = 0, None  # a graph binds the old states
        self._batch = np.asarray(ids).shape[0]
        return logits.numpy()

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """tokens [B] -> logits [B, V_padded] of the next position (one token per sequence)."""
        if self.states is None:
            raise MambactlError("decoder: call prefill before step")
        lm, rt = self.lm, self.lm.rt
        ids = embedding.check_ids(np.asarray(tokens).reshape(-1), lm.cfg.padded_vocab_size)
        if ids.shape[0] != self._batch:
            raise MambactlError(f"decoder: {ids.shape[0]} tokens for a batch of {self._batch} sequences")
        self._steps += 1
        if self._graph is not None:
            graph, gids, logits = self._graph
            rt.write(gids, ids)
            rt.replay(graph)
            return logits.numpy()
        gids = rt.from_numpy(ids)
        if not self.replay or self._steps == 1:  # the first step compiles pipelines and may read (probes)
            return self._record(gids).numpy()
        with rt.capture() as graph:
            logits = self._record(gids)
        self._graph = (graph, gids, logits)
        return logits.numpy()

    def _record(self, gids):
        """One step through the ops: token ids [B] on the GPU -> logits [B, V_padded] (a Tensor)."""
        lm, cfg = self.lm, self.lm.cfg
        h, out = embedding.embedding(gids, lm.params[EMBED]), None
        for i, kind in enumerate(cfg.layers):  # the residual add is fused into the next norm, as in LanguageModel
            h, xn, _ = norm_with_residual(h, out, lm.params[f"backbone.layers.{i}.norm.weight"], cfg.norm_eps)
            out = DECODERS[kind][1](lm._layer(lm.params, i), xn, self.states[i], cfg)
        _, hf, _ = norm_with_residual(h, out, lm.params[NORM_F], cfg.norm_eps)
        return linear.linear(hf, lm.params[EMBED])
