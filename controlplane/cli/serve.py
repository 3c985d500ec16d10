"""`controlplane serve` (the router alone) and `controlplane up` (Redis, replicas and router)."""

from __future__ import annotations

import contextlib
import signal
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.panel import Panel
from rich.text import Text

from controlplane.cli import app
from controlplane.cli.autoscale import policy_params
from controlplane.errors import ConfigError

if TYPE_CHECKING:
    from deploy.local_autoscale import AutoscaleOptions
    from deploy.local_stack import LocalStack

err = Console(stderr=True)


def _progress(msg: str) -> None:
    err.print(Text.assemble((time.strftime("%H:%M:%S"), "dim"), " ", msg), highlight=False)


def _serve_router(settings: object, sock: socket.socket | None = None) -> None:
    """One router process (on `sock` when given: a worker of `--workers`)."""
    from router.config import RouterSettings
    from router.http.server import RouterHttpServer
    from router.telemetry import configure_logging, setup_tracing

    assert isinstance(settings, RouterSettings)
    configure_logging(settings.telemetry.json_logs, settings.telemetry.log_level)
    t = settings.telemetry
    setup_tracing(t.otel_exporter, t.service_name, otlp_endpoint=t.otlp_endpoint)
    # uvicorn with the router's connection limits (router/http/protocol.py)
    RouterHttpServer(settings, sock=sock).run()


def _run_router(settings: object, workers: int = 1) -> None:
    from router.config import RouterSettings
    from router.http.workers import run_workers

    assert isinstance(settings, RouterSettings)
    # a configured replica the guard refuses (router/fleet/urls.py) fails here, before anything
    # binds or starts: one error line, exit code 2 (each runtime checks again as it starts)
    settings.check_replicas()
    if workers == 1:
        _serve_router(settings)
        return
    code = run_workers(settings, workers, _serve_router)
    if code:
        raise typer.Exit(code)


@app.command("serve")
def serve_cmd(
    config: Annotated[
        Path | None, typer.Option(help="YAML router configuration (see deploy/).")
    ] = None,
    host: Annotated[str | None, typer.Option(help="Interface to listen on.")] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on.")] = None,
    replica: Annotated[
        list[str] | None,
        typer.Option("--replica", help="ID=URL of a replica (repeatable; replaces the file's)."),
    ] = None,
    policy: Annotated[str | None, typer.Option(help="Routing policy name.")] = None,
    redis_url: Annotated[str | None, typer.Option(help="Redis of the shared index.")] = None,
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            help="Router processes on the one port (SO_REUSEPORT); more than 1 needs redis.url, "
            "through which they share the index, quotas and fair queue.",
        ),
    ] = 1,
) -> None:
    """Run the router against configured replica URLs."""
    from controlplane.errors import ConfigError
    from router.config import load_settings

    overrides: dict[str, object] = {"host": host, "port": port}
    if replica:
        reps = []
        for item in replica:
            rid, sep, url = item.partition("=")
            if not sep or not url:
                raise ConfigError(f"--replica expects ID=URL, got {item!r}")
            reps.append({"id": rid, "url": url})
        overrides["replicas"] = reps
    if policy:
        overrides["policy"] = {"name": policy}
    if redis_url:
        overrides["redis"] = {"url": redis_url}
    _run_router(load_settings(config, **overrides), workers)


SNIPPET = """curl -s http://{host}:{port}/v1/chat/completions \\
  -H 'content-type: application/json' \\
  -d '{{"model": "{model}", "max_tokens": 16,
       "messages": [{{"role": "user", "content": "Hello!"}}]}}'

python - <<'PY'
from openai import OpenAI
client = OpenAI(base_url="http://{host}:{port}/v1", api_key="unused")
for chunk in client.chat.completions.create(
        model="{model}", messages=[{{"role": "user", "content": "Hello!"}}],
        max_tokens=16, stream=True):
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
PY"""


