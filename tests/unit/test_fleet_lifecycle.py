"""Replicas joining after a load time, draining, and dying, in the fleet simulator."""

from __future__ import annotations

import pytest

from controlplane.roofline import profile
from controlplane.routing.policies import make_policy
from controlplane.sim.fleet import FleetConfig, FleetSim
from controlplane.sim.results import FleetResult
from controlplane.traces.model import Trace, TraceRequest
from controlplane.types import Phase

PROFILE = profile("h100", "llama-3.1-8b")


def steady_trace(n: int = 240, gap_s: float = 0.25, prompt: int = 2000, out: int = 200) -> Trace:
    reqs = tuple(
        TraceRequest(
            arrival_s=i * gap_s,
            prompt_tokens=prompt + 16 * (i % 7),
            output_tokens=out,
            # even requests share one of five prefixes, odd ones are unique (cache misses)
            content_ids=(i % 5, 1000 + i) if i % 2 == 0 else (5000 + i,),
            id_block_tokens=1024,
            request_id=f"r{i}",
        )
        for i in range(n)
    )
    return Trace("steady", reqs)


def run(sim: FleetSim, trace: Trace) -> FleetResult:
    result = sim.run(trace)
    # nothing leaks: every request finished or failed exactly once, every reservation released
    assert len({r.request_id for r in result.records}) == len(trace)
    assert all(r.finish_s >= 0 or r.rejected for r in result.records)
    assert not sim._routing
    assert all(len(router.books.ledger) == 0 for router in sim.routers)
    return result


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "prefix_affinity"])
def test_joining_replica_serves_only_after_its_load_time(policy: str) -> None:
    sim = FleetSim(FleetConfig(profile=PROFILE, replicas=1), lambda: make_policy(policy))
    sim.schedule_join(at_s=10.0, load_time_s=20.0)
    result = run(sim, steady_trace())
    joined = [r for r in result.records if r.replica == "replica-1"]
    assert joined, "the new replica never served"
    assert min(r.arrival_s for r in joined) >= 30.0
    assert all(r.replica == "replica-0" for r in result.records if r.arrival_s < 30.0)
    stats = {s.replica_id: s for s in result.replicas}
    assert stats["replica-1"].joined_s == pytest.approx(10.0)
    assert stats["replica-1"].ready_s == pytest.approx(30.0)


def test_draining_replica_finishes_its_requests_and_takes_no_new_ones() -> None:
    sim = FleetSim(FleetConfig(profile=PROFILE, replicas=2), lambda: make_policy("round_robin"))
    sim.schedule_leave(at_s=20.0, replica_id="replica-1", drain=True)
    result = run(sim, steady_trace())
    assert not any(r.rejected for r in result.records)
    on_leaver = [r for r in result.records if r.replica == "replica-1"]
    assert on_leaver and max(r.arrival_s for r in on_leaver) < 20.0
    assert sim._by_id["replica-1"].phase is Phase.DEAD
    left = next(s for s in result.replicas if s.replica_id == "replica-1")
    assert left.left_s >= max(r.finish_s for r in on_leaver)


def test_killed_replica_fails_its_in_flight_requests_once() -> None:
    sim = FleetSim(FleetConfig(profile=PROFILE, replicas=2), lambda: make_policy("round_robin"))
    sim.schedule_leave(at_s=20.0, replica_id="replica-1", drain=False)
    result = run(sim, steady_trace(out=600))
    died = [r for r in result.records if r.rejected == "replica_died"]
    assert died, "nothing was in flight on the killed replica"
    assert all(r.replica == "replica-1" and r.arrival_s <= 20.0 for r in died)
    assert all(r.finish_s == pytest.approx(20.0) for r in died)
    later = [r for r in result.records if r.arrival_s > 20.0]
    assert later and all(r.replica == "replica-0" and r.completed for r in later)
    # the dead replica's blocks no longer count for routing
    assert sim.index.lookup((0, 1, 2), ["replica-1"]) == {}
