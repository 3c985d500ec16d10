"""`controlplane indexer`: follow replicas' KV events into the shared prefix index.

    controlplane indexer --redis-url redis://127.0.0.1:6379/0 \
        --replica id=r0,events=tcp://h:5557,replay=tcp://h:5558,block_size=32,model=tiny
    controlplane indexer --config replicas.yaml --memory        # no Redis: watch the event flow

One subscriber per replica (replay on connect and on gaps, restart detection), block hashes mapped
to the project's keyed hashes, written to `RedisPrefixIndex`. A live status table on a terminal
(a summary line per interval otherwise); Ctrl-C or SIGTERM closes every socket, flushes the
index's write queue (bounded) and prints the final counters. `--metrics-port` serves the same
figures to Prometheus (controlplane/kvevents/exporter.py); `--otel-exporter` sends one span per
KV-event batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from controlplane.cli import app
from controlplane.errors import ConfigError
from controlplane.kvevents.config import (
    ReplicaSource,
    check_unique,
    load_replica_file,
    parse_replica_spec,
)
from controlplane.kvevents.exporter import IndexerMetrics
from controlplane.kvevents.service import EventIndexer, ReplicaStatus
from controlplane.prefix.protocol import AsyncPrefixIndex, PrefixIndex
from controlplane.tracing import setup_tracing

err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def status_table(rows: list[ReplicaStatus], elapsed_s: float) -> Table:
    table = Table(title=f"kv-event indexer, {elapsed_s:.0f}s", title_justify="left")
    for name in ("replica", "state", "trusted", "seq", "batches", "replayed", "gaps", "lost",
                 "restarts", "mapped", "no parent", "incarnation"):  # fmt: skip
        table.add_column(name, justify="left" if name in ("replica", "state") else "right")
    for r in rows:
        table.add_row(
            r.replica_id,
            r.state,
            "yes" if r.trusted else "[yellow]no[/]",
            str(r.applied_seq),
            str(r.batches),
            str(r.replayed),
            str(r.gaps),
            str(r.lost) if not r.lost else f"[red]{r.lost}[/]",
            str(r.restarts),
            str(r.mapped_blocks),
            str(r.skipped_unknown_parent),
            str(r.incarnation),
        )
    return table


def summary_line(rows: list[ReplicaStatus]) -> str:
    return "; ".join(
        f"{r.replica_id} {r.state}{'' if r.trusted else '(untrusted)'} seq={r.applied_seq} "
        f"batches={r.batches} gaps={r.gaps} lost={r.lost} restarts={r.restarts}"
        for r in rows
    )


def collect_sources(specs: list[str] | None, config: Path | None) -> list[ReplicaSource]:
    sources = [parse_replica_spec(s) for s in specs or ()]
    if config is not None:
        sources.extend(load_replica_file(config))
    if not sources:
        raise ConfigError("no replicas: give --replica (repeatable) or --config FILE")
    return check_unique(sources)


async def run_indexer(
    indexer: EventIndexer,
    *,
    duration_s: float,
    status_interval_s: float,
    console: Console,
    on_status: Callable[[list[ReplicaStatus]], None] | None = None,
) -> None:
    """Run until a signal (or `duration_s` > 0 elapses), showing status (and handing every
    status to `on_status`: the metrics exporter); always closes."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    installed: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    if duration_s > 0:
        loop.call_later(duration_s, stop.set)
    started = time.monotonic()
    live = (
        Live(console=console, refresh_per_second=4, transient=True) if console.is_terminal else None
    )
    try:
        indexer.start()
        with live or contextlib.nullcontext():
            while not stop.is_set():
                rows = indexer.status()
                if on_status is not None:
                    on_status(rows)
                if live is not None:
                    live.update(status_table(rows, time.monotonic() - started))
                else:
                    console.print(summary_line(rows), highlight=False)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(status_interval_s):
                        await stop.wait()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        final = indexer.status()
        await indexer.close()
    console.print(status_table(final, time.monotonic() - started))


