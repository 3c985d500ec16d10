"""`controlplane` command line: thin typer commands over library calls."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from controlplane.errors import ControlPlaneError

app = typer.Typer(
    name="controlplane",
    help="Control plane for multi-replica vLLM fleets: simulate, route, share, scale.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)


def _register() -> None:
    """Import every command module in this package; each registers itself on `app`."""
    import importlib
    import pkgutil

    for mod in pkgutil.iter_modules(__path__):
        if mod.name != "common":
            importlib.import_module(f"{__name__}.{mod.name}")


def main() -> None:
    _register()
    try:
        app()
    except ControlPlaneError as exc:
        err.print(f"[bold red]error:[/] {exc}")
        sys.exit(2)


__all__ = ["app", "main"]
