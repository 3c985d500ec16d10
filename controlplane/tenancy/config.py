"""The fair queue's settings, one model for both hosts.

The live router reads them as its `fairness:` section (`router.config.RouterSettings`), the
simulator as `FleetConfig.fairness`: a replay of a router configuration queues, gates and
charges exactly as the router does. The last group (`shared` ... `router_ttl_s`) only matters to
several routers sharing one queue in Redis; `charge_interval_s` only to the simulator, which
charges decode tokens in sweeps where a router charges them as they stream.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from controlplane.routing.config import Section

FairnessMode = Literal["off", "request", "vtc", "vtc-roofline"]


class FairnessConfig(Section):
    """How the router-side tenant queue orders, gates and charges requests."""

    mode: FairnessMode = Field(
        default="vtc-roofline",
        description="How the router's queue orders tenants: off (no queue: every request is "
        "sent at once), request (FIFO across tenants), vtc (virtual token counters, tokens), "
        "vtc-roofline (counters in roofline work units: decode cost grows with context).",
    )
    max_queued_total: int = Field(
        default=4096, ge=1, description="Requests waiting in the router at most (503 beyond)."
    )
    batch_kv_share: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Share of each replica's KV the batch class may hold (prompt + predicted "
        "output reserved per request); None: sized with the roofline so the interactive TPOT "
        "p99 stays within interactive_tpot_slowdown of interactive alone, from the load the "
        "queue measures (controlplane.tenancy.classes).",
    )
    interactive_tpot_slowdown: float = Field(
        default=1.2,
        gt=1,
        description="The interactive TPOT p99 the batch KV share is sized for, as a multiple of "
        "the interactive load's own TPOT (used when batch_kv_share is None).",
    )
    slots_per_replica: int | None = Field(
        default=None,
        ge=1,
        description="Concurrent requests per replica; None: the lowest of the roofline's three "
        "concurrency ceilings at the mean reserved context.",
    )
    mean_context_tokens: int = Field(
        default=2048,
        ge=1,
        description="Context per sequence the ceilings assume where the queue holds no request "
        "on a replica yet (and for the fleet's slot count shared with other routers).",
    )
    headroom: float = Field(
        default=0.1,
        ge=0,
        lt=1,
        description="The last share of each replica's slots and KV that only tenants holding at "
        "most their weighted share of the fleet's KV may fill.",
    )
    prefill_steps: float = Field(
        default=2.0,
        ge=0,
        description="Prompt tokens per step a replica may hold ahead of a new request's first "
        "chunk, in steps of its token budget (max_num_batched_tokens); 0: no prefill gate.",
    )
    long_prefills: int = Field(
        default=1,
        ge=0,
        description="Prompts longer than the replica's long_prefill_token_threshold that may "
        "prefill at once on a replica (vLLM's max_long_partial_prefills); 0: no limit.",
    )
    charge_interval_s: float = Field(
        default=0.1,
        gt=0,
        description="Simulator only: how often decode tokens are charged while tenants contend.",
    )
    # several routers: the queue's state in Redis (router/fairness/shared.py)
    shared: bool = Field(
        default=True,
        description="With redis.url: counters, backlog and slots shared by every router in "
        "Redis, so the routers act as one queue; False: each router is fair on its own.",
    )
    key_prefix: str = Field(
        default="cp:fair", description="Redis key prefix of the shared queue (+ served model)."
    )
    shared_timeout_ms: float = Field(
        default=25.0, gt=0, description="Budget of one Redis call; 3 failures in a row: local."
    )
    heartbeat_s: float = Field(
        default=0.25, gt=0, description="A router's call period while nothing waits in it."
    )
    router_ttl_s: float = Field(
        default=1.5,
        gt=0,
        description="A router silent this long is dead: its backlog and slots are swept.",
    )

    @model_validator(mode="after")
    def _ttl_above_heartbeat(self) -> FairnessConfig:
        if self.router_ttl_s < 2 * self.heartbeat_s:
            raise ValueError("fairness.router_ttl_s must be at least 2 x heartbeat_s")
        return self


__all__ = ["FairnessConfig", "FairnessMode"]
