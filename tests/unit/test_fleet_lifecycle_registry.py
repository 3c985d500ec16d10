"""The fleet registry's decisions (router/fleet/lifecycle.py) and the in-process registry with
its followers (router/fleet/registry.py, follower.py): table-driven lifecycle, guard refusals,
drains that wait for in-flight requests, reconciliation, and convergence of followers whatever
the order of the sources' reports."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.errors import ReplicaRefusedError, UnknownReplicaError
from router.config import ReplicaConfig
from router.fleet import lifecycle as lc
from router.fleet.follower import RegistryFollower, replica_config
from router.fleet.lifecycle import DrainReason, Lifecycle, Observation, Record, Refusal, Seen
from router.fleet.membership import Member
from router.fleet.registry import FleetRegistry
from router.fleet.registry_memory import MemoryBackend
from router.fleet.urls import ReplicaGuard

L, D, G = Lifecycle.LOADING, Lifecycle.DRAINING, Lifecycle.GONE
URL = "http://10.0.0.{}:8000"


def rec(
    rid: str,
    state: Lifecycle = L,
    sources: tuple[str, ...] = ("static",),
    *,
    url: str | None = None,
    reason: DrainReason | None = None,
    version: int = 1,
    deadline: float | None = None,
) -> Record:
    n = rid.strip("r") or "1"
    if state is D and deadline is None:
        deadline = 100.0
    return Record(
        rid,
        url or URL.format(n),
        state,
        version,
        sources,
        drain_reason=reason,
        drain_deadline=deadline,
    )


def mem(rid: str, url: str | None = None) -> Member:
    return Member(rid, url or URL.format(rid.strip("r") or "1"))


# -- lifecycle, table-driven ----------------------------------------------------------------------
U, A = DrainReason.UNREPORTED, DrainReason.ADMIN
REPORT_CASES = [
    # (before, source, reported ids, expected (state, sources, reason) per id)
    ("new member", {}, "static", ["r1"], {"r1": (L, ("static",), None)}),
    ("second source", {"r1": rec("r1")}, "dns", ["r1"], {"r1": (L, ("dns", "static"), None)}),
    ("no longer reported", {"r1": rec("r1")}, "static", [], {"r1": (D, (), U)}),
    (
        "another source still reports it",
        {"r1": rec("r1", sources=("dns", "static"))},
        "static",
        [],
        {"r1": (L, ("dns",), None)},
    ),
    (
        "reported again",
        {"r1": rec("r1", D, (), reason=U)},
        "dns",
        ["r1"],
        {"r1": (L, ("dns",), None)},
    ),
    (
        "admin drain holds",
        {"r1": rec("r1", D, reason=A)},
        "static",
        ["r1"],
        {"r1": (D, ("static",), A)},
    ),
    (
        "admin re-add resumes",
        {"r1": rec("r1", D, reason=A)},
        "admin",
        ["r1"],
        {"r1": (L, ("admin", "static"), None)},
    ),
    (
        "gone comes back",
        {"r1": rec("r1", G, (), reason=U)},
        "dns",
        ["r1"],
        {"r1": (L, ("dns",), None)},
    ),
    (
        "admin removal sticks",
        {"r1": rec("r1", G, reason=A)},
        "static",
        ["r1"],
        {"r1": (G, ("static",), A)},
    ),
    (
        "admin re-adds a removed one",
        {"r1": rec("r1", G, reason=A)},
        "admin",
        ["r1"],
        {"r1": (L, ("admin",), None)},
    ),
    (
        "other source untouched",
        {"r2": rec("r2", sources=("dns",))},
        "static",
        [],
        {"r2": (L, ("dns",), None)},
    ),
]


@pytest.mark.parametrize(
    ("before", "source", "ids", "after"),
    [c[1:] for c in REPORT_CASES],
    ids=[c[0] for c in REPORT_CASES],
)
def test_report_lifecycle(
    before: dict[str, Record], source: str, ids: list[str], after: dict[str, tuple[object, ...]]
) -> None:
    changed, refused = lc.apply_report(before, source, [mem(i) for i in ids], 7, 50.0, 30.0)
    assert refused == []
    now = {**before, **changed}
    for rid, (state, sources, reason) in after.items():
        r = now[rid]
        assert (r.state, r.sources, r.drain_reason) == (state, sources, reason)
        assert (r.version == 7) == (rid in changed)
    for r in changed.values():
        if r.state is D and r.drain_reason is U:
            assert r.drain_deadline == 80.0


def test_report_refuses_a_url_conflict_and_duplicates() -> None:
    before = {"r1": rec("r1", sources=("static",))}
    changed, refused = lc.apply_report(
        before, "dns", [mem("r1", URL.format(9)), mem("r2"), mem("r2")], 2, 0.0, 10.0
    )
    assert [(m.replica_id, why) for m, why in refused] == [
        ("r1", Refusal.URL_CONFLICT),
        ("r2", Refusal.DUPLICATE),
    ]
    assert set(changed) == {"r2"}


def test_sole_source_moving_a_replica_makes_a_new_one() -> None:
    changed, refused = lc.apply_report(
        {"r1": rec("r1", D, reason=U)}, "static", [mem("r1", URL.format(9))], 3, 0, 1
    )
    assert refused == [] and changed["r1"].url == URL.format(9) and changed["r1"].state is L


def obs(router: str, at: float, version: int, **in_flight: int) -> Observation:
    return Observation(
        router, at, version, {k: Seen("draining", False, n) for k, n in in_flight.items()}
    )


SETTLE_CASES = [
    # (observations, now, gone?)
    ("no router knows it", [], 10.0, True),
    ("idle, drain applied", [obs("a", 9.0, 5, r1=0)], 10.0, True),
    ("in flight on one router", [obs("a", 9.0, 5, r1=0), obs("b", 9.0, 6, r1=2)], 10.0, False),
    ("a router has not applied the drain", [obs("a", 9.0, 4, r1=0)], 10.0, False),
    ("a dead router does not block", [obs("a", 9.0, 5), obs("b", 1.0, 2, r1=3)], 10.0, True),
    ("the deadline passed", [obs("a", 99.0, 5, r1=3)], 100.0, True),
]


@pytest.mark.parametrize(
    ("observations", "now", "gone"), [c[1:] for c in SETTLE_CASES], ids=[c[0] for c in SETTLE_CASES]
)
def test_settle(observations: list[Observation], now: float, gone: bool) -> None:
    records = {"r1": rec("r1", D, reason=A, version=5, deadline=100.0), "r2": rec("r2")}
    changed = lc.settle(records, observations, 9, now, ttl_s=5.0)
    assert set(changed) == ({"r1"} if gone else set())
    assert all(r.state is G and r.version == 9 for r in changed.values())


def test_record_and_observation_round_trip_json() -> None:
    r = Record(
        "r1", URL.format(1), D, 4, ("dns", "static"), "m", "h100", {"k": "v"}, {"tp": 2}, A, 9.5
    )
    assert Record.from_json(r.to_json()) == r
    o = obs("a", 1.5, 3, r1=2, r2=0)
    assert Observation.from_json(o.to_json()) == o


def test_observed_state_folds_router_views() -> None:
    r = rec("r1")
    ready = Observation("a", 0, 1, {"r1": Seen("ready", False, 0)})
    out = Observation("b", 0, 1, {"r1": Seen("ready", True, 0)})
    dead = Observation("c", 0, 1, {"r1": Seen("dead", False, 0)})
    assert lc.observed_state(r, [ready, out]) is Lifecycle.READY
    assert lc.observed_state(r, [out, dead]) is Lifecycle.EJECTED
    assert lc.observed_state(r, []) is L
    assert lc.observed_state(rec("r1", D, reason=A), [ready]) is D


# -- the registry and its followers ---------------------------------------------------------------
@dataclass
class FakeOps:
    """A router's live fleet as the follower sees it; in-flight counts set by the test."""

    fleet: dict[str, tuple[str, bool]] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)
    joined: list[ReplicaConfig] = field(default_factory=list)

    def members(self) -> Mapping[str, tuple[str, bool]]:
        return dict(self.fleet)

    async def join(self, cfg: ReplicaConfig) -> None:
        assert cfg.id not in self.fleet
        self.fleet[cfg.id] = (cfg.url, False)
        self.joined.append(cfg)

    def drain(self, replica_id: str) -> None:
        self.fleet[replica_id] = (self.fleet[replica_id][0], True)

    def resume(self, replica_id: str) -> None:
        self.fleet[replica_id] = (self.fleet[replica_id][0], False)

    async def leave(self, replica_id: str) -> None:
        del self.fleet[replica_id]

    def seen(self) -> Mapping[str, Seen]:
        return {
            i: Seen("draining" if d else "ready", False, self.in_flight.get(i, 0))
            for i, (_, d) in self.fleet.items()
        }


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_registry(clock: Clock | None = None, *, drain_s: float = 60.0) -> FleetRegistry:
    return FleetRegistry(
        MemoryBackend(), ReplicaGuard(), drain_s=drain_s, ttl_s=10.0, clock=clock or Clock()
    )


