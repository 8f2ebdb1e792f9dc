"""What the benchmarks share: the checkout on sys.path, the model of a benchmark shape, the header of a result
(date, version, measured commit, device) and its output (a small table and one JSON line, appended to --out).

Import it before mambactl (`import common` works from any bench/ script: its folder is on sys.path).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import mambactl  # noqa: E402
from mambactl.models.config import (AttentionConfig, Mamba1Config, Mamba2Config, Mamba3Config,  # noqa: E402
                                    ModelConfig)

HEADDIM = 64  # Mamba-2 / Mamba-3 head dim, and the attention head dim unless --heads says otherwise


def training_step(rt, cfg: ModelConfig, batch: int, seq: int, *, seed: int = 0, lr: float = 1e-3):
    """A step function for a new LM of `cfg` on `rt`: zero the gradients, forward with the loss on a fresh
    random batch [batch, seq + 1] of tokens, backward, `adamw_step` (clip 1.0, weight decay 0.1 where the
    parameter takes it); the step records, syncs nothing and returns the loss tensor. -> (step, the AdamW state)."""
    import numpy as np

    from mambactl.models.lm import LanguageModel
    from mambactl.models.params import init_parameters, parameter_specs
    from mambactl.ops.adamw import AdamWState, adamw_step

    specs = parameter_specs(cfg)
    lm = LanguageModel(cfg, rt, init_parameters(cfg, seed))
    params, grads = [lm.params[s.name] for s in specs], [lm.grads[s.name] for s in specs]
    no_decay = [s.no_decay for s in specs]
    opt = AdamWState.zeros(params)
    rng = np.random.default_rng(seed)

    def step():
        tokens = rng.integers(0, cfg.vocab_size, (batch, seq + 1))
        lm.zero_grad()
        loss, _, saved = lm.forward(tokens[:, :-1], tokens[:, 1:])
        lm.backward(saved)
        adamw_step(params, grads, opt, lr=lr, weight_decay=0.1, no_decay=no_decay, max_grad_norm=1.0)
        del saved
        return loss

    return step, opt


def keep_busy(rt, fn, seconds: float = 0.5) -> None:
    """Run fn() back to back for `seconds`, then sync: a GPU left idle for a moment clocks down (the H200 to
    345 MHz from 1980 within ~1.5 s) and short timed calls then read 4-5× slow, so time them right after this."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        fn()
        rt.sync()


def pipeline_label(entry: str, constants=None, leave_out=()) -> str:
    """entry[FLAG,...,NAME=value] for a pipeline's constants (a dict or its items): true flags by name, false ones
    left out, numbers as NAME=value, in name order; names in `leave_out` are not shown."""
    parts = [k if v is True else f"{k}={v}" for k, v in sorted(dict(constants or {}).items())
             if k not in leave_out and v is not False]
    return entry + (f"[{','.join(parts)}]" if parts else "")


def commit() -> str:
    """The measured code: MAMBACTL_COMMIT when set (machines without .git, or a snapshot of a commit run from
    inside another checkout), else `git describe --always --dirty`."""
    if os.environ.get("MAMBACTL_COMMIT"):
        return os.environ["MAMBACTL_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def model_config(layers: list[str], d_model: int, vocab: int, d_state: int, heads: int | None = None) -> ModelConfig:
    """A benchmark model: one entry of `layers` per layer; Mamba-2/3 head dim 64; attention with `heads` heads
    (default d_model / 64, at least one)."""
    return ModelConfig(vocab_size=vocab, d_model=d_model, n_layer=len(layers), layers=list(layers),
                       mamba1=Mamba1Config(d_state=d_state), mamba2=Mamba2Config(d_state=d_state, headdim=HEADDIM),
                       mamba3=Mamba3Config(d_state=d_state, headdim=HEADDIM),
                       attention=AttentionConfig(n_heads=heads or max(1, d_model // HEADDIM)))


def header(bench: str, info) -> dict:
    """The first fields of every result: which benchmark, when, which code, on which adapter."""
    return {
        "bench": bench,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "mambactl": mambactl.__version__,
        "commit": commit(),
        "device": {"name": info.name, "backend": info.backend, "type": info.type, "driver": info.driver},
    }


def report(rows: list[tuple[str, str]], result: dict, out: str | None) -> None:
    """Print the table of (label, value) rows and the result as one JSON line, also appended to `out`."""
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    line = json.dumps(result, sort_keys=False)
    print(line)
    if out:
        with open(out, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def add_set_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", default=[], metavar="OP.NAME=VALUE",
                   help="set an integer constant of mambactl.ops.OP (or of mambactl.A.B when OP is A.B) for this run "
                        "(e.g. linear.TRANSPOSE_MIN_ROWS=99999999, runtime.gpu.FIRST_SUBMIT=256)")


def apply_sets(p: argparse.ArgumentParser, items: list[str]) -> None:
    """Set each OP.NAME=VALUE of --set (an integer constant of mambactl.ops.OP, or mambactl.A.B for A.B) before anything runs."""
    for item in items:
        target, value = item.split("=")
        module, name = target.rsplit(".", 1)
        path = f"mambactl.{module}" if "." in module else f"mambactl.ops.{module}"  # runtime.gpu.X too
        mod = importlib.import_module(path)
        if not isinstance(getattr(mod, name, None), (int, type(None))):
            p.error(f"--set {item}: {path} has no integer constant {name}")
        setattr(mod, name, int(value))
