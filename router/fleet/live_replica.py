"""One replica of the live fleet: its client, health, last metrics and roofline profile.

Mutable, owned by `router.fleet.live_fleet.LiveFleet`, which does every probe and scrape and sets
the fields below; the proxy borrows `upstream` (probes and scrapes use `client`). `phase` is
computed from the flags, in this order:

    removed, or DOWN (consecutive failed probes)     -> DEAD
    drain() called                                   -> DRAINING
    good probe + good scrape since (re)starting      -> READY
    otherwise                                        -> LOADING

The profile is `router.fleet.profiles.resolve_profile`'s: from the model's config.json and the
model group's GPU kind once the replica described itself (settings `models`), else the legacy
GPU and model keys of its config; with the KV block size and block count of the config, else of
`vllm:cache_config_info` (else the roofline's defaults). A configured value the replica
contradicts is kept (the config wins) and reported in `status()`. A profile that cannot be built
(`profile_error`) keeps the replica LOADING.
`state()` reuses its last `ReplicaState` while nothing in it changed, so memoized load estimates
survive between snapshots.

Self-description (`controlplane.replica_info`): `info` is what the replica said about itself at
join (served models and their `max_model_len`, cache layout, version), read again after every
restart. A replica that cannot describe itself (no `/v1/models`) is routed as configured:
`describe_error` says why, and `described(default_model)` stands in with what the scrape shows
and the router's configured `served_model`. `drift` is set by the fleet (`router.fleet.groups`).
"""

from __future__ import annotations

import asyncio
import math

import httpx

from controlplane.drift import DriftField
from controlplane.errors import ConfigError
from controlplane.metrics_scrape import ScrapedMetrics
from controlplane.replica_info import ReplicaInfo, ServedModel
from controlplane.roofline.profile import EngineProfile
from controlplane.types import EngineMetrics, Ledger, Phase, ReplicaState
from router.config import ModelGroupConfig, ReplicaConfig
from router.fleet.health import Liveness, ReplicaHealth, restart_signal
from router.fleet.profiles import ProfileSource, resolve_profile
from router.http.h1 import H1Pool
from router.http.upstream import HttpxPool, UpstreamPool

# the proxy streams many requests at once to one replica: no pool cap, a warm keep-alive set
# idle connections are dropped after 2 s: servers (uvicorn, so vLLM) close theirs after 5 s, and
# a request written on a connection the server is closing fails as a reset that cannot be retried
POOL_LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0)