@app.command("up")
def up_cmd(
    replicas: Annotated[int, typer.Option(min=1, help="Simulated replicas.")] = 3,
    port: Annotated[int, typer.Option(help="Router port.")] = 8000,
    host: Annotated[str, typer.Option(help="Router interface.")] = "127.0.0.1",
    policy: Annotated[str, typer.Option(help="Routing policy name.")] = "prefix_affinity",
    no_redis: Annotated[
        bool, typer.Option("--no-redis", help="Use the in-memory index, not a private Redis.")
    ] = False,
    speed: Annotated[float, typer.Option(help="Simulated time speed-up.")] = 1.0,
    autoscale: Annotated[
        bool,
        typer.Option(
            "--autoscale",
            help="Start with --replicas and let the headroom autoscaler size the fleet: it "
            "starts and drains local replicas (deploy/local_autoscale.py).",
        ),
    ] = False,
    load_time_s: Annotated[
        float, typer.Option(min=0, help="--autoscale: seconds a new replica takes to load.")
    ] = 20.0,
    min_replicas: Annotated[
        int, typer.Option("--min", min=0, help="--autoscale: fewest replicas.")
    ] = 1,
    max_replicas: Annotated[
        int, typer.Option("--max", min=1, help="--autoscale: most replicas.")
    ] = 4,
    tick_s: Annotated[
        float, typer.Option(min=0.1, help="--autoscale: seconds between decisions.")
    ] = 2.0,
    redis_url: Annotated[
        str | None,
        typer.Option(help="--autoscale: share this Redis instead of starting a private one."),
    ] = None,
    peer_router: Annotated[
        list[str] | None,
        typer.Option(help="--autoscale: another router sharing the registry (its demand)."),
    ] = None,
    timeline: Annotated[
        Path | None,
        typer.Option(help="--autoscale: append every decision and replica event (JSON lines)."),
    ] = None,
    policy_param: Annotated[
        list[str] | None,
        typer.Option(help="--autoscale: KEY=VALUE (JSON value) headroom override, repeatable."),
    ] = None,
) -> None:
    """A private Redis, simulated vLLM replicas and the router in front; Ctrl-C or SIGTERM stops
    all (the router first drains: router/http/shutdown.py)."""
    from deploy.local_stack import LocalStack

    # SIGTERM/SIGHUP before the router serves (or after it): stop everything as Ctrl-C does;
    # while it serves, the router's own handler drains it and `_run_router` returns
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    if autoscale:
        from deploy.local_autoscale import AutoscaleOptions

        opts = AutoscaleOptions(
            load_time_s=load_time_s, min_replicas=min_replicas, max_replicas=max_replicas,
            initial_replicas=replicas, tick_s=tick_s, speed=speed,
            peer_routers=tuple(peer_router or ()), timeline=timeline,
            policy_params=policy_params(policy_param or [], strings=False),
        )  # fmt: skip
        try:
            _up_autoscaled(opts, host, port, policy, redis_url)
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
        return
    stack = LocalStack(replicas=replicas, redis=not no_redis, speed=speed, log=_progress)
    _progress(f"starting {'a private Redis and ' if not no_redis else ''}{replicas} replicas")
    try:
        _up(stack, host, port, policy)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def _up_autoscaled(
    opts: AutoscaleOptions, host: str, port: int, policy: str, redis_url: str | None
) -> None:
    import asyncio

    from deploy.local_autoscale import router_config, serve_autoscaled
    from deploy.redis_local import RedisServer, available
    from router.config import load_settings
    from router.telemetry import configure_logging

    redis: RedisServer | None = None
    try:
        if redis_url is None:
            if not available():
                raise ConfigError("--autoscale shares its fleet through Redis: install "
                                  "redis-server or pass --redis-url")  # fmt: skip
            redis = RedisServer()
            redis.start()
            redis_url = redis.url
        config = router_config(opts, redis_url=redis_url, host=host, port=port, policy=policy)
        settings = load_settings(**config)
        configure_logging(settings.telemetry.json_logs, settings.telemetry.log_level)
        _progress(f"prefix index and fleet registry: Redis at {redis_url}")
        err.print(
            Panel(
                f"controlplane load --url http://{host}:{port} --ramp 0:1,60:8,120:8,180:1\n"
                f"controlplane status --url http://{host}:{port}",
                title=f"router on http://{host}:{port} ({policy}), autoscaling "
                f"{opts.min_replicas}..{opts.max_replicas} replicas loading "
                f"{opts.load_time_s:g} s; Ctrl-C stops everything",
            )
        )
        try:
            with contextlib.suppress(KeyboardInterrupt):
                asyncio.run(serve_autoscaled(settings, opts))
            _progress("stopping")
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
    finally:
        if redis is not None:
            redis.stop()


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _up(stack: LocalStack, host: str, port: int, policy: str) -> None:
    with stack:
        # no load balancer to drain from on one machine: a signal stops accepting at once,
        # requests in flight still finish (shutdown.grace_s)
        settings = stack.router_settings(
            host=host, port=port, policy={"name": policy}, shutdown={"drain_s": 0.0}
        )
        index = f"Redis at {stack.redis_url}" if stack.redis_url else "the in-memory index"
        _progress(f"replicas ready; prefix index: {index}")
        text = SNIPPET.format(host=host, port=port, model=settings.served_model)
        err.print(
            Panel(
                text,
                title=f"router on http://{host}:{port} ({policy}); Ctrl-C stops everything",
            )
        )
        try:
            with contextlib.suppress(KeyboardInterrupt):
                _run_router(settings)
            _progress("stopping")
        finally:
            # a second signal while the stack stops must not leave processes behind
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
