"""Learning-rate schedules: constant, linear warmup + cosine, and warmup-stable-decay (WSD).

lr(step) = optim.lr · min(warmup(step), shape(step)) for the 0-based update index `step`:
- warmup(step) = (step + 1) / warmup_steps during the first warmup_steps updates, then 1 (so update 0 moves);
- shape: "constant" 1; "cosine" falls from 1 at step = warmup_steps to min_lr_ratio at step = total_steps along
  half a cosine; "wsd" is 1 until the last decay_fraction of the run, then falls linearly to min_lr_ratio at
  step = total_steps. Past total_steps both stay at min_lr_ratio.
"""

from __future__ import annotations

import math

from mambactl.train.config import TrainConfig


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """The learning rate of update `step` (0-based) of a run of cfg.train.total_steps updates."""
    s, total = cfg.schedule, cfg.train.total_steps
    warmup = (step + 1) / s.warmup_steps if step < s.warmup_steps else 1.0
    if s.kind == "constant":
        shape = 1.0
    elif s.kind == "cosine":
        progress = _progress(step, s.warmup_steps, total)
        shape = s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    else:  # wsd
        decay_start = total - max(1, round(s.decay_fraction * total))
        shape = 1 - (1 - s.min_lr_ratio) * _progress(step, decay_start, total)
    return cfg.optim.lr * min(warmup, shape)


def _progress(step: int, start: int, end: int) -> float:
    """0 at `start`, 1 at `end`, clamped to [0, 1]."""
    if end <= start:
        return 1.0 if step >= start else 0.0
    return min(1.0, max(0.0, (step - start) / (end - start)))