def follower(reg: FleetRegistry, name: str, ops: FakeOps | None = None) -> RegistryFollower:
    return RegistryFollower(reg, ops or FakeOps(), router_id=name, resync_s=1.0, clock=reg.clock)


async def test_refused_members_are_counted_and_skipped() -> None:
    reg = make_registry()
    members = [mem("r1"), Member("r2", "http://169.254.169.254/"), Member("bad id", URL.format(3))]
    await reg.set_members("dns", members)  # never raises into the source
    assert set((await reg.load()).records) == {"r1"}
    refused = reg.metrics.refused
    assert refused.labels("dns", "url")._value.get() == 1
    assert refused.labels("dns", "id")._value.get() == 1
    assert reg.metrics.replicas.labels("loading")._value.get() == 1


async def test_admin_add_is_checked_and_conflicts_refused() -> None:
    reg = make_registry()
    await reg.set_members("static", [mem("r1")])
    with pytest.raises(ReplicaRefusedError):
        await reg.add("admin", Member("r9", "http://8.8.8.8:80"))
    with pytest.raises(ReplicaRefusedError, match="another URL"):
        await reg.add("admin", mem("r1", URL.format(7)))
    added = await reg.add("admin", mem("r1"))
    assert added.sources == ("admin", "static")
    with pytest.raises(UnknownReplicaError):
        await reg.drain(["nope"])


