"""`mambactl plot RUN_DIR`: loss and perplexity curves as a PNG."""

from pathlib import Path
from typing import Optional

import typer

from mambactl.cli.app import app
from mambactl.train.plot import plot_run


@app.command()
def plot(
    run_dir: Path = typer.Argument(..., help="A training run directory (with metrics.jsonl)."),
    out: Optional[Path] = typer.Option(None, "-o", "--out", help="PNG to write (default RUN_DIR/loss.png)."),
) -> None:
    """Plot a run's train/validation loss and perplexity to a PNG (needs matplotlib)."""
    typer.echo(f"wrote {plot_run(run_dir, out)}")
