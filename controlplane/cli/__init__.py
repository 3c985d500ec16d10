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
    from controlplane.cli import replay as _replay  # noqa: F401
    from controlplane.cli import roofline as _roofline  # noqa: F401
    from controlplane.cli import traces as _traces  # noqa: F401


def main() -> None:
    _register()
    try:
        app()
    except ControlPlaneError as exc:
        err.print(f"[bold red]error:[/] {exc}")
        sys.exit(2)


__all__ = ["app", "main"]
