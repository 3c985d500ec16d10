"""`controlplane ab report`: per-arm outcomes of an A/B split, from routers' /metrics."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from controlplane.cli import app
from router.telemetry.ab_report import (
    ArmReport,
    Estimate,
    build_report,
    fetch_exposition,
    parse_samples,
    report_dict,
)

ab_app = typer.Typer(help="A/B splits of routing policies.", no_args_is_help=True)
app.add_typer(ab_app, name="ab")
out = Console(width=None if sys.stdout.isatty() else 200)


def _fmt(est: Estimate, scale: float, unit: str, digits: int) -> str:
    if est.value is None or math.isnan(est.value):
        return "—"
    text = f"{est.value * scale:.{digits}f}{unit}"
    if est.low is not None and est.high is not None:
        text += f" [{est.low * scale:.{digits}f}, {est.high * scale:.{digits}f}]"
    return text


def _ms(est: Estimate) -> str:
    return _fmt(est, 1e3, " ms", 1)


def _pct(est: Estimate) -> str:
    return _fmt(est, 100.0, "%", 1)


def report_table(reports: list[ArmReport]) -> Table:
    table = Table(title="A/B report (95% intervals in brackets)")
    for col in ("arm", "policy", "requests", "error rate", "TTFT p50", "TTFT p99", "TTFT mean"):
        table.add_column(col, justify="left" if col in ("arm", "policy") else "right")
    for col in ("TPOT p50", "TPOT p99", "prefix hit", "predicted hit"):
        table.add_column(col, justify="right")
    for r in reports:
        table.add_row(
            r.arm,
            ", ".join(r.policies) or "—",
            f"{r.requests:,}",
            _pct(r.error_rate),
            _ms(r.ttft_p50),
            _ms(r.ttft_p99),
            _ms(r.ttft_mean),
            _ms(r.tpot_p50),
            _ms(r.tpot_p99),
            _pct(r.prefix_hit_rate),
            _pct(r.predicted_hit_rate),
        )
    return table


@ab_app.command("report")
def report_cmd(
    url: Annotated[
        list[str],
        typer.Option(
            help="A router's /metrics URL (repeat to sum several; file:// for a saved page)."
        ),
    ],
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Also write the numbers to this JSON file.")
    ] = None,
    timeout: Annotated[float, typer.Option(help="Per-scrape timeout, seconds.")] = 5.0,
) -> None:
    """Requests, error rate, TTFT/TPOT quantiles and prefix hit rates per arm, with intervals."""
    pages = [parse_samples(fetch_exposition(u, timeout_s=timeout)) for u in url]
    reports = build_report(pages)
    if reports:
        out.print(report_table(reports))
    else:
        out.print("no cp_ metrics with an arm label yet (has the router served requests?)")
    if json_out is not None:
        json_out.write_text(json.dumps(report_dict(reports, url), indent=2) + "\n")
