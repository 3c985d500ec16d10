"""`controlplane sim-replica`: one simulated vLLM replica behind vLLM's HTTP and ZMQ surface."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from controlplane.cli import app
from controlplane.hashing import VllmAlgo
from controlplane.sim_replica.config import KVEventsSettings, ReplicaConfig, SchedulingPolicy
from controlplane.sim_replica.faults import Faults, parse_fault_flags

READY_PREFIX = "sim-replica ready at "


def sim_replica_cmd(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, help="HTTP port (0: any free port).")] = 8000,
    model_name: Annotated[
        str, typer.Option(help="Served model name (requests' `model`, metrics' model_name).")
    ] = "tiny-llama",
    model_dir: Annotated[
        Path | None,
        typer.Option(help="Directory with tokenizer.json (+ tokenizer_config.json template)."),
    ] = None,
    gpu: Annotated[str, typer.Option(help="GPU key the step times model.")] = "cpu",
    model: Annotated[str, typer.Option(help="Model key the step times model.")] = "tiny-llama",
    tp: Annotated[int, typer.Option(min=1, help="Tensor parallel degree.")] = 1,
    block_size: Annotated[int, typer.Option(min=1, help="KV block size in tokens.")] = 32,
    num_gpu_blocks: Annotated[
        int, typer.Option(min=0, help="KV blocks (0: the profile's capacity).")
    ] = 0,
    max_num_seqs: Annotated[
        int, typer.Option(min=0, help="Max running sequences (0: vLLM's default).")
    ] = 0,
    max_num_batched_tokens: Annotated[
        int, typer.Option(min=0, help="Token budget per step (0: vLLM's default).")
    ] = 0,
    max_model_len: Annotated[int, typer.Option(min=0, help="Context length (0: the model's).")] = 0,
    long_prefill_token_threshold: Annotated[
        int,
        typer.Option(
            min=0, help="vLLM's: at most this many prompt tokens per request a step (0: off)."
        ),
    ] = 0,
    speed: Annotated[
        float, typer.Option(help="Run the roofline's step times this many times faster.")
    ] = 1.0,
    scheduling_policy: Annotated[
        str, typer.Option(help="fcfs or priority (vLLM's --scheduling-policy).")
    ] = "fcfs",
    prefix_caching_hash_algo: Annotated[
        str, typer.Option(help="sha256 (vLLM's default) or sha256_cbor.")
    ] = "sha256",
    hash_seed: Annotated[
        str | None,
        typer.Option(help="NONE_HASH seed (default: $PYTHONHASHSEED, else 'vllm-none-hash')."),
    ] = None,
    default_max_tokens: Annotated[
        int, typer.Option(min=0, help="Chat max_tokens when a request gives none (0: the rest).")
    ] = 0,
    kv_events_endpoint: Annotated[
        str, typer.Option(help="ZMQ PUB endpoint, e.g. tcp://*:5557 (empty: no KV events).")
    ] = "",
    kv_events_replay_endpoint: Annotated[
        str, typer.Option(help="ZMQ ROUTER endpoint for replay, e.g. tcp://*:5558.")
    ] = "",
    kv_events_topic: Annotated[str, typer.Option(help="Topic frame of every message.")] = "",
    kv_events_buffer_steps: Annotated[
        int, typer.Option(min=1, help="Batches kept for replay.")
    ] = 10_000,
    kv_events_legacy: Annotated[
        bool,
        typer.Option("--kv-events-legacy", help="Positional events (before vllm PR #42892)."),
    ] = False,
    admin_token: Annotated[
        str,
        typer.Option(envvar="CP_SIM_ADMIN_TOKEN", help="Bearer token for POST /_faults."),
    ] = "",
    fault: Annotated[
        list[str] | None,
        typer.Option(help="NAME[=VALUE], repeatable: see controlplane.sim_replica.faults."),
    ] = None,
    load_time_s: Annotated[
        float,
        typer.Option(
            min=0,
            help="Seconds before the replica listens (as vLLM loading its weights: connections "
            "are refused until then).",
        ),
    ] = 0.0,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "warning",
) -> None:
    """Serve a simulated vLLM replica: OpenAI API, /metrics, KV events, fault knobs."""
    from controlplane.sim_replica.server import run_replica

    faults = Faults()
    faults.update(parse_fault_flags(fault or []))
    config = ReplicaConfig(
        model_name=model_name,
        model_dir=model_dir,
        gpu=gpu,
        model=model,
        tp=tp,
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
        speed=speed,
        scheduling_policy=scheduling_policy,  # type: ignore[arg-type]  # validated by the config
        hash_algo=prefix_caching_hash_algo,  # type: ignore[arg-type]
        hash_seed=hash_seed,
        default_max_tokens=default_max_tokens,
        kv_events=KVEventsSettings(
            endpoint=kv_events_endpoint,
            replay_endpoint=kv_events_replay_endpoint,
            topic=kv_events_topic,
            buffer_steps=kv_events_buffer_steps,
            legacy=kv_events_legacy,
        ),
        admin_token=admin_token,
        faults=faults,
    )

    def ready(url: str) -> None:
        print(f"{READY_PREFIX}{url}", flush=True)

    run_replica(config, host, port, log_level=log_level, on_ready=ready, load_time_s=load_time_s)


app.command("sim-replica")(sim_replica_cmd)

__all__ = ["READY_PREFIX", "SchedulingPolicy", "VllmAlgo", "sim_replica_cmd"]
