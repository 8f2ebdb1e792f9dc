"""`mambactl train [CONFIG]`: the end-to-end trainer, from text to a .evermind package."""

from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from mambactl.cli.app import app
from mambactl.train.config import load_config, parse_config, preset_text
from mambactl.train.loop import train as run_training


@app.command()
def train(
    config: Optional[Path] = typer.Argument(None, help="TOML config (default: the built-in `tiny` preset)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run directory (overrides train.out_dir)."),
    steps: Optional[int] = typer.Option(None, "--steps", help="Optimizer steps (overrides train.steps)."),
    device: Optional[str] = typer.Option(None, "--device", help="Adapter index or name (overrides train.device)."),
    overrides: List[str] = typer.Option([], "--set", help="section.key=value, repeatable; validated like the file."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest checkpoint in the run directory."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the final summary."),
) -> None:
    """Train a Mamba-family language model on the GPU and write RUN_DIR/model.evermind."""
    extra = list(overrides)
    if out is not None:
        extra.append(f"train.out_dir={str(out)!r}".replace("'", '"'))
    if steps is not None:
        extra.append(f"train.steps={steps}")
    if device is not None:
        extra.append(f"train.device=\"{device}\"")
    cfg = parse_config(preset_text("tiny"), "preset tiny", extra) if config is None else load_config(config, extra)
    result = run_training(cfg, resume=resume, quiet=quiet)
    table = Table(title="training summary", show_header=False)
    rows = [
        ("run directory", str(result.run_dir)),
        ("steps", f"{result.steps}"),
        ("tokens seen", f"{result.tokens_seen:,}"),
        ("final train loss", f"{result.final_train_loss:.4f}"),
        ("final val loss", "-" if result.final_val_loss is None else f"{result.final_val_loss:.4f}"),
        ("throughput", f"{result.tokens_per_s:,.0f} tokens/s (wall {result.wall_s:.0f} s)"),
        ("package", str(result.package)),
        ("sample", repr(result.sample)),
    ]
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)
