"""Builders for routing-policy tests: replicas, fleets, requests, prefix matches, strategies.

Kept free of assertions so every policy test file can share them. Loads are expressed through this
router's ledger (exact, fresh) unless a test wants the scraped metrics path on purpose.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from hypothesis import strategies as st

from controlplane.roofline.profile import EngineProfile, profile
from controlplane.routing.interfaces import RoutingPolicy
from controlplane.routing.policies import POLICIES
from controlplane.types import (
    Decision,
    DecisionReason,
    EngineMetrics,
    FleetSnapshot,
    Ledger,
    Phase,
    PrefixMatch,
    ReplicaState,
    RoutingRequest,
)

H100_8B: EngineProfile = profile("h100", "llama-3.1-8b")
A100_8B: EngineProfile = profile("a100", "llama-3.1-8b")
CPU_TINY: EngineProfile = profile("cpu", "tiny-llama", kv_cache_bytes=float(1 << 30))
BLOCK = H100_8B.resolved_block_size  # 16

POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)
STATEFUL = frozenset({"round_robin", "sglang_cache_aware", "dynamo_kv_cost", "llm_d_weighted"})
UNHEALTHY_PHASES = (Phase.LOADING, Phase.DRAINING, Phase.DEAD)


def make(name: str, **params: object) -> RoutingPolicy:
    return POLICIES[name](**params)


def chain(n: int, seed: int = 0) -> tuple[int, ...]:
    """`n` chained block hashes: two chains agree on block j only if they agree on 0..j."""
    out: list[int] = []
    h = 1_000_003 * (seed + 1)
    for j in range(n):
        h = hash((h, seed, j)) & 0x7FFF_FFFF_FFFF_FFFF
        out.append(h)
    return tuple(out)


def busy(tokens: int, *, requests: int = 1) -> Ledger:
    """A ledger whose requests are all still in prefill: outstanding = `tokens`.

    Every request is unscraped, so the (empty) metrics cannot double count it.
    """
    return Ledger(
        requests=requests,
        prefill_tokens=tokens,
        pending_prompt_tokens=tokens,
        context_tokens=tokens,
        unscraped_requests=requests,
    )


def replica(
    rid: str,
    *,
    phase: Phase = Phase.READY,
    ejected: bool = False,
    load: int = 0,
    ledger: Ledger | None = None,
    running: int = 0,
    waiting: int = 0,
    kv_usage: float = 0.0,
    prof: EngineProfile = H100_8B,
    incarnation: int = 0,
) -> ReplicaState:
    if ledger is None:
        ledger = busy(load) if load else Ledger()
    return ReplicaState(
        replica_id=rid,
        profile=prof,
        phase=phase,
        incarnation=incarnation,
        metrics=EngineMetrics(running=running, waiting=waiting, kv_usage=kv_usage),
        ledger=ledger,
        ejected=ejected,
    )


def fleet(*replicas: ReplicaState, now_s: float = 0.0) -> FleetSnapshot:
    return FleetSnapshot(replicas=tuple(replicas), now_s=now_s)


def ready_fleet(n: int, **kwargs: object) -> FleetSnapshot:
    return fleet(*(replica(f"r{i}", **kwargs) for i in range(n)))  # type: ignore[arg-type]


def request(
    rid: str = "req",
    prompt_tokens: int = 1024,
    *,
    blocks: Sequence[int] | None = None,
    seed: int = 0,
    predicted_output: int = 128,
    arrival_s: float = 0.0,
    tenant: str = "default",
) -> RoutingRequest:
    """A request whose block hashes are the first full blocks of chain(seed) by default."""
    hashes = tuple(blocks) if blocks is not None else chain(prompt_tokens // BLOCK, seed)
    return RoutingRequest(
        request_id=rid,
        prompt_tokens=prompt_tokens,
        block_hashes=hashes,
        tenant=tenant,
        predicted_output_tokens=predicted_output,
        arrival_s=arrival_s,
    )


def matches(**blocks: int | tuple[int, int]) -> dict[str, PrefixMatch]:
    """`matches(r0=5, r1=(8, 2))`: r0 holds 5 confirmed blocks, r1 8 of which 2 confirmed."""
    out: dict[str, PrefixMatch] = {}
    for rid, spec in blocks.items():
        if isinstance(spec, tuple):
            out[rid] = PrefixMatch(rid, spec[0], spec[1])
        else:
            out[rid] = PrefixMatch(rid, spec, spec)
    return out


def route(
    policy: RoutingPolicy,
    req: RoutingRequest,
    snap: FleetSnapshot,
    found: Mapping[str, PrefixMatch] | None = None,
) -> Decision:
    """choose + on_routed, the way the router calls them."""
    decision = policy.choose(req, snap, found or {})
    policy.on_routed(req, decision, snap)
    return decision


def routed_to(policy: RoutingPolicy, req: RoutingRequest, rid: str) -> None:
    """Drive `on_routed` as if the policy had chosen `rid` (to prime a policy's own state)."""
    policy.on_routed(
        req, Decision(rid, DecisionReason.ROUND_ROBIN, (rid,)), FleetSnapshot.make_empty()
    )


def routable_ids(snap: FleetSnapshot) -> set[str]:
    return {r.replica_id for r in snap.replicas if r.routable}


def ids(replicas: Iterable[ReplicaState]) -> list[str]:
    return [r.replica_id for r in replicas]


# -- Hypothesis strategies -------------------------------------------------------------------------
PROFILES = (H100_8B, A100_8B, CPU_TINY)


@st.composite
def ledgers(draw: st.DrawFn) -> Ledger:
    requests = draw(st.integers(0, 40))
    if requests == 0:
        return Ledger()
    decoding = draw(st.integers(0, requests))
    prefill = draw(st.integers(0, 200_000)) if requests > decoding else 0
    pending = prefill + draw(st.integers(0, 50_000)) if requests > decoding else 0
    return Ledger(
        requests=requests,
        prefill_tokens=prefill,
        pending_prompt_tokens=pending,
        decoding=decoding,
        decode_tokens=draw(st.integers(0, 100_000)),
        context_tokens=draw(st.integers(0, 300_000)),
        unscraped_requests=draw(st.integers(0, requests)),
    )


@st.composite
def replica_states(draw: st.DrawFn, rid: str) -> ReplicaState:
    return ReplicaState(
        replica_id=rid,
        profile=draw(st.sampled_from(PROFILES)),
        phase=draw(st.sampled_from(list(Phase))),
        ejected=draw(st.booleans()),
        metrics=EngineMetrics(
            running=draw(st.integers(0, 300)),
            waiting=draw(st.integers(0, 300)),
            kv_usage=draw(st.floats(0.0, 1.0, allow_nan=False)),
        ),
        ledger=draw(ledgers()),
    )


@st.composite
def fleets(draw: st.DrawFn, max_replicas: int = 12) -> FleetSnapshot:
    n = draw(st.integers(1, max_replicas))
    reps = [draw(replica_states(f"r{i}")) for i in range(n)]
    order = draw(st.permutations(reps))
    return FleetSnapshot(replicas=tuple(order), now_s=draw(st.floats(0, 1e4)))


@st.composite
def requests_(draw: st.DrawFn, rid: str | None = None) -> RoutingRequest:
    prompt = draw(st.integers(0, 20_000))
    n_blocks = draw(st.integers(0, min(64, prompt // BLOCK)))
    return RoutingRequest(
        request_id=rid if rid is not None else draw(st.text(min_size=1, max_size=12)),
        prompt_tokens=prompt,
        block_hashes=chain(n_blocks, draw(st.integers(0, 3))),
        predicted_output_tokens=draw(st.integers(0, 4_000)),
        arrival_s=draw(st.floats(0, 1e4)),
    )


@st.composite
def prefix_matches(draw: st.DrawFn, snap: FleetSnapshot) -> dict[str, PrefixMatch]:
    out: dict[str, PrefixMatch] = {}
    for r in snap.replicas:
        if draw(st.booleans()):
            matched = draw(st.integers(1, 64))
            out[r.replica_id] = PrefixMatch(r.replica_id, matched, draw(st.integers(0, matched)))
    return out
