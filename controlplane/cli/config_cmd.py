"""`controlplane config show|diff`: the router's resolved configuration, and how two differ.

`show` prints the YAML of the resolved settings (file, environment and defaults combined; every
default explicit; secrets masked). `diff A B` resolves both files the same way and lists the
settings whose values differ as dotted paths. List items keyed by `id` or `name` (replicas,
arms) are matched by that key (`replicas[r1].url`, `policy.arms[b].weight`), other lists by index
(`[0]`); a path present on one side only shows "(absent)" on the other. Like `git diff`, it
exits 0 either way unless `--exit-code`, which makes a difference exit 1.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from controlplane.cli import app
from router.config import load_settings, resolved_dict, to_yaml

config_app = typer.Typer(help="The router's configuration.", no_args_is_help=True)
app.add_typer(config_app, name="config")
out = Console(width=None if sys.stdout.isatty() else 200)


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


ABSENT: Any = _Absent()


def _item_key(item: Any, index: int) -> str:
    if isinstance(item, Mapping):
        for key in ("id", "name"):
            if isinstance(item.get(key), str):
                return str(item[key])
    return str(index)


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of nested dicts/lists by dotted path (see the module docstring)."""
    if isinstance(value, Mapping) and value:
        flat: dict[str, Any] = {}
        for k, v in value.items():
            flat.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return flat
    if isinstance(value, list) and value:
        flat = {}
        for i, item in enumerate(value):
            flat.update(flatten(item, f"{prefix}[{_item_key(item, i)}]"))
        return flat
    return {prefix: value}


def diff_settings(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(path, old, new) for every leaf that differs; ABSENT marks a missing side."""
    fa, fb = flatten(a), flatten(b)
    paths = list(fa) + [p for p in fb if p not in fa]
    return [
        (p, fa.get(p, ABSENT), fb.get(p, ABSENT))
        for p in paths
        if p not in fa or p not in fb or fa[p] != fb[p]
    ]


def _show(value: Any) -> str:
    return repr(value) if value is ABSENT else json.dumps(value)


@config_app.command("show")
def show_cmd(
    config: Annotated[
        Path | None, typer.Option(help="Router config YAML (default: $CP_CONFIG_FILE).")
    ] = None,
) -> None:
    """Print the resolved router configuration as YAML, every default explicit."""
    typer.echo(to_yaml(load_settings(config_file=config)), nl=False)


@config_app.command("diff")
def diff_cmd(
    old: Annotated[Path, typer.Argument(help="The first config file.")],
    new: Annotated[Path, typer.Argument(help="The second config file.")],
    exit_code: Annotated[
        bool, typer.Option("--exit-code", help="Exit 1 when the configurations differ.")
    ] = False,
) -> None:
    """The settings whose resolved values differ between two config files."""
    changes = diff_settings(
        resolved_dict(load_settings(config_file=old)), resolved_dict(load_settings(config_file=new))
    )
    if not changes:
        out.print("no differences")
        return
    table = Table(title=f"{escape(str(old))} → {escape(str(new))}")
    table.add_column("setting")
    table.add_column("old", justify="right")
    table.add_column("new", justify="right")
    for path, a, b in changes:
        table.add_row(escape(path), escape(_show(a)), escape(_show(b)))
    out.print(table)
    if exit_code:
        raise typer.Exit(1)
