"""`controlplane trace stats`: what a trace holds and its prefix-reuse ceiling."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console

from controlplane.cli import app
from controlplane.cli.common import build_trace
from controlplane.traces import infinite_cache_ceiling, trace_stats

trace_app = typer.Typer(help="Inspect traces.", no_args_is_help=True)
app.add_typer(trace_app, name="trace")
out = Console(width=None if sys.stdout.isatty() else 200)


@trace_app.command("stats")
def stats_cmd(
    trace: Annotated[str, typer.Argument(help="Path, 'mooncake', 'azure-code' or gen:<name>?k=v")],
    block_size: Annotated[int, typer.Option(help="Engine block size for the reuse ceiling.")] = 16,
    rate_scale: Annotated[float, typer.Option(help="Divide inter-arrival times by this.")] = 1.0,
) -> None:
    """Counts, lengths, rates and the infinite-cache prefix-reuse ceiling of a trace."""
    tr = build_trace(trace, rate_scale=rate_scale)
    stats = dict(trace_stats(tr))
    if any(r.content_ids for r in tr.requests):
        ceiling = infinite_cache_ceiling(tr, block_size)
        stats["infinite_cache_hit_rate"] = ceiling.hit_rate
    out.print_json(json.dumps(stats, default=str))
