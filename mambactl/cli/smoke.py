"""`mambactl smoke`: one forward/backward on the GPU checked against the float64 reference."""

from typing import Optional

import typer
from rich.console import Console

from mambactl.cli.app import app
from mambactl.errors import MambactlError
from mambactl.ops.selfcheck import selfcheck
from mambactl.runtime.gpu import get_runtime

TOLERANCE = 1e-4


@app.command()
def smoke(device: Optional[str] = typer.Option(None, "--device", help="Adapter index or name (default: best).")) -> None:
    """Run a small forward/backward on the GPU and compare it with the float64 reference."""
    rt = get_runtime(device)
    errors = selfcheck(rt)
    con = Console()
    con.print(f"adapter: {rt.info.name} ({rt.info.backend}, {rt.info.type})")
    for key in ("loss", "dx", "dW"):
        con.print(f"  {key:5s} relative error vs float64 reference: {errors[key]:.2e}")
    worst = max(errors[k] for k in ("loss", "dx", "dW"))
    if not worst < TOLERANCE:
        raise MambactlError(f"GPU results differ from the reference by {worst:.2e} (tolerance {TOLERANCE:.0e})")
    con.print("[green]ok[/]: forward and backward match the reference")
