"""`controlplane load`: ramp traffic up and down through routers (`controlplane.loadgen`)."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from controlplane.cli import app

out = Console(stderr=True)


@app.command("load")
def load_cmd(
    url: Annotated[
        list[str], typer.Option("--url", help="Router base URL (repeatable: round-robin).")
    ],
    ramp: Annotated[
        str, typer.Option(help="T:RATE points (seconds: requests/s), linear in between.")
    ] = "0:1,60:8,120:1",
    model: Annotated[str, typer.Option(help="Model of the requests.")] = "tiny-llama",
    max_tokens: Annotated[int, typer.Option(min=1, help="max_tokens of each request.")] = 64,
    api_key: Annotated[str, typer.Option(help="Bearer API key.")] = "unused",
    max_in_flight: Annotated[int, typer.Option(min=1, help="Concurrent requests cap.")] = 256,
) -> None:
    """Send streamed chat requests at the ramp's rate; print ok/failed per replica."""
    from controlplane.loadgen import LoadConfig, Ramp, RequestRecord, run_load

    plan = Ramp.parse(ramp)
    total = len(plan.departures())
    cfg = LoadConfig(
        model=model, max_tokens=max_tokens, api_key=api_key, max_in_flight=max_in_flight
    )
    with Progress(
        TextColumn("[bold]load"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TextColumn("{task.fields[failed]} failed"), TimeElapsedColumn(), console=out,
    ) as progress:  # fmt: skip
        task = progress.add_task("load", total=total, failed=0)
        failed = 0

        def seen(rec: RequestRecord) -> None:
            nonlocal failed
            failed += not rec.ok
            progress.update(task, advance=1, failed=failed)

        result = asyncio.run(run_load(url, plan, cfg, on_record=seen))
    table = Table(title=f"{result.ok} ok, {result.failed} failed")
    for col in ("replica", "ok", "failed"):
        table.add_column(col)
    per: dict[str, list[int]] = {}
    for rec in result.records:
        row = per.setdefault(rec.replica or "-", [0, 0])
        row[0 if rec.ok else 1] += 1
    for name, (ok, bad) in sorted(per.items()):
        table.add_row(name, str(ok), str(bad))
    out.print(table)
    errors = sorted({r.error for r in result.records if r.error})
    for e in errors[:5]:
        out.print(f"[red]error:[/] {e}")
    if result.failed:
        raise typer.Exit(1)
