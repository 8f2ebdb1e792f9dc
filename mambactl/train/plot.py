"""Loss and perplexity curves of a run, from RUN_DIR/metrics.jsonl, as a PNG (matplotlib, an optional extra)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from mambactl.errors import MambactlError


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise MambactlError(f"{path}: no such file (is {run_dir} a training run directory?)")
    events = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                raise MambactlError(f"{path}:{i}: not a JSON line") from None
    return events


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Write the train/validation loss (left) and validation perplexity (right) against step; -> the PNG path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MambactlError("plotting needs matplotlib: pip install 'mambactl[plot]'") from None
    events = read_metrics(run_dir)
    train = [(e["step"], e["train_loss"]) for e in events if "train_loss" in e]
    val = [(e["step"], e["val_loss"]) for e in events if "val_loss" in e]
    if not train and not val:
        raise MambactlError(f"{Path(run_dir) / 'metrics.jsonl'}: no train_loss or val_loss events to plot")
    out = Path(out) if out else Path(run_dir) / "loss.png"
    fig, (ax_loss, ax_ppl) = plt.subplots(1, 2, figsize=(11, 4))
    if train:
        ax_loss.plot(*zip(*train), label="train loss")
    if val:
        ax_loss.plot(*zip(*val), "o-", label="validation loss")
        ax_ppl.plot([s for s, _ in val], [math.exp(min(v, 700)) for _, v in val], "o-", color="tab:orange")
    ax_loss.set(xlabel="step", ylabel="loss (nats/token)", title=Path(run_dir).name)
    ax_loss.legend()
    ax_ppl.set(xlabel="step", ylabel="validation perplexity", yscale="log", title="perplexity")
    fig.tight_layout()
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out)
    return out
