"""Text generation from a package: parallel prefill, then one recurrent step per token, streamed.

Sampling happens on the host over the V logits of each step: temperature (0 = greedy), top-k, top-p
(nucleus over the sorted distribution), with a seeded generator — same seed, same text.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mambactl.errors import MambactlError
from mambactl.models.decode import RecurrentDecoder
from mambactl.models.lm import LanguageModel


@dataclass
class GenerationResult:
    text: str  # the generated continuation (without the prompt)
    tokens: list[int]
    prompt_tokens: int
    decode_tokens_per_s: float
    stopped_by: str  # "max_tokens" | "stop" | "eos"


def sample_next(logits: np.ndarray, rng: np.random.Generator, temperature: float, top_k: int, top_p: float) -> int:
    """logits [V] -> one token id."""
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise MambactlError("sampling: temperature must be >= 0, top_p in (0, 1], top_k >= 0")
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    if top_k:
        order = order[:top_k]
    p = np.exp(z[order] - z[order[0]])
    p /= p.sum()
    if top_p < 1:
        keep = int(np.searchsorted(np.cumsum(p), top_p) + 1)  # the smallest prefix with mass >= top_p
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    return int(order[rng.choice(len(order), p=p)])


def generate(lm: LanguageModel, tokenizer, prompt: str, *, max_tokens: int = 64, temperature: float = 0.8,
             top_k: int = 50, top_p: float = 1.0, seed: int = 0, stop: list[str] | None = None,
             on_text: Callable[[str], None] | None = None) -> GenerationResult:
    """Continue `prompt`; `on_text` receives each new piece of decoded text as soon as it is complete UTF-8."""
    if max_tokens < 0:
        raise MambactlError("max_tokens must be >= 0")
    vocab = lm.cfg.vocab_size
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    eos = tokenizer.token_to_id("<|endoftext|>")
    if not ids:  # an empty prompt starts from the end-of-text token, as a document boundary
        ids = [eos if eos is not None else 0]
    rng = np.random.default_rng(seed)
    dec = RecurrentDecoder(lm)
    logits = dec.prefill(np.array([ids]))[0, :vocab]
    out: list[int] = []
    text, stopped = "", "max_tokens"
    t0 = time.perf_counter()
    for i in range(max_tokens):
        tok = sample_next(logits, rng, temperature, top_k, top_p)
        if eos is not None and tok == eos:
            stopped = "eos"
            break
        out.append(tok)
        new_text = tokenizer.decode(out)
        if "\ufffd" in new_text[len(text):] and i + 1 < max_tokens:  # an incomplete UTF-8 sequence so far
            logits = dec.step(np.array([tok]))[0, :vocab]
            continue
        piece, text = new_text[len(text):], new_text
        hit = next((s for s in stop or [] if s and s in text), None)
        if hit is not None:
            cut = text.index(hit)
            piece = piece[: max(0, len(piece) - (len(text) - cut))]
            text, stopped = text[:cut], "stop"
        if on_text and piece:
            on_text(piece)
        if stopped == "stop":
            break
        if i + 1 < max_tokens:
            logits = dec.step(np.array([tok]))[0, :vocab]
    elapsed = time.perf_counter() - t0
    return GenerationResult(text, out, len(ids), len(out) / elapsed if elapsed > 0 and out else 0.0, stopped)