async def test_follower_reconciles_add_drain_resume_remove() -> None:
    reg = make_registry()
    ops = FakeOps()
    f = follower(reg, "a", ops)
    await reg.set_members("static", [Member("r1", URL.format(1), gpu="a100", options={"tp": 2})])
    await reg.set_members("dns", [mem("r2")])
    await f.sync()
    assert ops.fleet == {"r1": (URL.format(1), False), "r2": (URL.format(2), False)}
    assert ops.joined[0].tp == 2 and ops.joined[0].gpu == "a100"
    ops.in_flight["r2"] = 1
    await reg.set_members("dns", [])  # r2 unreported: drains, still in flight
    await f.sync()
    assert ops.fleet["r2"] == (URL.format(2), True)
    await reg.set_members("dns", [mem("r2")])  # back before it left: resumes
    await f.sync()
    assert ops.fleet["r2"] == (URL.format(2), False)
    await reg.set_members("dns", [])
    await f.sync()
    assert ops.fleet["r2"][1] is True
    ops.in_flight["r2"] = 0
    await f.sync()  # publishes 0 in flight; the registry settles it; the follower removes it
    assert set(ops.fleet) == {"r1"}
    assert (await reg.load()).records["r2"].state is G


async def test_drain_waits_for_every_routers_in_flight_requests() -> None:
    reg = make_registry()
    a, b = FakeOps(), FakeOps()
    fa, fb = follower(reg, "a", a), follower(reg, "b", b)
    await reg.set_members("static", [mem("r1"), mem("r2")])
    await fa.sync()
    await fb.sync()
    b.in_flight["r1"] = 2
    await reg.drain(["r1"])
    await fa.sync()
    assert await reg.wait_drained(["r1"], 0.05) == {"r1"}  # b has not applied the drain yet
    await fb.sync()  # b drains it here, publishes 2 in flight
    assert a.fleet["r1"][1] and b.fleet["r1"][1]
    assert await reg.wait_drained(["r1"], 0.05) == {"r1"}
    b.in_flight["r1"] = 0
    waiter = asyncio.create_task(reg.wait_drained(["r1"], 5.0))
    await fb.sync()
    assert await waiter == set()
    await fa.sync()
    assert set(a.fleet) == set(b.fleet) == {"r2"}
    # the operator's removal holds while the static source still reports it
    await reg.set_members("static", [mem("r1"), mem("r2")])
    await fa.sync()
    assert set(a.fleet) == {"r2"}


