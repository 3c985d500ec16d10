"""`PolicyRequestRouter` without a Ray cluster: choices, reasons, tiers and the books' lifecycle.

The router is built as Serve builds it (constructor, then `initialize_state` with the config's
kwargs) and driven through the hooks Serve calls: `choose_replicas` with fake running replicas
(an id and routing stats: all the router reads of them) and real `PendingRequest`s,
`on_request_routed`, `on_request_completed`, `on_replica_actor_died`. Without `redis_url` the
index is process-local, so prefix affinity sees this router's own speculation. Every test ends
with no booking left: the ledger and the router's maps are empty.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from controlplane.types import DecisionReason
from router.serve.stats import EngineStats

MODEL = "tiny-llama"
PROMPT = "the same long shared prefix " * 20


@dataclass
class FakeReplica:
    """What the router reads of a `RunningReplica`."""

    replica_id: Any
    routing_stats: dict[str, Any] = field(default_factory=dict)


def replica(uid: str, **figures: Any) -> FakeReplica:
    from ray.serve._private.common import DeploymentID
    from ray.serve.request_router import ReplicaID

    stats = EngineStats(engine="sim", model=MODEL, replica_id=uid, block_size=32, **figures)
    rid = ReplicaID(uid, DeploymentID(name="engine", app_name="app"))
    return FakeReplica(rid, stats.to_dict() if figures.get("reported_at", 1.0) else {})


def pending(rid: str, body: dict[str, Any] | bytes, method: str = "handle") -> Any:
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return PendingRequest(
        args=["POST", "/v1/completions", [["content-type", "application/json"]], raw],
        kwargs={},
        metadata=RequestMetadata(rid, rid, call_method=method),
    )


def completion(prompt: str = PROMPT, model: str = MODEL) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": 8}


@pytest.fixture
def make_router() -> Iterator[Any]:
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from router.serve.request_router import PolicyRequestRouter

    made: list[PolicyRequestRouter] = []

    def make(**kwargs: Any) -> PolicyRequestRouter:
        r = PolicyRequestRouter(
            deployment_id=DeploymentID(name="engine", app_name="app"),
            handle_source=DeploymentHandleSource.UNKNOWN,
        )
        r.initialize_state(model=MODEL, tokenizer="approx", **kwargs)
        made.append(r)
        return r

    yield make
    for r in made:  # every booking was closed
        assert len(r.books.ledger) == 0
        assert not r._routed and not r._snapshots


def flat(tiers: list[list[str]]) -> list[str]:
    return [uid for tier in tiers for uid in tier]


def ids(tiers: list[list[FakeReplica]]) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in tier] for tier in tiers]


@dataclass(frozen=True)
class Case:
    policy: str
    replicas: tuple[tuple[str, int], ...]  # (id, waiting)
    first: str | None  # the expected first choice (None: any)
    reason: DecisionReason


CASES = [
    Case("least_loaded", (("a", 5), ("b", 0)), "b", DecisionReason.LEAST_LOADED),
    Case("prefix_affinity", (("a", 5), ("b", 0)), "b", DecisionReason.MISS_LEAST_LOADED),
    Case("round_robin", (("a", 0), ("b", 0)), None, DecisionReason.ROUND_ROBIN),
    Case("predicted_finish", (("a", 9), ("b", 0)), "b", DecisionReason.PREDICTED_FINISH),
]


@pytest.mark.parametrize("case", CASES, ids=[c.policy for c in CASES])
async def test_the_configured_policy_ranks_the_replicas(make_router: Any, case: Case) -> None:
    router = make_router(policy=case.policy)
    reps = [replica(uid, waiting=w, running=w, reported_at=1.0) for uid, w in case.replicas]
    pr = pending("r1", completion())
    tiers = await router.choose_replicas(reps, pr)
    # one tier per ranked replica, best first; every candidate is in exactly one tier
    assert sorted(flat(ids(tiers))) == sorted(uid for uid, _ in case.replicas)
    assert all(len(t) == 1 for t in tiers)
    if case.first is not None:
        assert ids(tiers)[0] == [case.first]
    routing = pr.kwargs["routing"]
    assert (routing["policy"], routing["reason"]) == (case.policy, case.reason)
    chosen = reps[[uid for uid, _ in case.replicas].index(ids(tiers)[0][0])]
    assert router.books.ledger.view(chosen.replica_id.unique_id).requests == 1
    router.on_request_routed(pr, chosen.replica_id, None)
    router.on_request_completed(chosen.replica_id, "r1")


async def test_a_shared_prefix_follows_the_first_choice(make_router: Any) -> None:
    router = make_router(policy="prefix_affinity")
    reps = [replica("a", reported_at=1.0), replica("b", reported_at=1.0)]
    first = pending("r1", completion())
    holder = ids(await router.choose_replicas(reps, first))[0][0]
    router.on_request_routed(first, reps[0 if holder == "a" else 1].replica_id, None)
    again = pending("r2", completion(PROMPT + " and a different question"))
    tiers = ids(await router.choose_replicas(reps, again))
    assert tiers[0] == [holder]
    assert again.kwargs["routing"]["reason"] == DecisionReason.PREFIX_HIT
    assert again.kwargs["routing"]["predicted_hit_tokens"] > 0
    for pr in (first, again):
        router.on_request_completed(reps[0].replica_id, pr.metadata.internal_request_id)


async def test_sent_elsewhere_the_booking_moves(make_router: Any) -> None:
    router = make_router(policy="least_loaded")
    reps = [replica("a", waiting=0, reported_at=1.0), replica("b", waiting=4, reported_at=1.0)]
    pr = pending("r1", completion())
    assert ids(await router.choose_replicas(reps, pr))[0] == ["a"]
    # "a" was full: Serve sent it to the next tier
    router.on_request_routed(pr, reps[1].replica_id, None)
    ledger = router.books.ledger
    assert (ledger.view("a").requests, ledger.view("b").requests) == (0, 1)
    router.on_request_completed(reps[1].replica_id, "r1")
    router.on_request_completed(reps[1].replica_id, "r1")  # exactly once: a repeat is a no-op


OTHER_CALLS = [
    ("not an engine call", completion(), "record_routing_stats"),
    ("another model", completion(model="other"), "handle"),
    ("not json", b"{nope", "handle"),
    ("no prompt", {"model": MODEL}, "handle"),
]


@pytest.mark.parametrize(("name", "body", "method"), OTHER_CALLS, ids=[c[0] for c in OTHER_CALLS])
async def test_other_calls_go_by_load(
    make_router: Any, name: str, body: dict[str, Any] | bytes, method: str
) -> None:
    router = make_router()
    reps = [replica("a", reported_at=1.0), replica("b", reported_at=1.0)]
    request = pending("x", body, method=method)
    tiers = await router.choose_replicas(reps, request)
    assert ids(tiers) == [["a", "b"]]  # one tier: Serve's own choice among them
    assert "routing" not in request.kwargs
    assert len(router.books.ledger) == 0


async def test_a_dead_replica_drops_its_bookings(make_router: Any) -> None:
    router = make_router(policy="least_loaded")
    reps = [replica("a", reported_at=1.0), replica("b", waiting=3, reported_at=1.0)]
    prs = [pending(f"r{i}", completion(f"prompt {i}")) for i in range(3)]
    for pr in prs:
        first = ids(await router.choose_replicas(reps, pr))[0][0]
        router.on_request_routed(pr, reps[0 if first == "a" else 1].replica_id, None)
    assert router.books.ledger.view("a").requests == 3
    router.on_replica_actor_died(reps[0].replica_id)
    assert len(router.books.ledger) == 0
    await router.aclose()


async def test_before_any_report_the_configured_profile(make_router: Any) -> None:
    router = make_router(policy="least_loaded", block_size=64)
    reps = [replica("a", reported_at=0.0), replica("b", reported_at=0.0)]  # no stats yet
    pr = pending("r1", completion())
    tiers = ids(await router.choose_replicas(reps, pr))
    assert sorted(flat(tiers)) == ["a", "b"]
    rid = tiers[0][0]
    routed = router._routed["r1"]
    assert routed.request.block_size == 64
    router.on_request_completed(reps[0 if rid == "a" else 1].replica_id, "r1")


async def test_a_request_cancelled_before_it_is_sent_releases_its_booking(
    make_router: Any,
) -> None:
    router = make_router(policy="least_loaded")
    reps = [replica("a", reported_at=1.0), replica("b", reported_at=1.0)]
    pr = pending("r1", completion())
    await router.choose_replicas(reps, pr)
    assert len(router.books.ledger) == 1
    pr.future.cancel()  # the caller went away while Serve looked for a free replica
    await asyncio.sleep(0)  # done callbacks run on the loop
    assert len(router.books.ledger) == 0


class FakeCounter:
    """Stands in for the Ray metric: the tags of every increment."""

    def __init__(self) -> None:
        self.tags: list[dict[str, str]] = []

    def inc(self, value: float, tags: dict[str, str]) -> None:
        self.tags.append(tags)


async def test_the_reason_is_a_metric_label_and_a_span_attribute(make_router: Any) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    router = make_router(policy="least_loaded")
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    router._tracer = provider.get_tracer("test")
    counter = router._decisions = FakeCounter()
    reps = [replica("a", reported_at=1.0), replica("b", waiting=2, reported_at=1.0)]
    pr = pending("r1", completion())
    await router.choose_replicas(reps, pr)
    router.on_request_routed(pr, reps[0].replica_id, None)
    router.on_request_completed(reps[0].replica_id, "r1")
    (span,) = exporter.get_finished_spans()
    assert span.name == "cp.router.decide"
    assert span.attributes is not None
    assert span.attributes["cp.decision.reason"] == DecisionReason.LEAST_LOADED
    assert span.attributes["cp.replica"] == "a"
    assert counter.tags == [
        {"deployment": "engine", "arm": "least_loaded", "policy": "least_loaded",
         "reason": "least_loaded"}
    ]  # fmt: skip


def test_the_config_names_this_router() -> None:
    from deploy.engines.deployment import policy_router_config
    from router.serve.request_router import PolicyRequestRouter

    config = policy_router_config(policy="round_robin", model=MODEL)
    assert config.get_request_router_class() is PolicyRequestRouter
    assert config.request_router_kwargs == {"policy": "round_robin", "model": MODEL}