@app.command("indexer")
def indexer_cmd(
    replica: Annotated[
        list[str] | None,
        typer.Option(
            "--replica",
            help="id=...,events=tcp://host:port,replay=tcp://host:port,topic=...,"
            "block_size=N,model=NAME (repeatable).",
        ),
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="YAML file with a list of replicas (same keys).")
    ] = None,
    redis_url: Annotated[
        str, typer.Option(envvar="CP_REDIS__URL", help="Redis holding the shared prefix index.")
    ] = "redis://127.0.0.1:6379/0",
    key_prefix: Annotated[
        str, typer.Option(help="Index key prefix (the routers' must match).")
    ] = "rtr:pidx",
    entry_ttl: Annotated[
        float, typer.Option(help="Seconds an index entry lives without a new store event.")
    ] = 600.0,
    redis_password_env: Annotated[
        str, typer.Option(help="Environment variable holding the Redis password, if any.")
    ] = "CP_REDIS__PASSWORD",
    hash_secret_env: Annotated[
        str,
        typer.Option(help="Environment variable holding the block-hash secret (routers' too)."),
    ] = "CP_HASH_SECRET",
    memory: Annotated[
        bool,
        typer.Option("--memory", help="Write to a process-local index instead of Redis."),
    ] = False,
    replay_timeout: Annotated[
        float, typer.Option(help="Seconds of silence that fail a replay request.")
    ] = 5.0,
    replay_backoff: Annotated[
        float, typer.Option(help="Seconds without replay requests after one failed.")
    ] = 30.0,
    max_mapped_blocks: Annotated[
        int, typer.Option(min=1, help="Cap of the engine-hash map per replica (LRU beyond).")
    ] = 1 << 20,
    duration: Annotated[
        float, typer.Option(help="Stop after this many seconds (0: run until Ctrl-C).")
    ] = 0.0,
    status_interval: Annotated[
        float, typer.Option(min=0.05, help="Seconds between status (and metrics) updates.")
    ] = 1.0,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            envvar="CP_INDEXER_METRICS_PORT",
            min=0,
            max=65535,
            help="Serve Prometheus /metrics (cp_kv_events_*, cp_redis_breaker_*) on this port.",
        ),
    ] = None,
    metrics_host: Annotated[
        str, typer.Option(envvar="CP_INDEXER_METRICS_HOST", help="Interface of /metrics.")
    ] = "0.0.0.0",
    otel_exporter: Annotated[
        str,
        typer.Option(
            envvar="CP_TELEMETRY__OTEL_EXPORTER",
            help="Where the per-batch spans go: none, console or otlp (the router's setting).",
        ),
    ] = "none",
    otlp_endpoint: Annotated[
        str | None,
        typer.Option(
            envvar="CP_TELEMETRY__OTLP_ENDPOINT",
            help="OTLP/HTTP traces URL for --otel-exporter otlp (else OTEL_EXPORTER_OTLP_*).",
        ),
    ] = None,
) -> None:
    """Follow replicas' KV events (ZMQ) into the shared prefix index."""
    sources = collect_sources(replica, config)
    if otel_exporter not in ("none", "console", "otlp"):
        raise ConfigError(f"unknown --otel-exporter {otel_exporter!r}: none, console or otlp")
    provider = setup_tracing(
        otel_exporter,  # type: ignore[arg-type]  # checked above
        "controlplane-indexer",
        otlp_endpoint=otlp_endpoint,
    )
    secret = os.environ.get(hash_secret_env, "").encode()
    index: PrefixIndex | AsyncPrefixIndex
    if memory:
        from controlplane.prefix.memory import InMemoryPrefixIndex

        index = InMemoryPrefixIndex(clock=time.monotonic)
    else:
        from controlplane.prefix.redis_index import RedisPrefixIndex

        index = RedisPrefixIndex(
            redis_url,
            key_prefix=key_prefix,
            entry_ttl_s=entry_ttl,
            password=os.environ.get(redis_password_env) or None,
            client_name="cp-kv-indexer",
        )
    target = "a process-local index" if memory else f"{getattr(index, 'url', redis_url)}"
    err.print(f"following {len(sources)} replica(s) into {target}; Ctrl-C stops")

    exporter = IndexerMetrics(index) if metrics_port is not None else None
    if exporter is not None and metrics_port is not None:
        port = exporter.serve(metrics_host, metrics_port)
        err.print(f"/metrics on {metrics_host}:{port}")

    async def main() -> None:
        indexer = EventIndexer(
            sources,
            index,
            secret=secret,
            replay_timeout_s=replay_timeout,
            replay_backoff_s=replay_backoff,
            max_mapped_blocks=max_mapped_blocks,
        )
        try:
            await run_indexer(
                indexer,
                duration_s=duration,
                status_interval_s=status_interval,
                console=err,
                on_status=exporter.update if exporter is not None else None,
            )
        finally:
            aclose = getattr(index, "aclose", None)
            if aclose is not None:
                await aclose(flush_timeout_s=2.0)

    try:
        asyncio.run(main())
    finally:
        if exporter is not None:
            exporter.close()
        if provider is not None:
            provider.shutdown()
    sys.stderr.flush()