async def test_a_dead_router_stops_blocking_after_its_ttl() -> None:
    clock = Clock()
    reg = make_registry(clock)
    a, dead = FakeOps(), FakeOps(in_flight={"r1": 5})
    fa, fd = follower(reg, "a", a), follower(reg, "dead", dead)
    await reg.set_members("static", [mem("r1")])
    await fd.sync()
    await fa.sync()
    await reg.drain(["r1"])
    await fd.sync()  # applied, 5 in flight, then the router dies
    await fa.sync()
    assert a.fleet["r1"][1] is True  # draining, held by the other router's requests
    clock.t += 11.0  # past the heartbeat TTL
    await fa.sync()
    assert a.fleet == {}


async def test_a_restarted_router_reads_the_fleet_back() -> None:
    reg = make_registry()
    await reg.set_members("static", [mem("r1")])
    await reg.add("admin", mem("r2"))
    await reg.drain(["r1"])
    fresh = FakeOps()
    await follower(reg, "new", fresh).sync()
    assert set(fresh.fleet) == {"r2"}  # a draining replica is not joined afresh


def test_replica_config_of_a_record() -> None:
    r = Record("r1", URL.format(1), L, 1, ("admin",), "m", None, {}, {"block_size": 16})
    cfg = replica_config(r)
    assert (cfg.id, cfg.model, cfg.gpu, cfg.block_size) == ("r1", "m", "h100", 16)


# -- convergence ----------------------------------------------------------------------------------
IDS = ["r1", "r2", "r3", "r4"]
reports = st.lists(
    st.tuples(st.sampled_from(["static", "dns", "k8s", "admin"]), st.sets(st.sampled_from(IDS))),
    max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(calls=reports, order=st.permutations(range(3)), drained=st.sets(st.sampled_from(IDS)))
def test_followers_converge_whatever_the_order(
    calls: list[tuple[str, set[str]]], order: list[int], drained: set[str]
) -> None:
    async def run() -> None:
        reg = make_registry(drain_s=1e9)
        opses = [FakeOps() for _ in range(3)]
        followers = [follower(reg, f"router-{i}", o) for i, o in enumerate(opses)]
        for n, (source, ids) in enumerate(calls):
            await reg.set_members(source, [mem(i) for i in sorted(ids)])
            await followers[order[n % 3]].sync()  # followers lag behind in turns
        known = set((await reg.load()).records)
        await reg.drain(drained & known)
        for _ in range(2):  # two rounds: every router applies, then every drain settles
            for i in order:
                await followers[i].sync()
        snap = await reg.load()
        want = {i for i, r in snap.records.items() if r.state is not G}
        assert all(set(o.fleet) == want for o in opses)
        assert all(r.state is G for i, r in snap.records.items() if i in drained & known)
        # a replica some source still reports is a member unless the operator drained it
        reported: dict[str, set[str]] = {}
        for source, ids in calls:
            reported[source] = ids
        still: set[str] = set().union(*reported.values())
        for rid in still - drained:
            assert rid in want

    asyncio.run(run())


async def test_a_member_its_source_says_is_not_ready_is_not_reported() -> None:
    reg = make_registry()
    await reg.set_members("kubernetes", [mem("r1"), Member("r2", URL.format(2), ready=False)])
    assert set((await reg.load()).records) == {"r1"}  # a pod not Ready yet does not join
    await reg.set_members("kubernetes", [Member("r1", URL.format(1), ready=False), mem("r2")])
    records = (await reg.load()).records
    assert records["r1"].state is D and records["r1"].drain_reason is DrainReason.UNREPORTED
    assert records["r2"].state is L


async def test_updates_are_counted_only_when_they_change_the_registry() -> None:
    reg = make_registry()
    await reg.set_members("static", [mem("r1")])
    await reg.set_members("static", [mem("r1")])  # the same view again: no change
    await reg.settle()  # nothing to settle
    assert reg.metrics.updates.labels("static")._value.get() == 1
    assert reg.metrics.updates.labels("settle")._value.get() == 0
