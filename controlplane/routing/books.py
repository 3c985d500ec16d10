"""The routing books: what one router does around a policy's decision, with no I/O and no clock.

Both hosts drive the same object in the same order; the simulator applies the returned index
operations at once, the live router with I/O (`router.core`):

    arm      = books.arm_for(request)                      A/B arm from the sticky key (pure)
    decision = books.decide(request, snapshot, matches, arm)          arm's policy.choose (pure)
    routed, ops = books.commit(request, decision, snapshot, arm, now)
               policy.on_routed; ledger.reserve(prompt, uncached = prompt - usable hit tokens,
               predicted output); ops = [Speculate(replica, hashes, ttl)]  BEFORE it is sent
    ops = books.reroute(routed, snapshot, now)   the replica never accepted it: next untried
               ranked candidate (else any routable one); the reservation and the speculative
               entry move with it (Retract(old, hashes, 0), Speculate(new, ...))
    ops = books.first_token(routed)     ledger -> decoding, policy.on_first_token,
               [Retract(replica, hashes, grace)]: KV events are the truth from here on
    ops = books.finish(routed, output_tokens)    exactly once (None after): ledger.release,
               policy.on_finished, predictor.observe(output) when the output is known;
               [Retract(replica, hashes, 0)] when it never had a first token

`journal` (off unless a list is set) records every step with its figures, so a test can hold two
hosts' books against each other: the same requests must give the same entries.

Usable hit tokens follow vLLM: an N-token prompt reuses at most (N - 1) // B cached blocks, so
the ledger's uncached prefill is never zero. The settings (reservations, speculation, its TTL
and the retract grace) are `PolicyConfig`'s: one set of defaults for both hosts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from controlplane.routing.ab import Arm, arms_from_config, assign_arm, sticky_key_for
from controlplane.routing.config import PolicyConfig
from controlplane.routing.interfaces import RoutingPolicy
from controlplane.routing.ledger import RouterLedger
from controlplane.routing.policies import make_policy
from controlplane.routing.predictor import OutputLengthPredictor
from controlplane.types import Decision, FleetSnapshot, PrefixMatch, RoutingRequest


@dataclass(frozen=True, slots=True)
class Speculate:
    """Write a speculative index entry: `replica_id` is about to hold `hashes` (for `ttl_s`)."""

    replica_id: str
    hashes: tuple[int, ...]
    ttl_s: float


@dataclass(frozen=True, slots=True)
class Retract:
    """End the speculative entry after `grace_s` (the KV events confirm what was stored)."""

    replica_id: str
    hashes: tuple[int, ...]
    grace_s: float


IndexOp = Speculate | Retract


@dataclass(slots=True)
class Routed:
    """One request's routing state, from `commit` to `finish`."""

    request: RoutingRequest
    arm: Arm
    policy: RoutingPolicy
    decision: Decision
    replica_id: str
    # how the prefix lookup went: hit | miss | unknown (the live router's index may not answer)
    lookup: str = "hit"
    tried: list[str] = field(default_factory=list)
    decoding: bool = False
    finished: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def predicted_hit_tokens(self) -> int:
        return usable_hit_tokens(self.request, self.decision.expected_hit_blocks)


