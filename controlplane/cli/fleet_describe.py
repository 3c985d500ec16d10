"""`controlplane fleet describe` and `controlplane fleet diff`: what the replicas say they are.

describe URL... [--out FILE] [--json]   ask each replica (`controlplane.replica_info`), print a
                                        table and the drift of each model group; --out writes a
                                        capture (JSON) to compare later
diff A B                                A and B are each a replica URL, a capture file (every
                                        replica in it) or FILE#NAME (one replica of a capture);
                                        prints every difference; exit 0 when none, 1 otherwise
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import httpx
import typer
from rich.markup import escape
from rich.table import Table

from controlplane.cli.fleet import fleet_app, out
from controlplane.drift import Difference, diff, find_drift
from controlplane.errors import ConfigError, ReplicaDescriptionError
from controlplane.replica_info import ReplicaInfo, describe_replica, read_capture, write_capture


async def _describe_all(urls: list[str], timeout_s: float) -> dict[str, ReplicaInfo]:
    async def one(url: str) -> ReplicaInfo:
        async with httpx.AsyncClient(base_url=url.rstrip("/")) as client:
            try:
                return await describe_replica(client, url, timeout_s=timeout_s)
            except ReplicaDescriptionError as exc:
                raise ReplicaDescriptionError(f"{url}: {exc}") from None

    infos = await asyncio.gather(*(one(u) for u in urls))
    return {u.rstrip("/"): i for u, i in zip(urls, infos, strict=True)}


def _is_url(arg: str) -> bool:
    return arg.startswith(("http://", "https://"))


def _load(arg: str, timeout_s: float) -> dict[str, ReplicaInfo]:
    """One side of a diff: a URL, a capture, or one replica of a capture (FILE#NAME)."""
    if _is_url(arg):
        return asyncio.run(_describe_all([arg], timeout_s))
    path, _, name = arg.partition("#")
    try:
        infos = read_capture(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read capture {path}: {exc}") from None
    if not name:
        return infos
    if name not in infos:
        raise ConfigError(f"{path} has no replica {name!r}; it has {sorted(infos)}")
    return {name: infos[name]}


def _cell(v: object) -> str:
    return "-" if v is None else escape(str(v))


def _table(infos: dict[str, ReplicaInfo]) -> Table:
    table = Table(title="replicas as they describe themselves")
    cols = ("replica", "models (max_model_len)", "block", "blocks", "prefix cache", "hash")
    for col in (*cols, "version", "architecture"):
        table.add_column(col)
    for name, i in infos.items():
        models = ", ".join(f"{m.name} ({_cell(m.max_model_len)})" for m in i.models)
        table.add_row(
            _cell(name),
            escape(models),
            _cell(i.block_size),
            _cell(i.num_gpu_blocks),
            _cell(i.enable_prefix_caching),
            _cell(i.prefix_caching_hash_algo),
            _cell(i.version),
            _cell(i.architecture),
        )
    return table


def _drift_lines(infos: dict[str, ReplicaInfo]) -> list[str]:
    lines = []
    for model in sorted({n for i in infos.values() for n in i.model_names}):
        group = find_drift(infos, model)
        for rid, fields in group.drifted.items():
            what = ", ".join(str(f) for f in fields)
            lines.append(f"drift in {model}: {rid} differs from the group in {what}")
    return lines


@fleet_app.command("describe")
def describe_cmd(
    urls: Annotated[list[str], typer.Argument(help="Replica base URLs (http://host:port).")],
    out_file: Annotated[
        Path | None, typer.Option("--out", help="Write a capture (JSON) to this file.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the capture as JSON.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds per request to a replica.")] = 5.0,
) -> None:
    """Print every replica's resolved configuration, as the replica reports it, and its drift."""
    bad = [u for u in urls if not _is_url(u)]
    if bad:
        raise ConfigError(f"not a replica URL (http:// or https://): {', '.join(bad)}")
    infos = asyncio.run(_describe_all(urls, timeout))
    text = write_capture(infos)
    if out_file is not None:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        out_file.write_text(text)
    if as_json:
        print(text, end="")
        return
    out.print(_table(infos))
    for line in _drift_lines(infos) or ["no drift"]:
        out.print(line, highlight=False)


def _pairs(a: dict[str, ReplicaInfo], b: dict[str, ReplicaInfo]) -> list[tuple[str, str]]:
    """Which replica of A compares with which of B: one each (any names), else by name."""
    if len(a) == 1 and len(b) == 1:
        return [(next(iter(a)), next(iter(b)))]
    return [(n, n) for n in sorted(set(a) | set(b))]


@fleet_app.command("diff")
def diff_cmd(
    a: Annotated[str, typer.Argument(help="A replica URL, a capture file or FILE#NAME.")],
    b: Annotated[str, typer.Argument(help="A replica URL, a capture file or FILE#NAME.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the differences as JSON.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds per request to a replica.")] = 5.0,
) -> None:
    """Compare two replicas or two captures: every field that differs (exit 1 when any does)."""
    left, right = _load(a, timeout), _load(b, timeout)
    found: list[tuple[str, str, Difference]] = []
    for na, nb in _pairs(left, right):
        if na not in left or nb not in right:
            side = "A" if na not in left else "B"
            found.append((na, nb, Difference(f"missing on side {side}", na in left, nb in right)))
            continue
        for d in diff(left[na], right[nb]):
            found.append((na, nb, d))
    if as_json:
        rows = [
            {"a": na, "b": nb, "field": d.field, "a_value": d.a, "b_value": d.b}
            for na, nb, d in found
        ]
        print(json.dumps(rows, indent=2))
    else:
        table = Table(title=escape(f"{a}  vs  {b}"))
        for col in ("A", "B", "field", "A value", "B value"):
            table.add_column(col)
        for na, nb, d in found:
            table.add_row(_cell(na), _cell(nb), _cell(d.field), _cell(d.a), _cell(d.b))
        out.print(table if found else "no differences")
    if found:
        raise typer.Exit(1)
