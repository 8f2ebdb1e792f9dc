"""Command-line entry point. Commands are thin: they parse arguments and call library functions.

Every command module registers itself on `app`; `main` turns a MambactlError (or a wgpu
validation error) into one error line and exit status 1, never a traceback.
"""

import sys

from rich.console import Console

from mambactl.cli.app import app
from mambactl.cli import devices as _devices  # noqa: F401  (registers commands)
from mambactl.cli import smoke as _smoke  # noqa: F401
from mambactl.cli import train_cmd as _train_cmd  # noqa: F401
from mambactl.cli import generate_cmds as _generate_cmds  # noqa: F401
from mambactl.cli import plot_cmd as _plot_cmd  # noqa: F401
from mambactl.cli import package_cmds as _package_cmds  # noqa: F401
from mambactl.cli import init_cmd as _init_cmd  # noqa: F401
from mambactl.cli import interop_cmds as _interop_cmds  # noqa: F401
from mambactl.errors import MambactlError


def main() -> None:
    try:
        app(standalone_mode=True)
    except MambactlError as exc:
        Console(stderr=True).print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        Console(stderr=True).print("[yellow]interrupted[/]")
        sys.exit(130)
    except Exception as exc:  # a wgpu/naga validation error or other unexpected failure
        name = type(exc).__name__
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        Console(stderr=True).print(f"[bold red]error:[/] internal {name}: {first}", highlight=False, soft_wrap=True)
        sys.exit(2)
