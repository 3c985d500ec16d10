"""The live router's fleet: pure health decisions (tables), then `LiveFleet` against fake replicas
speaking the real protocol (`/health`, vLLM's `/metrics` exposition) through an
`httpx.MockTransport`, with a fake clock."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest

from controlplane.drift import DriftField
from controlplane.errors import ConfigError, UnknownReplicaError
from controlplane.routing.ledger import RouterLedger
from controlplane.types import Phase
from router.config import HealthConfig, ReplicaConfig, RouterSettings
from router.fleet.health import (
    EjectReason,
    FailureReason,
    Liveness,
    ProbeOutcome,
    ReplicaHealth,
    SlowReason,
    eject_duration_s,
    may_eject_for_slowness,
    next_strikes,
    probe_due,
    restart_signal,
    start_marker,
)
from router.fleet.live_fleet import LiveFleet

INF = math.inf


# -- pure decisions -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("members", "unavailable", "fraction", "allowed"),
    [
        (4, 0, 0.5, True),
        (4, 1, 0.5, True),
        (4, 2, 0.5, False),
        (3, 0, 0.5, True),
        (3, 1, 0.5, False),
        (2, 0, 0.5, True),
        (1, 0, 0.5, False),  # never the last replica
        (0, 0, 0.5, False),
        (5, 1, 0.4, True),
        (5, 2, 0.4, False),
        (10, 0, 0.0, False),
        (10, 9, 1.0, True),
        (10, 10, 1.0, False),
    ],
)
def test_may_eject_for_slowness(
    members: int, unavailable: int, fraction: float, allowed: bool
) -> None:
    assert may_eject_for_slowness(members, unavailable, fraction) is allowed


@pytest.mark.parametrize(
    ("strikes", "base", "cap", "expected"),
    [(0, 15, 300, 15), (1, 15, 300, 15), (2, 15, 300, 30), (3, 15, 300, 60), (5, 15, 300, 240),
     (6, 15, 300, 300), (500, 15, 300, 300), (3, 15, 5, 15)],
)  # fmt: skip
def test_eject_duration_doubles_and_caps(
    strikes: int, base: float, cap: float, expected: float
) -> None:
    assert eject_duration_s(strikes, base, cap) == expected


@pytest.mark.parametrize(
    ("strikes", "readmitted_at", "now", "quiet", "expected"),
    [(0, -INF, 0.0, 300, 1), (1, 10.0, 100.0, 300, 2), (3, 10.0, 309.0, 300, 4),
     (3, 10.0, 310.0, 300, 1)],
)  # fmt: skip
def test_next_strikes_reset_after_a_quiet_period(
    strikes: int, readmitted_at: float, now: float, quiet: float, expected: int
) -> None:
    assert next_strikes(strikes, readmitted_at, now, quiet) == expected


@pytest.mark.parametrize(
    ("next_probe", "ejected", "until", "last_probe", "due"),
    [(10.0, False, 5.0, 0.0, 10.0), (10.0, True, 5.0, 0.0, 5.0), (10.0, True, 5.0, 6.0, 10.0),
     (10.0, True, 20.0, 0.0, 10.0)],
)  # fmt: skip
def test_probe_due_when_an_ejection_expires(
    next_probe: float, ejected: bool, until: float, last_probe: float, due: float
) -> None:
    assert probe_due(next_probe, ejected, until, last_probe) == due


@pytest.mark.parametrize(
    ("prev_q", "q", "prev_start", "start", "why"),
    [(None, 5.0, None, None, None), (100.0, 50.0, None, None, "counter_reset"),
     (100.0, 100.0, 1.0, 1.0, None), (100.0, 200.0, 1.0, 2.0, "start_time"),
     (100.0, 200.0, 2.0, 1.0, None), (100.0, 50.0, 1.0, None, "counter_reset"),
     (100.0, 150.0, None, 7.0, None)],
)  # fmt: skip
def test_restart_signal(
    prev_q: float | None, q: float, prev_start: float | None, start: float | None, why: str | None
) -> None:
    assert restart_signal(prev_q, q, prev_start, start) == why


@pytest.mark.parametrize(
    ("text", "marker"),
    [
        ("process_start_time_seconds 1700.5\nvllm:x_created 1800.0\n", 1700.5),
        ('vllm:a_created{engine="0"} 1800.0\nvllm:b_created{engine="0"} 1790.25\n', 1790.25),
        ("# HELP process_start_time_seconds x\nvllm:num_requests_running 3.0\n", None),
        ("", None),
        ('vllm:a_created{model_name="a b"} 12.0\nvllm:b_created NaN\n', 12.0),
    ],
)
def test_start_marker(text: str, marker: float | None) -> None:
    assert start_marker(text) == marker


@pytest.mark.parametrize(
    ("probes", "outcomes", "liveness"),
    [
        ("fff", ["none"] * 3, Liveness.UNKNOWN),  # never up: loading, not dead
        ("tfff", ["first_up", "none", "none", "went_down"], Liveness.DOWN),
        ("tfffft", ["first_up", "none", "none", "went_down", "none", "came_back"], Liveness.UP),
        ("tfft", ["first_up", "none", "none", "none"], Liveness.UP),
    ],
)
def test_probe_state_machine(probes: str, outcomes: list[str], liveness: Liveness) -> None:
    h = ReplicaHealth()
    seen = [str(h.on_probe(p == "t", float(i), threshold=3)) for i, p in enumerate(probes)]
    assert (seen, h.liveness) == (outcomes, liveness)


def test_ejection_ends_only_with_a_good_probe_after_it_expires() -> None:
    h = ReplicaHealth()
    h.on_probe(True, 0.0, 3)
    assert h.eject(1.0, EjectReason.TTFT, base_s=10, max_s=100) == 10
    assert h.on_probe(True, 5.0, 3) is ProbeOutcome.NONE and h.is_ejected(5.0)
    assert h.on_probe(False, 12.0, 3) is ProbeOutcome.NONE and h.is_ejected(12.0)
    assert h.on_probe(True, 13.0, 3) is ProbeOutcome.READMITTED and not h.is_ejected(13.0)
    assert h.eject(14.0, EjectReason.IDLE, base_s=10, max_s=100) == 20  # doubled
    # hard failures: count in a row, a success resets
    h2 = ReplicaHealth()
    assert [h2.on_failure(3) for _ in range(2)] == [False, False]
    h2.on_success()
    assert [h2.on_failure(3) for _ in range(3)] == [False, False, True]


# -- fake replicas --------------------------------------------------------------------------------
class FakeClock:
    """Stands still unless a test moves it; `ticking` ones move on by `tick` at every read (the
    background schedule needs time to pass)."""

    def __init__(self, tick: float = 0.0) -> None:
        self.t = 100.0
        self.tick = tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t


@dataclass
class Fake:
    """One replica's behaviour: what its /health and /metrics answer."""

    health: str = "ok"  # ok | 503 | refuse | hang
    metrics_status: int = 200
    running: int = 2
    waiting: int = 1
    kv: float = 0.25
    queries: float = 1000.0
    hits: float = 400.0
    block_size: int = 32
    blocks: int = 1000
    created: float | None = 1.7e9  # None: no `_created` samples
    hits_seen: list[str] = field(default_factory=list)

    def exposition(self) -> str:
        lab = 'engine="0",model_name="tiny-llama"'
        text = self._exposition(lab)
        if self.created is None:
            text = "\n".join(line for line in text.splitlines() if "_created" not in line)
        return text

    def _exposition(self, lab: str) -> str:
        created = self.created or 0.0
        return f"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{lab}}} {self.running}.0
