"""`controlplane autoscale ...`: the command group; each command lives in its own module
(`autoscale_backtest`, `autoscale_run`) and registers itself on `autoscale_app`."""

from __future__ import annotations

import json
from typing import Any

import typer

from controlplane.cli import app
from controlplane.errors import ConfigError

autoscale_app = typer.Typer(
    help="The headroom autoscaler: backtest policies on traces, run the controller.",
    no_args_is_help=True,
)
app.add_typer(autoscale_app, name="autoscale")

__all__ = ["autoscale_app", "policy_params"]


def policy_params(items: list[str], *, strings: bool) -> dict[str, Any]:
    """`--policy-param KEY=VALUE` options as the policy factory's keyword arguments: each VALUE is
    JSON; one that is not is kept as a string when `strings`, else refused (ConfigError)."""
    params: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--policy-param expects KEY=VALUE, got {item!r}")
        try:
            params[key] = json.loads(value)
        except ValueError:
            if not strings:
                raise ConfigError(f"--policy-param {key}: {value!r} is not a JSON value") from None
            params[key] = value
    return params
