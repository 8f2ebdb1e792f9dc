"""`mambactl init`: write a commented starter training config from a preset."""

from pathlib import Path

import typer

from mambactl.cli.app import app
from mambactl.errors import MambactlError
from mambactl.train.config import list_presets, preset_text


@app.command("init")
def init(
    output: Path = typer.Option(Path("config.toml"), "-o", "--output", help="Where to write the config."),
    preset: str = typer.Option("tiny", "--preset", help=f"Starting point: {', '.join(list_presets())}."),
    force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
) -> None:
    """Write a commented starter config for `mambactl train`."""
    text = preset_text(preset)
    if output.exists() and not force:
        raise MambactlError(f"{output}: already exists; pass --force to overwrite it")
    if not output.parent.is_dir():
        raise MambactlError(f"{output.parent}: no such directory")
    output.write_text(text, encoding="utf-8")
    typer.echo(f"wrote {output} (preset {preset}); next: mambactl train {output}")