class LiveReplica:
    """One configured replica as the live router knows it."""

    def __init__(
        self,
        config: ReplicaConfig,
        *,
        connect_s: float,
        transport: httpx.AsyncBaseTransport | None = None,
        model_groups: tuple[ModelGroupConfig, ...] = (),
    ) -> None:
        self.config = config
        self.replica_id = config.id
        self.url = config.url.rstrip("/")
        self.model_groups = model_groups
        self.profile: EngineProfile
        self.profile_source: ProfileSource
        self.profile, self.profile_source = resolve_profile(
            config,
            None,
            model_groups,
            block_size=config.block_size,
            num_gpu_blocks=config.num_gpu_blocks,
        )
        self.client = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(None, connect=connect_s),
            limits=POOL_LIMITS,
            transport=transport,
        )
        # the proxy's client: the lean HTTP/1.1 pool, or `client` itself when a transport was
        # given (tests) or the replica is not plain http://
        self.upstream: UpstreamPool
        if transport is None and self.url.startswith("http://"):
            self.upstream = H1Pool(
                self.url,
                connect_s=connect_s,
                max_idle=POOL_LIMITS.max_keepalive_connections or 64,
                idle_expiry_s=POOL_LIMITS.keepalive_expiry or 2.0,
            )
        else:
            self.upstream = HttpxPool(self.client)
        self.health = ReplicaHealth()
        self.incarnation = 0
        self.metrics = EngineMetrics()
        # cumulative engine counters (tokens) of the last scrape
        self.prefix_hits = 0.0
        self.prefix_queries = 0.0
        self.block_size: int | None = config.block_size
        self.num_gpu_blocks: int | None = config.num_gpu_blocks
        self.reported: tuple[int | None, int | None] = (None, None)
        self.model_names: tuple[str, ...] = ()
        # what the replica said about itself (None: not yet, or it cannot), and its drift
        self.info: ReplicaInfo | None = None
        self.describe_error: str | None = None
        self.next_describe_s = -math.inf
        self.drift: tuple[DriftField, ...] = ()
        self.cache_flags: tuple[bool | None, str | None] = (None, None)
        self.draining = False
        self.removed = False
        # a good scrape since the replica came up (or came back), and admitted to READY
        self.scraped = False
        self.ready = False
        self.profile_error: str | None = None
        self.last_error: str | None = None
        self.scrape_failures = 0
        # restart detection: (prefix-cache queries, start marker) of the last scrape
        self.restart_baseline: tuple[float, float | None] | None = None
        # schedule (clock times): starts of the last probe, results applied, next due
        self.last_probe_s = -math.inf
        self.probe_applied_s = -math.inf
        self.scrape_applied_s = -math.inf
        self.next_probe_s = -math.inf
        self.next_scrape_s = -math.inf
        self.probe_task: asyncio.Task[None] | None = None
        self.scrape_task: asyncio.Task[None] | None = None
        self._state: ReplicaState | None = None
        self._state_key: tuple[object, ...] = ()

    @property
    def phase(self) -> Phase:
        if self.removed or self.health.liveness is Liveness.DOWN:
            return Phase.DEAD
        if self.draining:
            return Phase.DRAINING
        return Phase.READY if self.ready else Phase.LOADING

    @property
    def ejected_until(self) -> float:
        """Earliest re-admission time; an ejected replica stays out past it until a probe
        succeeds (`health.ejected`)."""
        return self.health.ejected_until

    def routable(self, now: float) -> bool:
        return self.phase is Phase.READY and not self.health.is_ejected(now)

    def came_back(self, now: float) -> None:
        """It was DOWN and answers again: a new process, to learn afresh before routing to it
        (scrapes started before `now` are stale)."""
        self.ready = self.scraped = False
        self.restart_baseline = None
        self.forget_description()
        self.scrape_applied_s = now
        self.next_scrape_s = now

    def forget_description(self) -> None:
        """A new process may be a new configuration (an upgrade): ask it again."""
        self.info = None
        self.describe_error = None
        self.next_describe_s = -math.inf

    def take_description(self, info: ReplicaInfo) -> None:
        """What the replica said about itself; the profile follows it (settings `models`)."""
        self.info, self.describe_error = info, None
        self._rebuild_profile()

    def _rebuild_profile(self) -> None:
        try:
            self.profile, self.profile_source = resolve_profile(
                self.config,
                self.info,
                self.model_groups,
                block_size=self.block_size,
                num_gpu_blocks=self.num_gpu_blocks,
            )
            self.profile_error = None
        except ConfigError as exc:
            self.profile_error = (
                f"profile for block size {self.block_size}, {self.num_gpu_blocks} blocks: {exc}"
            )
            self.ready = False

    def described(self, default_model: str) -> ReplicaInfo:
        """Its description, or, while it has none, what its scrape shows under `default_model`
        (the router's configured served model)."""
        if self.info is not None:
            return self.info
        return ReplicaInfo(
            url=self.url,
            models=(ServedModel(default_model, None),),
            block_size=self.block_size,
            num_gpu_blocks=self.num_gpu_blocks,
            enable_prefix_caching=self.cache_flags[0],
            prefix_caching_hash_algo=self.cache_flags[1],
        )

    def take_scrape(self, scraped: ScrapedMetrics, marker: float | None) -> str | None:
        """Take one scrape's values; returns why it shows a restart, or None."""
        base = self.restart_baseline
        why = None
        if base is not None:
            why = restart_signal(base[0], scraped.prefix_cache_queries, base[1], marker)
            if marker is None:
                marker = base[1]  # keep the baseline while the marker is missing
        self.restart_baseline = (scraped.prefix_cache_queries, marker)
        self.scraped = True
        self._apply_metrics(scraped)
        return why

    def _apply_metrics(self, scraped: ScrapedMetrics) -> None:
        self.metrics = scraped.engine
        self.prefix_hits = scraped.prefix_cache_hits
        self.prefix_queries = scraped.prefix_cache_queries
        self.model_names = scraped.model_names
        cache = scraped.cache
        if cache is None:
            return
        self.reported = (cache.block_size, cache.num_gpu_blocks)
        self.cache_flags = (cache.enable_prefix_caching, cache.prefix_caching_hash_algo)
        block_size = self.config.block_size or cache.block_size
        blocks = self.config.num_gpu_blocks or cache.num_gpu_blocks
        if (block_size, blocks) == (self.block_size, self.num_gpu_blocks):
            return
        self.block_size, self.num_gpu_blocks = block_size, blocks
        self._rebuild_profile()

    def state(self, ledger_view: Ledger, now: float) -> ReplicaState:
        ejected = self.health.is_ejected(now)
        phase = self.phase
        key = (ledger_view, phase, self.incarnation, self.metrics, ejected, self.profile)
        if self._state is not None and key == self._state_key:
            return self._state
        self._state_key = key
        self._state = ReplicaState(
            replica_id=self.replica_id,
            profile=self.profile,
            phase=phase,
            incarnation=self.incarnation,
            metrics=self.metrics,
            ledger=ledger_view,
            ejected=ejected,
        )
        return self._state

    def status(self, now: float, in_flight: int) -> dict[str, object]:
        """A JSON-able row for GET /admin/replicas."""
        h = self.health
        ejected = h.is_ejected(now)
        warnings = [
            f"configured {name} {mine} but the replica reports {theirs}"
            for name, mine, theirs in (
                ("block_size", self.config.block_size, self.reported[0]),
                ("num_gpu_blocks", self.config.num_gpu_blocks, self.reported[1]),
            )
            if mine is not None and theirs is not None and mine != theirs
        ]
        return {
            "id": self.replica_id,
            "url": self.url,
            "phase": str(self.phase),
            "routable": self.routable(now),
            "incarnation": self.incarnation,
            "liveness": str(h.liveness),
            "ejected": ejected,
            "eject_reason": str(h.eject_reason) if ejected and h.eject_reason else None,
            "ejected_for_s": round(max(0.0, h.ejected_until - now), 3) if ejected else None,
            "strikes": h.strikes,
            "failures": h.failures,
            "probe_failures": h.probe_failures,
            "scrape_failures": self.scrape_failures,
            "in_flight": in_flight,
            "running": self.metrics.running,
            "waiting": self.metrics.waiting,
            "kv_usage": self.metrics.kv_usage,
            "scraped_at_s": self.metrics.scraped_at_s,
            "prefix_hits": self.prefix_hits,
            "prefix_queries": self.prefix_queries,
            "block_size": self.block_size,
            "num_gpu_blocks": self.profile.num_gpu_blocks,
            "profile": self.profile.label,
            "profile_source": str(self.profile_source),
            "models": list(self.info.model_names if self.info else self.model_names),
            "description": self.info.to_json() if self.info else None,
            "description_error": self.describe_error,
            "drift": [str(f) for f in self.drift],
            "last_error": self.profile_error or self.last_error,
            "warnings": warnings,
        }
