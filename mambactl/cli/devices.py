"""`mambactl devices`: list the adapters wgpu sees."""

import json

import typer
from rich.console import Console
from rich.table import Table

from mambactl.cli.app import app
from mambactl.errors import MambactlError
from mambactl.runtime.device import NO_ADAPTER_HELP, choose_adapter, list_adapters


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


@app.command()
def devices(as_json: bool = typer.Option(False, "--json", help="Print one JSON object for scripts.")) -> None:
    """List every GPU adapter wgpu sees, with the limits and features that matter."""
    infos = list_adapters()
    if not infos:
        raise MambactlError(NO_ADAPTER_HELP)
    best = choose_adapter()[1].index
    if as_json:
        typer.echo(json.dumps({"default": best, "adapters": [i.to_dict() for i in infos]}, indent=2))
        return
    table = Table(title="wgpu adapters (choose with --device INDEX|NAME or MAMBACTL_DEVICE)")
    for col in ("#", "name", "backend", "type", "max binding", "max buffer", "wg storage", "invocations", "features"):
        table.add_column(col)
    for i in infos:
        lim = i.limits
        table.add_row(
            f"{i.index}{' *' if i.index == best else ''}", i.name, i.backend, i.type,
            _mib(lim.get("max-storage-buffer-binding-size", 0)), _mib(lim.get("max-buffer-size", 0)),
            f"{lim.get('max-compute-workgroup-storage-size', 0) // 1024} KiB",
            str(lim.get("max-compute-invocations-per-workgroup", 0)), ", ".join(i.features) or "-",
        )
    Console().print(table)
    Console().print("* = the adapter used by default")
