"""Scoring a package on text: loss, perplexity, bits per token, top-1/top-5 next-token accuracy.

The text is tokenized exactly as the package's tokenizer does (no extra BOS/EOS) and cut into windows of
`window + 1` tokens that overlap by one, so every token but the first is predicted exactly once with up
to `window` tokens of context. For a text that fits one window this is the number transformers reports as
`loss` with `labels=input_ids`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from mambactl.errors import MambactlError
from mambactl.models.lm import LanguageModel


def evaluate_tokens(lm: LanguageModel, documents: list[np.ndarray], window: int,
                    progress: Callable[[int, int], None] | None = None) -> dict:
    """documents: token arrays [N_i] scored separately (no context crosses a document boundary) ->
    {"loss", "perplexity", "bits_per_token", "top1", "top5", "tokens"}, tokens = the predictions scored."""
    if window < 1:
        raise MambactlError("--window must be >= 1")
    docs = [np.asarray(d, dtype=np.int64) for d in documents if len(d) >= 2]
    if not docs:
        raise MambactlError("the text has fewer than 2 tokens; at least 2 are needed to score a prediction")
    V = lm.cfg.vocab_size
    windows = [(d, s) for d in docs for s in range(0, d.size - 1, window)]
    total = top1 = top5 = 0.0
    n = 0
    for k, (doc, s) in enumerate(windows):
        chunk = doc[s : s + window + 1]
        ids, targets = chunk[None, :-1], chunk[None, 1:]
        loss, logits, _ = lm.forward(ids, targets)
        scores = logits.numpy()[:, :V]
        t = targets.reshape(-1)
        total += float(loss.numpy()[0]) * t.size
        top1 += float(np.sum(scores.argmax(axis=1) == t))
        best5 = np.argsort(-scores, axis=1, kind="stable")[:, :5]
        top5 += float(np.sum(np.any(best5 == t[:, None], axis=1)))
        n += t.size
        if progress:
            progress(k + 1, len(windows))
    loss = total / n
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "bits_per_token": loss / math.log(2),
            "top1": top1 / n, "top5": top5 / n, "tokens": n}
