"""Settings of one simulated replica: what it pretends to be and how it publishes KV events."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from controlplane.errors import ConfigError
from controlplane.hashing import DEFAULT_VLLM_SEED, VllmAlgo
from controlplane.roofline.profile import EngineProfile, profile
from controlplane.sim_replica.faults import Faults

SchedulingPolicy = Literal["fcfs", "priority"]


def default_hash_seed() -> str:
    """vLLM's NONE_HASH seed: the process's `PYTHONHASHSEED` string, else "vllm-none-hash"."""
    return os.environ.get("PYTHONHASHSEED") or DEFAULT_VLLM_SEED


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's `_is_bind_endpoint`: bind for wildcards and local transports, else connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


@dataclass(frozen=True, slots=True)
class KVEventsSettings:
    """vLLM's `KVEventsConfig` for the ZMQ publisher (empty endpoint: events off)."""

    endpoint: str = ""
    # ROUTER socket answering replay requests (always bound, as vLLM does); empty: no replay
    replay_endpoint: str = ""
    topic: str = ""
    # batches kept for replay
    buffer_steps: int = 10_000
    # PUB send high-water mark (messages beyond it are dropped, as ZMQ PUB does)
    hwm: int = 100_000
    # the positional event encoding of releases before vllm PR #42892
    legacy: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """Everything `controlplane sim-replica` takes on its command line."""

    # the served model name (`model` in requests, `id` in /v1/models, the metrics' model_name)
    model_name: str = "tiny-llama"
    # tokenizer.json + tokenizer_config.json; None: the byte-level fallback tokenizer
    model_dir: Path | None = None
    # roofline keys: the GPU class and model the step times are computed for
    gpu: str = "cpu"
    model: str = "tiny-llama"
    tp: int = 1
    block_size: int = 32
    # 0: the profile's KV capacity
    num_gpu_blocks: int = 0
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    # 0: the model's context length
    max_model_len: int = 0
    # vLLM's --long-prefill-token-threshold: at most this many prompt tokens a step per request
    # (0: off)
    long_prefill_token_threshold: int = 0
    # wall step time = roofline step time / speed
    speed: float = 1.0
    scheduling_policy: SchedulingPolicy = "fcfs"
    hash_algo: VllmAlgo = "sha256"
    # None: default_hash_seed() when the server starts
    hash_seed: str | None = None
    # max_tokens of chat requests that give none (0: vLLM's max_model_len - prompt)
    default_max_tokens: int = 0
    kv_events: KVEventsSettings = field(default_factory=KVEventsSettings)
    # the token `POST /_faults` wants (Authorization: Bearer ...); empty: the endpoint is off
    admin_token: str = ""
    # faults switched on at start
    faults: Faults = field(default_factory=Faults)

    def __post_init__(self) -> None:
        if self.speed <= 0:
            raise ConfigError("--speed must be positive")
        if self.hash_algo not in get_args(VllmAlgo):
            raise ConfigError(
                f"--prefix-caching-hash-algo must be one of {get_args(VllmAlgo)}, "
                f"got {self.hash_algo!r}"
            )
        if self.scheduling_policy not in get_args(SchedulingPolicy):
            raise ConfigError(f"unknown scheduling policy {self.scheduling_policy!r}")
        if self.model_dir is not None and not self.model_dir.is_dir():
            raise ConfigError(f"--model-dir {self.model_dir} is not a directory")

    @property
    def resolved_hash_seed(self) -> str:
        return self.hash_seed if self.hash_seed is not None else default_hash_seed()

    @property
    def root(self) -> str:
        """The model path `/v1/models` reports as `root`."""
        return str(self.model_dir) if self.model_dir is not None else self.model_name

    def build_profile(self) -> EngineProfile:
        """The roofline profile; refuses a context the KV cache cannot hold, as vLLM does."""
        prof = profile(
            self.gpu,
            self.model,
            tp=self.tp,
            block_size=self.block_size,
            num_gpu_blocks_override=self.num_gpu_blocks,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
        )
        usable = (prof.num_gpu_blocks - 1) * prof.resolved_block_size
        if prof.resolved_max_model_len > usable:
            raise ConfigError(
                f"max_model_len {prof.resolved_max_model_len} needs more KV cache than "
                f"{prof.num_gpu_blocks} blocks of {prof.resolved_block_size} tokens hold "
                f"({usable} tokens); raise --num-gpu-blocks or lower --max-model-len"
            )
        return prof
