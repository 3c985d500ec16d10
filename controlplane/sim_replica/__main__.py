"""`python -m controlplane.sim_replica [OPTIONS]`: the same as `controlplane sim-replica`."""

import sys

import typer

from controlplane.cli.sim_replica import sim_replica_cmd
from controlplane.errors import ControlPlaneError

if __name__ == "__main__":
    cli = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    cli.command()(sim_replica_cmd)
    try:
        cli()
    except ControlPlaneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
