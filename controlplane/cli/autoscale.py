"""`controlplane autoscale ...`: the command group; each command lives in its own module
(`autoscale_backtest`, `autoscale_run`) and registers itself on `autoscale_app`."""

from __future__ import annotations

import typer

from controlplane.cli import app

autoscale_app = typer.Typer(
    help="The headroom autoscaler: backtest policies on traces, run the controller.",
    no_args_is_help=True,
)
app.add_typer(autoscale_app, name="autoscale")

__all__ = ["autoscale_app"]
