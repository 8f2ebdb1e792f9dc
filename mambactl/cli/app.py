"""The Typer application every command module registers on."""

import typer

from mambactl import __version__

app = typer.Typer(
    name="mambactl",
    help="Train and package Mamba-family language models on any GPU through wgpu.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mambactl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """Train and package Mamba-family language models on any GPU through wgpu."""