def usable_hit_tokens(request: RoutingRequest, hit_blocks: int) -> int:
    """Prompt tokens an engine can serve from `hit_blocks` cached blocks: at most
    (N - 1) // B blocks of an N-token prompt (the last token is always computed)."""
    bs = max(1, request.block_size)
    return min(hit_blocks, max(0, request.prompt_tokens - 1) // bs) * bs


class RoutingBooks:
    """One router's policies (one per arm), ledger and output-length predictor."""

    def __init__(
        self,
        config: PolicyConfig,
        *,
        policies: Mapping[str, RoutingPolicy] | None = None,
        predictor: OutputLengthPredictor | None = None,
    ) -> None:
        self.config = config
        self.arms = arms_from_config(config)
        self.policies: dict[str, RoutingPolicy] = (
            dict(policies)
            if policies is not None
            else {a.name: make_policy(a.policy, **a.params) for a in self.arms}
        )
        missing = {a.name for a in self.arms} - self.policies.keys()
        if missing:
            raise ValueError(f"no policy object for arms {sorted(missing)}")
        self.ledger = RouterLedger()
        self.predictor = predictor or OutputLengthPredictor()
        # every step and its figures, when a list is set (tests compare hosts with it)
        self.journal: list[tuple[object, ...]] | None = None

    @classmethod
    def single(
        cls,
        policy: RoutingPolicy,
        config: PolicyConfig | None = None,
        *,
        predictor: OutputLengthPredictor | None = None,
    ) -> RoutingBooks:
        """Books for one given policy object (one arm named after it)."""
        cfg = (config or PolicyConfig()).model_copy(
            update={"name": policy.name, "params": {}, "arms": []}
        )
        return cls(cfg, policies={policy.name: policy}, predictor=predictor)

    # -- the decision ----------------------------------------------------------------------------
    def predict(
        self,
        tenant: str,
        prompt_tokens: int,
        max_tokens: int | None,
        true_output: int | None = None,
    ) -> int:
        return self.predictor.predict(tenant, prompt_tokens, max_tokens, true_output)

    def arm_for(self, request: RoutingRequest) -> Arm:
        if len(self.arms) == 1:
            return self.arms[0]
        key = sticky_key_for(self.config, request.tenant, request.session_key)
        return assign_arm(self.arms, key)

    def decide(
        self,
        request: RoutingRequest,
        snapshot: FleetSnapshot,
        matches: Mapping[str, PrefixMatch],
        arm: Arm,
    ) -> Decision:
        return self.policies[arm.name].choose(request, snapshot, matches)

    def commit(
        self,
        request: RoutingRequest,
        decision: Decision,
        snapshot: FleetSnapshot,
        arm: Arm,
        now: float,
        *,
        lookup: str = "hit",
    ) -> tuple[Routed, list[IndexOp]]:
        """Book a decision that chose a replica (before the request is sent)."""
        if decision.replica_id is None:
            raise ValueError("commit needs a decision that chose a replica")
        policy = self.policies[arm.name]
        routed = Routed(request, arm, policy, decision, decision.replica_id, lookup)
        policy.on_routed(request, decision, snapshot)
        return routed, self._reserve(routed, now)

    def _reserve(self, routed: Routed, now: float) -> list[IndexOp]:
        req, rid, cfg = routed.request, routed.replica_id, self.config
        routed.tried.append(rid)
        uncached = req.prompt_tokens - routed.predicted_hit_tokens
        if cfg.reservations:
            self.ledger.reserve(
                req.request_id, rid, req.prompt_tokens, uncached, req.predicted_output_tokens, now
            )
        ops: list[IndexOp] = []
        if cfg.speculative and req.block_hashes:
            ops.append(Speculate(rid, req.block_hashes, cfg.speculative_ttl_s))
        if self.journal is not None:
            d = routed.decision
            figures = (req.prompt_tokens, uncached, req.predicted_output_tokens)
            self.journal.append(
                ("route", req.request_id, rid, str(d.reason), d.expected_hit_blocks, *figures)
            )
            self.journal += [_entry(op) for op in ops]
        return ops

    def reroute(self, routed: Routed, snapshot: FleetSnapshot, now: float) -> list[IndexOp] | None:
        """Move a request its replica never accepted to the best untried routable candidate;
        None (and nothing changed) when there is none."""
        routable = {r.replica_id for r in snapshot.routable()}
        tried = routed.tried
        nxt = next((r for r in routed.decision.ranked if r not in tried and r in routable), None)
        if nxt is None:
            nxt = next((r for r in sorted(routable) if r not in tried), None)
        if nxt is None:
            return None
        self.ledger.release(routed.request_id)
        routed.policy.on_finished(routed.request, routed.replica_id)
        withdrawn = self._withdraw(routed)
        if self.journal is not None:
            self.journal += [_entry(op) for op in withdrawn]
        routed.decision = replace(routed.decision, replica_id=nxt, expected_hit_blocks=0)
        routed.replica_id = nxt
        routed.policy.on_routed(routed.request, routed.decision, snapshot)
        return withdrawn + self._reserve(routed, now)

    # -- the request's life ----------------------------------------------------------------------
    def first_token(self, routed: Routed) -> list[IndexOp]:
        if routed.decoding or routed.finished:
            return []
        routed.decoding = True
        self.ledger.first_token(routed.request_id)
        routed.policy.on_first_token(routed.request, routed.replica_id)
        cfg = self.config
        ops: list[IndexOp] = []
        if cfg.speculative and routed.request.block_hashes:
            ops.append(Retract(routed.replica_id, routed.request.block_hashes, cfg.retract_grace_s))
        if self.journal is not None:
            self.journal.append(("first_token", routed.request_id, routed.replica_id))
            self.journal += [_entry(op) for op in ops]
        return ops

    def finish(self, routed: Routed, output_tokens: int | None) -> list[IndexOp] | None:
        """Release everything the request holds; None when it was already finished. The ops:
        a request that ends without a first token (failed, cancelled) takes its speculative
        entry with it, since no KV event will ever confirm those blocks."""
        if routed.finished:
            return None
        routed.finished = True
        self.ledger.release(routed.request_id)
        routed.policy.on_finished(routed.request, routed.replica_id)
        if output_tokens:
            req = routed.request
            self.predictor.observe(req.tenant, req.prompt_tokens, output_tokens)
        ops = [] if routed.decoding else self._withdraw(routed)
        if self.journal is not None:
            self.journal.append(("finish", routed.request_id, routed.replica_id, output_tokens))
            self.journal += [_entry(op) for op in ops]
        return ops

    def _withdraw(self, routed: Routed) -> list[IndexOp]:
        """End at once the speculative entry of a request leaving its replica unserved."""
        if not (self.config.speculative and routed.request.block_hashes):
            return []
        return [Retract(routed.replica_id, routed.request.block_hashes, 0.0)]


def _entry(op: IndexOp) -> tuple[object, ...]:
    """An index operation as a journal entry (the hash count: hosts hash alike only in shape)."""
    if isinstance(op, Speculate):
        return ("speculate", op.replica_id, len(op.hashes), op.ttl_s)
    return ("retract", op.replica_id, len(op.hashes), op.grace_s)


__all__ = [
    "IndexOp",
    "Retract",
    "Routed",
    "RoutingBooks",
    "Speculate",
    "usable_hit_tokens",
]