vllm:num_requests_running{{engine="0",model_name="other-model"}} 99.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{lab}}} {self.waiting}.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{{lab}}} {self.kv}
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{{lab}}} {self.queries}
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{{{lab}}} {created!r}
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{{lab}}} {self.hits}
# HELP vllm:prefix_cache_hits_created Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_created gauge
vllm:prefix_cache_hits_created{{{lab}}} {created + 0.001!r}
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="{self.block_size}",enable_prefix_caching="True",engine="0",\
num_gpu_blocks="{self.blocks}",prefix_caching_hash_algo="sha256"}} 1.0
"""


class Fleet:
    """Fake replicas behind one MockTransport, and the LiveFleet under test."""

    def __init__(self, n: int = 2, *, tick: float = 0.0, **health: float) -> None:
        self.clock = FakeClock(tick)
        self.fakes = {f"r{i}": Fake() for i in range(n)}
        # seconds a /metrics response takes on the fake clock
        self.metrics_latency = 0.0
        self.ledger = SpyLedger()
        cfg = {"consecutive_failures": 3, "eject_s": 10.0, "eject_max_s": 100.0, **health}
        self.settings = RouterSettings(
            served_model="tiny-llama",
            replicas=[ReplicaConfig(id=rid, url=f"http://{rid}:8000") for rid in self.fakes],
            health=HealthConfig.model_validate(cfg),
        )
        self.fleet = LiveFleet(
            self.settings,
            ledger=self.ledger,
            clock=self.clock,
            transport=httpx.MockTransport(self.handle),
        )

    async def handle(self, request: httpx.Request) -> httpx.Response:
        fake = self.fakes[request.url.host]
        fake.hits_seen.append(request.url.path)
        if request.url.path == "/health":
            if fake.health == "refuse":
                raise httpx.ConnectError("connection refused", request=request)
            if fake.health == "hang":
                await asyncio.Event().wait()
            return httpx.Response(200 if fake.health == "ok" else 503)
        if request.url.path == "/metrics":
            self.clock.t += self.metrics_latency
            if fake.metrics_status != 200:
                return httpx.Response(fake.metrics_status)
            return httpx.Response(200, text=fake.exposition())
        return httpx.Response(404)

    def phases(self) -> dict[str, Phase]:
        return {r.replica_id: r.phase for r in self.fleet.snapshot().replicas}

    def routable(self) -> set[str]:
        return {r.replica_id for r in self.fleet.snapshot().routable()}


class SpyLedger(RouterLedger):
    def __init__(self) -> None:
        super().__init__()
        self.scrapes: list[tuple[str, float]] = []

    def scraped(self, replica_id: str, now_s: float) -> None:
        self.scrapes.append((replica_id, now_s))
        super().scraped(replica_id, now_s)


@pytest.fixture
async def env() -> AsyncIterator[Fleet]:
    f = Fleet()
    yield f
    await f.fleet.aclose()


async def make(n: int, **health: float) -> Fleet:
    f = Fleet(n, **health)
    await f.fleet.refresh()
    return f


# -- LiveFleet: lifecycle -------------------------------------------------------------------------
async def test_loading_until_a_good_probe_and_a_good_scrape(env: Fleet) -> None:
    assert env.phases() == {"r0": Phase.LOADING, "r1": Phase.LOADING}
    assert env.fleet.block_size() is None and env.fleet.ready_count() == 0
    env.fakes["r0"].metrics_status = 500
    env.fakes["r1"].health = "refuse"
    for _ in range(5):  # refused many times but never up: still loading, not dead
        await env.fleet.refresh()
    assert env.phases() == {"r0": Phase.LOADING, "r1": Phase.LOADING}
    env.fakes["r0"].metrics_status = 200
    env.fakes["r1"].health = "ok"
    await env.fleet.refresh()
    assert env.phases() == {"r0": Phase.READY, "r1": Phase.READY}
    assert env.routable() == {"r0", "r1"} and env.fleet.ready_count() == 2
    assert env.fleet.block_size() == 32
    st = env.fleet.snapshot().by_id()["r0"]
    assert (st.block_size, st.profile.num_gpu_blocks, st.kv_capacity_tokens) == (32, 1000, 32_000)
    assert st.incarnation == 0 and not st.ejected


async def test_a_scrape_sets_metrics_counters_and_the_ledger_at_its_start(env: Fleet) -> None:
    env.metrics_latency = 1.0
    env.ledger.reserve("q1", "r0", 100, 100, 10, now_s=50.0)
    await env.fleet.refresh()
    r0 = env.fleet.get("r0")
    # the only series of the served model count (another model's 99 running are ignored)
    assert (r0.metrics.running, r0.metrics.waiting, r0.metrics.kv_usage) == (2, 1, 0.25)
    assert (r0.prefix_queries, r0.prefix_hits) == (1000.0, 400.0)
    # two scrapes started at 100 and (after the first response) 101, one per replica
    assert sorted(t for _, t in env.ledger.scrapes) == [100.0, 101.0]
    started = dict(env.ledger.scrapes)
    assert r0.metrics.scraped_at_s == started["r0"]
    assert env.ledger.view("r0").unscraped_requests == 0
    env.ledger.reserve("q2", "r0", 100, 100, 10, now_s=env.clock.t)
    assert env.ledger.view("r0").unscraped_requests == 1
    env.fakes["r0"].running = 7
    await env.fleet.refresh()
    assert env.fleet.snapshot().by_id()["r0"].metrics.running == 7
    assert env.ledger.view("r0").unscraped_requests == 0


async def test_block_size_and_blocks_from_config_win_and_disagreement_is_drift() -> None:
    f = Fleet(3)
    cfgs = [
        ReplicaConfig(id="c0", url="http://r0:8000", block_size=32, num_gpu_blocks=500),
        ReplicaConfig(id="c1", url="http://r1:8000"),
    ]
    f.fleet = LiveFleet(
        RouterSettings(replicas=cfgs), clock=f.clock, transport=httpx.MockTransport(f.handle)
    )
    f.fakes["r1"].block_size = 16
    await f.fleet.refresh()
    try:
        c0, c1 = f.fleet.get("c0"), f.fleet.get("c1")
        assert (c0.block_size, c0.profile.num_gpu_blocks, c0.phase) == (32, 500, Phase.READY)
        row = next(r for r in f.fleet.status() if r["id"] == "c0")
        assert row["warnings"] == ["configured num_gpu_blocks 500 but the replica reports 1000"]
        # one group, one block size: the replica reporting 16 is admitted but drifted (a tie
        # goes to the smallest id's configuration), so the router keeps it out of affinity
        assert (c1.block_size, c1.phase, c1.drift) == (16, Phase.READY, (DriftField.BLOCK_SIZE,))
        group = f.fleet.groups.get("tiny-llama")
        assert group is not None and group.affinity_excluded == {"c1"}
        assert f.fleet.block_size("tiny-llama") == 32
        row = next(r for r in f.fleet.status() if r["id"] == "c1")
        assert row["drift"] == ["block_size"]
        f.fakes["r1"].block_size = 32
        await f.fleet.refresh()
        assert (c1.phase, c1.drift, group.model) == (Phase.READY, (), "tiny-llama")
        assert f.fleet.groups.drift_of() == {}
    finally:
        await f.fleet.aclose()


# -- passive health -------------------------------------------------------------------------------
async def test_consecutive_failures_eject_and_a_success_resets_the_count() -> None:
    f = await make(2)
    seen: list[tuple[str, EjectReason]] = []
    f.fleet.on_eject(lambda rid, why: seen.append((rid, why)))
    try:
        for _ in range(2):
            f.fleet.record_failure("r0", FailureReason.CONNECT)
        f.fleet.record_success("r0")
        for _ in range(2):
            f.fleet.record_failure("r0", FailureReason.STATUS_5XX)
        assert f.routable() == {"r0", "r1"} and seen == []
        f.fleet.record_failure("r0", FailureReason.RESET)
        assert f.routable() == {"r1"}
        assert f.fleet.snapshot().by_id()["r0"].ejected
        assert seen == [("r0", EjectReason.FAILURES)]
        assert f.fleet.ejections[("r0", EjectReason.FAILURES)] == 1
        assert f.fleet.get("r0").ejected_until == f.clock.t + 10.0
        # hard failures are not capped: a dead replica is dead, however many there are
        for _ in range(3):
            f.fleet.record_failure("r1", FailureReason.CONNECT)
        assert f.routable() == set() and f.fleet.ready_count() == 0
        # ids the fleet does not know (removed meanwhile) are ignored
        f.fleet.record_failure("gone", FailureReason.CONNECT)
        f.fleet.record_success("gone")
        assert f.fleet.record_slow("gone", SlowReason.TTFT) is False
    finally:
        await f.fleet.aclose()


@pytest.mark.parametrize(("n", "ejectable"), [(1, 0), (2, 1), (3, 1), (4, 2), (5, 2)])
async def test_slow_ejection_is_capped_at_half_the_fleet(n: int, ejectable: int) -> None:
    f = await make(n)
    try:
        results = [f.fleet.record_slow(rid, SlowReason.TTFT) for rid in f.fakes]
        assert results == [True] * ejectable + [False] * (n - ejectable)
        assert f.fleet.ready_count() == n - ejectable
        assert sum(f.fleet.spared.values()) == n - ejectable
        # a second report on an ejected replica does not eject it again
        if ejectable:
            assert f.fleet.record_slow("r0", SlowReason.IDLE) is False
            assert f.fleet.ejections[("r0", EjectReason.TTFT)] == 1
    finally:
        await f.fleet.aclose()


async def test_dead_replicas_count_against_the_slowness_cap() -> None:
    f = await make(4)
    try:
        f.fakes["r0"].health = "refuse"
        for _ in range(3):
            await f.fleet.refresh()
        assert f.phases()["r0"] is Phase.DEAD
        assert f.fleet.ejections[("r0", EjectReason.DOWN)] == 1
        assert f.fleet.record_slow("r1", SlowReason.IDLE) is True
        assert f.fleet.record_slow("r2", SlowReason.IDLE) is False
        assert f.routable() == {"r2", "r3"}
    finally:
        await f.fleet.aclose()


async def test_an_ejection_expires_only_through_a_good_probe_and_doubles_next_time() -> None:
    f = await make(2)
    try:
        assert f.fleet.record_slow("r0", SlowReason.TTFT)
        t0 = f.clock.t
        f.clock.t = t0 + 5  # /health still answers 200 (it may lie): not expired yet
        await f.fleet.refresh()
        assert "r0" not in f.routable()
        f.fakes["r0"].health = "503"
        f.clock.t = t0 + 11  # expired, but the probe fails
        await f.fleet.refresh()
        assert "r0" not in f.routable()
        f.fakes["r0"].health = "ok"
        f.clock.t = t0 + 12
        await f.fleet.refresh()
        assert f.routable() == {"r0", "r1"}
        assert f.fleet.record_slow("r0", SlowReason.IDLE)
        assert f.fleet.get("r0").ejected_until == t0 + 12 + 20.0
        row = f.fleet.status()[0]
        assert (row["ejected"], row["eject_reason"], row["strikes"]) == (True, "idle", 2)
    finally:
        await f.fleet.aclose()


async def test_a_hung_probe_times_out_as_a_failure() -> None:
    f = await make(2, probe_timeout_s=0.02)
    try:
        f.fakes["r1"].health = "hang"
        await f.fleet.refresh()
        r1 = f.fleet.get("r1")
        assert r1.health.probe_failures == 1 and r1.phase is Phase.READY
        assert r1.last_error is not None and "TimeoutError" in r1.last_error
    finally:
        await f.fleet.aclose()


# -- restarts -------------------------------------------------------------------------------------
async def test_a_replica_back_from_failed_probes_is_a_new_incarnation() -> None:
    f = await make(2)
    restarted: list[str] = []
    f.fleet.on_restart(restarted.append)
    try:
        f.fakes["r0"].health = "refuse"
        for _ in range(3):
            await f.fleet.refresh()
        snap = f.fleet.snapshot().by_id()["r0"]
        assert snap.phase is Phase.DEAD and not snap.routable
        f.fakes["r0"].health = "ok"
        f.fakes["r0"].metrics_status = 500
        await f.fleet.refresh()
        # back, but loading until its metrics are read afresh
        assert (f.phases()["r0"], f.fleet.get("r0").incarnation) == (Phase.LOADING, 1)
        assert restarted == ["r0"] and f.fleet.restarts["r0"] == 1
        f.fakes["r0"].metrics_status = 200
        f.fakes["r0"].queries = 5.0  # a new process: its counters restarted (one restart only)
        await f.fleet.refresh()
        assert f.phases()["r0"] is Phase.READY
        assert f.fleet.snapshot().by_id()["r0"].incarnation == 1 and restarted == ["r0"]
    finally:
        await f.fleet.aclose()


@pytest.mark.parametrize(
    ("change", "restart"),
    [
        ({"queries": 10.0}, True),  # the counter went backwards
        ({"created": 1.8e9, "queries": 5000.0}, True),  # a later start, counters already past
        ({"queries": 2000.0, "hits": 900.0}, False),  # counters moving on
        ({"running": 9}, False),
    ],
)
async def test_a_restart_between_probes_is_seen_in_the_metrics(
    change: dict[str, float], restart: bool
) -> None:
    f = await make(2)
    restarted: list[str] = []

    def broken(_: str) -> None:
        raise RuntimeError("a subscriber's bug")

    f.fleet.on_restart(broken)
    f.fleet.on_restart(restarted.append)
    try:
        for name, value in change.items():
            setattr(f.fakes["r0"], name, value)
        await f.fleet.refresh()
        assert restarted == (["r0"] if restart else [])
        assert f.fleet.get("r0").incarnation == int(restart)
        assert f.phases()["r0"] is Phase.READY
    finally:
        await f.fleet.aclose()


async def test_the_start_marker_survives_scrapes_without_it() -> None:
    f = await make(1)
    try:
        f.fakes["r0"].created = None
        await f.fleet.refresh()
        assert f.fleet.get("r0").incarnation == 0
        f.fakes["r0"].created = 1.8e9  # a later process, its counters already past the old ones
        f.fakes["r0"].queries = 5000.0
        await f.fleet.refresh()
        assert f.fleet.get("r0").incarnation == 1
    finally:
        await f.fleet.aclose()


# -- membership -----------------------------------------------------------------------------------
async def test_drain_remove_add(env: Fleet) -> None:
    await env.fleet.refresh()
    env.ledger.reserve("q", "r0", 10, 10, 1, now_s=env.clock.t)
    env.fleet.drain("r0")
    await env.fleet.refresh()  # probes go on and do not undo the drain
    assert env.phases() == {"r0": Phase.DRAINING, "r1": Phase.READY}
    assert env.routable() == {"r1"} and not env.fleet.is_drained("r0")
    env.ledger.release("q")
    assert env.fleet.is_drained("r0")
    r0 = env.fleet.get("r0")
    env.ledger.reserve("q2", "r0", 10, 10, 1, now_s=env.clock.t)
    await env.fleet.remove("r0")
    assert r0.client.is_closed and r0.phase is Phase.DEAD and len(env.ledger) == 0
    with pytest.raises(UnknownReplicaError) as err:
        env.fleet.get("r0")
    assert err.value.status_code == 404
    with pytest.raises(UnknownReplicaError):
        await env.fleet.remove("r0")
    assert [r.replica_id for r in env.fleet.replicas()] == ["r1"]
    with pytest.raises(ConfigError):
        env.fleet.add(ReplicaConfig(id="r1", url="http://r1:8000"))
    env.fakes["r9"] = Fake()
    added = env.fleet.add(ReplicaConfig(id="r9", url="http://r9:8000/"))
    assert (added.url, added.phase) == ("http://r9:8000", Phase.LOADING)
    await env.fleet.refresh()
    assert env.phases() == {"r1": Phase.READY, "r9": Phase.READY}


async def test_snapshot_contents_and_reuse(env: Fleet) -> None:
    await env.fleet.refresh()
    env.ledger.reserve("q", "r1", 64, 32, 8, now_s=env.clock.t)
    env.clock.t += 3
    snap = env.fleet.snapshot()
    assert snap.now_s == env.clock.t
    assert [r.replica_id for r in snap.replicas] == ["r0", "r1"]
    r0, r1 = snap.replicas
    assert (r0.ledger.requests, r1.ledger.requests, r1.ledger.prefill_tokens) == (0, 1, 32)
    assert r0.metrics.kv_usage == 0.25 and r0.phase is Phase.READY
    again = env.fleet.snapshot().replicas
    assert again[0] is r0 and again[1] is r1  # unchanged: the same objects (memo survives)
    env.ledger.first_token("q")
    assert env.fleet.snapshot().replicas[1].ledger.decoding == 1
    plain = LiveFleet(env.settings, clock=env.clock, transport=httpx.MockTransport(env.handle))
    try:
        await plain.refresh()
        assert all(r.ledger.requests == 0 for r in plain.snapshot().replicas)
    finally:
        await plain.aclose()


async def test_status_rows_are_json(env: Fleet) -> None:
    await env.fleet.refresh()
    env.fleet.record_slow("r1", SlowReason.TTFT)
    rows = json.loads(json.dumps(env.fleet.status()))
    assert [(r["id"], r["phase"], r["ejected"], r["block_size"]) for r in rows] == [
        ("r0", "ready", False, 32),
        ("r1", "ready", True, 32),
    ]
    assert rows[1]["ejected_for_s"] == 10.0 and rows[1]["routable"] is False


# -- the background task --------------------------------------------------------------------------
async def test_start_keeps_the_fleet_current_and_aclose_leaves_nothing() -> None:
    before = asyncio.all_tasks()
    f = Fleet(3, tick=0.01, probe_interval_s=0.05, scrape_interval_s=0.05, probe_timeout_s=30.0)
    f.fakes["r2"].health = "hang"  # a probe in flight when the fleet closes
    await f.fleet.start()
    await f.fleet.start()  # idempotent: one schedule
    while f.fleet.ready_count() < 2 or f.fakes["r0"].hits_seen.count("/metrics") < 3:
        await asyncio.sleep(0.005)
    assert f.phases() == {"r0": Phase.READY, "r1": Phase.READY, "r2": Phase.LOADING}
    assert f.fakes["r2"].hits_seen.count("/health") == 1  # never two probes at once
    f.fakes["r0"].running = 5
    n = f.fakes["r0"].hits_seen.count("/metrics")
    while f.fakes["r0"].hits_seen.count("/metrics") < n + 2:
        await asyncio.sleep(0.005)
    assert f.fleet.get("r0").metrics.running == 5
    await f.fleet.aclose()
    await f.fleet.aclose()  # idempotent
    await asyncio.sleep(0)
    leaked = {t for t in asyncio.all_tasks() - before if t is not asyncio.current_task()}
    assert not leaked, leaked
    assert all(r.client.is_closed for r in f.fleet.replicas())
