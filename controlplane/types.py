"""Core domain types shared by the simulator and the live router.

All are frozen dataclasses without I/O: a routing policy is a pure function of a `RoutingRequest`,
a `FleetSnapshot` and the `PrefixMatch`es a prefix index produced, and returns a `Decision`. The
simulator builds these objects from its discrete-event model; the live router builds them from
scraped metrics and its own ledger. Neither ever holds prompt text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from controlplane.roofline.profile import EngineProfile


class Phase(StrEnum):
    """Lifecycle of a replica."""

    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"


class PriorityClass(StrEnum):
    INTERACTIVE = "interactive"
    BATCH = "batch"


class DecisionReason(StrEnum):
    """Why a policy chose a replica: a bounded metric label and a span attribute."""

    PREFIX_HIT = "prefix_hit"
    LOAD_OVERRIDE = "load_override"
    MISS_LEAST_LOADED = "miss_least_loaded"
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    PREDICTED_FINISH = "predicted_finish"
    CACHE_MATCH = "cache_match"
    SMALLEST_TREE = "smallest_tree"
    IMBALANCED = "imbalanced"
    KV_COST = "kv_cost"
    WEIGHTED_SCORE = "weighted_score"
    NO_HEALTHY_REPLICA = "no_healthy_replica"


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """What a policy may know about a request. No prompt text, only block hashes."""

    request_id: str
    prompt_tokens: int
    # chained hashes of the prompt's full blocks (block size = the engine's)
    block_hashes: tuple[int, ...] = ()
    tenant: str = "default"
    priority: PriorityClass = PriorityClass.INTERACTIVE
    model: str = ""
    adapter: str | None = None
    max_tokens: int | None = None
    # output length the predictor expects (or the true length in oracle mode)
    predicted_output_tokens: int = 0
    session_key: str | None = None
    arrival_s: float = 0.0
    # block size the hashes were computed at (the engine's)
    block_size: int = 16
    # the vLLM cache_salt the router sends (the hashes' scope); None: the body's own, untouched
    cache_salt: str | None = None
    # sequences the request runs (a completions batch's prompts x n): max_tokens is reserved
    # for each
    sequences: int = 1

    def __repr__(self) -> str:
        return (
            f"RoutingRequest(id={self.request_id}, tenant={self.tenant}, "
            f"prompt_tokens={self.prompt_tokens}, blocks={len(self.block_hashes)})"
        )


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """What a replica's `/metrics` said at the last scrape (vLLM names in comments)."""

    running: int = 0  # vllm:num_requests_running
    waiting: int = 0  # vllm:num_requests_waiting
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc, 0..1
    scraped_at_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Ledger:
    """This router's own in-flight work on one replica (it proxies the requests, so it knows)."""

    requests: int = 0
    # uncached prompt tokens of requests that have not produced their first token
    prefill_tokens: int = 0
    # all prompt tokens (cached or not) of those requests
    pending_prompt_tokens: int = 0
    # requests past their first token, and the decode tokens they are predicted to still emit
    decoding: int = 0
    decode_tokens: int = 0
    # tokens held in KV by this router's requests: their prompts (a router that counts streamed
    # tokens may add them; the simulator's routers do not see individual tokens)
    context_tokens: int = 0
    # of `requests`: sent after the last metrics scrape, so not yet visible in `EngineMetrics`
    unscraped_requests: int = 0


EMPTY_LEDGER = Ledger()


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """One replica as a router sees it: scraped engine metrics plus its own reservations."""

    replica_id: str
    profile: EngineProfile
    phase: Phase = Phase.READY
    incarnation: int = 0
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    # this router's reservations (empty when reservations are switched off)
    ledger: Ledger = EMPTY_LEDGER
    # passive health: ejected replicas are not candidates even when READY
    ejected: bool = False
    # memo for derived values (controlplane.routing.load.estimate); not part of the value
    _memo: object = field(default=None, compare=False, repr=False, hash=False)

    @property
    def routable(self) -> bool:
        return self.phase is Phase.READY and not self.ejected

    @property
    def kv_capacity_tokens(self) -> int:
        return self.profile.num_gpu_blocks * self.profile.resolved_block_size

    @property
    def block_size(self) -> int:
        return self.profile.resolved_block_size


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """Every replica a router knows, at `now`."""

    replicas: tuple[ReplicaState, ...]
    now_s: float = 0.0

    def routable(self) -> tuple[ReplicaState, ...]:
        return tuple(r for r in self.replicas if r.routable)

    def by_id(self) -> dict[str, ReplicaState]:
        return {r.replica_id: r for r in self.replicas}

    @classmethod
    def make_empty(cls, now_s: float = 0.0) -> FleetSnapshot:
        return cls(replicas=(), now_s=now_s)


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How much of a request's prefix one replica is believed to hold."""

    replica_id: str
    # leading blocks held, confirmed by a KV event or written speculatively at routing time
    matched_blocks: int
    # of those, leading blocks confirmed by KV events
    confirmed_blocks: int = 0

    @property
    def speculative(self) -> bool:
        return self.matched_blocks > self.confirmed_blocks


NO_MATCHES: Mapping[str, PrefixMatch] = {}


@dataclass(frozen=True, slots=True)
class Decision:
    """A policy's choice, the ranked alternatives and why."""

    replica_id: str | None
    reason: DecisionReason
    # every candidate, best first (the chosen one first)
    ranked: tuple[str, ...] = ()
    # policy-specific scores per replica (lower or higher is better, as the policy documents)
    scores: Mapping[str, float] = field(default_factory=dict)
    # blocks of the prompt the policy expects the chosen replica to hold
    expected_hit_blocks: int = 0

    @classmethod
    def none_healthy(cls) -> Decision:
        return cls(replica_id=None, reason=DecisionReason.NO_HEALTHY_REPLICA)
