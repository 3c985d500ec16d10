"""Several router processes on one port: `controlplane serve --workers N`.

    run_workers(settings, n, serve)    blocks until the workers exit

Algorithm: the parent checks the settings (several workers need `redis.url`: the prefix index,
the quotas and the fair queue are then shared in Redis, as between routers on different hosts),
then starts N worker processes (multiprocessing, spawn). Each binds its own listening socket on
host:port with SO_REUSEPORT, so the kernel spreads new connections over the workers evenly (by a
hash of the connection's addresses) with no accept lock and no hand-off between processes; each
runs the whole router (`serve(settings, socket)`: its own event loop, fleet probes, upstream
pools). Worker 0 follows the replicas' KV events into Redis as configured; the others read the
shared index only (`redis.ingest_events` off), so each event is written once. The parent waits;
SIGTERM or SIGINT is passed on to every worker, and when one worker exits the others are
stopped too (a supervisor, Kubernetes or systemd, restarts the whole router).

Per process, as with routers on different hosts: `/metrics` (a scrape reaches one worker; sum
them with a per-worker port or run one worker per pod when the autoscaler reads the demand
signal), `/admin` changes (post to each, or keep the config file the source of truth), and the
routing books (each worker sees its own in-flight requests plus the replicas' metrics).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from types import FrameType

from controlplane.errors import ConfigError
from router.config import RouterSettings

Serve = Callable[[RouterSettings, socket.socket], None]


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port that other processes may bind too (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def worker_settings(settings: RouterSettings, index: int) -> RouterSettings:
    """Worker `index`'s settings: only worker 0 follows the KV events into Redis."""
    if index == 0:
        return settings
    redis = settings.redis.model_copy(update={"ingest_events": False})
    return settings.model_copy(update={"redis": redis})


def check(settings: RouterSettings, n: int) -> None:
    if n < 1:
        raise ConfigError(f"--workers must be at least 1, not {n}")
    if n > 1 and settings.redis.url is None:
        raise ConfigError(
            "--workers > 1 needs redis.url: the workers share the prefix index, the quotas "
            "and the fair queue through Redis"
        )
    if n > 1 and settings.port == 0:
        raise ConfigError("--workers > 1 needs a fixed port (every worker binds the same one)")
    if n > 1 and settings.telemetry.metrics_port is not None:
        raise ConfigError(
            "--workers > 1 cannot share telemetry.metrics_port (each worker's /metrics is its "
            "own): run one worker per pod, or leave /metrics on the main port"
        )


def _worker(serve: Serve, settings: RouterSettings, index: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent passes SIGTERM on
    sock = reuse_port_socket(settings.host, settings.port)
    os.environ["CP_ROUTER_WORKER"] = str(index)
    serve(worker_settings(settings, index), sock)


def run_workers(settings: RouterSettings, n: int, serve: Serve) -> int:
    """Run `n` workers until they exit; returns the first non-zero exit code (0 otherwise)."""
    check(settings, n)
    # bound once here first: a port in use fails before any worker starts
    reuse_port_socket(settings.host, settings.port).close()
    ctx = multiprocessing.get_context("spawn")
    procs: list[BaseProcess] = []
    stopping = False

    def stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.is_alive() and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for i in range(n):
            p: BaseProcess = ctx.Process(
                target=_worker, args=(serve, settings, i), name=f"router-{i}"
            )
            p.start()
            procs.append(p)
        while all(p.is_alive() for p in procs) and not stopping:
            time.sleep(0.2)
        stop(signal.SIGTERM, None)
        # each worker drains and lets its in-flight requests finish (router/http/shutdown.py)
        wait_s = settings.shutdown.drain_s + settings.shutdown.grace_s + 5.0
        for p in procs:
            p.join(wait_s)
            if p.is_alive():
                p.kill()
                p.join()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    codes = [p.exitcode or 0 for p in procs]
    # a worker ended by the SIGTERM passed on exits with -15: a clean stop
    return next((c for c in codes if c not in (0, -signal.SIGTERM)), 0)


__all__ = ["check", "reuse_port_socket", "run_workers", "worker_settings"]
