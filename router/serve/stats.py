"""What an engine replica on Ray Serve reports about itself: `EngineStats`.

An engine deployment's replicas (deploy/engines/) return `EngineStats.to_dict()` from
`record_routing_stats()`; Serve's controller polls it every `request_routing_stats_period_s` and
hands the dict to every router as `RunningReplica.routing_stats`, where `EngineStats.from_dict`
reads it back (an empty dict, before the first poll: `None`). The fields are vLLM's own figures
(the names in comments), plus what a router needs to hash prompts and model the replica.

The dict is plain JSON-able values, so a replica in another virtual environment (vLLM's) and a
router in the ingress's agree without sharing classes. Unknown keys are ignored on read, so a
newer replica can add fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from controlplane.roofline.profile import EngineProfile, profile


@dataclass(frozen=True, slots=True)
class EngineStats:
    # "sim" | "vllm": which engine runs in the replica
    engine: str
    # the served model name (`model` in requests)
    model: str
    # the Serve replica's unique id: the replica's id in the prefix index and in decisions
    replica_id: str
    running: int = 0  # vllm:num_requests_running
    waiting: int = 0  # vllm:num_requests_waiting
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc, 0..1
    prefix_cache_queries: int = 0  # vllm:prefix_cache_queries (tokens, cumulative)
    prefix_cache_hits: int = 0  # vllm:prefix_cache_hits (tokens, cumulative)
    block_size: int = 16  # vllm:cache_config_info{block_size}
    num_gpu_blocks: int = 0  # vllm:cache_config_info{num_gpu_blocks}
    max_model_len: int = 0
    # roofline keys of the replica's hardware and model (controlplane/roofline/specs.py)
    gpu: str = "cpu"
    roofline_model: str = "tiny-llama"
    tp: int = 1
    # the engine's KV-event endpoints, connectable from other nodes (None: events off)
    kv_events: str | None = None
    kv_replay: str | None = None
    kv_topic: str = ""
    # whether the replica follows its own KV events into the shared Redis index
    kv_follower: bool = False
    # wall-clock seconds: the replica's constructor started, the engine answered; load_s between
    started_at: float = 0.0
    ready_at: float = 0.0
    load_s: float = 0.0
    # the time of this report (wall clock)
    reported_at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> EngineStats | None:
        """The stats of a replica's report; None when it has not reported yet (empty)."""
        if not raw or "replica_id" not in raw:
            return None
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})

    @property
    def prefix_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    def roofline_profile(self) -> EngineProfile:
        """The roofline profile the policies model this replica with."""
        return profile(
            self.gpu,
            self.roofline_model,
            tp=self.tp,
            block_size=self.block_size,
            num_gpu_blocks_override=self.num_gpu_blocks,
            max_model_len=self.max_model_len,
        )


__all__ = ["EngineStats"]
