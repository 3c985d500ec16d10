"""Per-request records of a simulated run and the figures a replay reports.

Definitions (all times in seconds):

- TTFT = first token - arrival; TPOT = (finish - first token) / (output tokens - 1), for requests
  with more than one output token; E2E = finish - arrival.
- prefix hit rate = prompt tokens served from the prefix cache at first admission / prompt tokens
  (what vLLM reports per request as `usage.prompt_tokens_details.cached_tokens`).
- goodput = requests meeting both SLOs (TTFT <= slo_ttft and TPOT <= slo_tpot) per second of the
  trace's arrival span, so every policy on the same trace shares the denominator.
- output tokens/s = output tokens / (last finish - first arrival).
- load imbalance = max over replicas of busy time / mean busy time (1.0 = perfectly even).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    tenant: str
    priority: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    router: int = 0
    replica: str = ""
    reason: str = ""
    expected_hit_blocks: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    first_token_s: float = -1.0
    finish_s: float = -1.0
    # when a router-side tenant queue sent it on (-1: routed at arrival)
    dispatched_s: float = -1.0
    # the A/B arm that routed it (the policy's name without a split)
    arm: str = ""
    # non-empty when the request did not complete: why
    rejected: str = ""

    @property
    def completed(self) -> bool:
        return not self.rejected and self.finish_s >= 0

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        if self.output_tokens <= 1:
            return 0.0
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    replica_id: str
    busy_s: float
    steps: int
    tokens_out: int
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    joined_s: float
    ready_s: float
    left_s: float


@dataclass(slots=True)
class FleetResult:
    records: list[RequestRecord]
    replicas: list[ReplicaStats]
    simulated_s: float
    wall_s: float
    trace_span_s: float
    kv_events_applied: int = 0
    meta: dict[str, object] = field(default_factory=dict)

    def completed(self) -> list[RequestRecord]:
        return [r for r in self.records if r.completed]

    def only_arm(self, arm: str) -> FleetResult:
        """The requests one A/B arm routed (fleet-wide figures, such as preemptions and load
        imbalance, stay the whole fleet's: the arms shared it)."""
        return FleetResult(
            records=[r for r in self.records if r.arm == arm],
            replicas=self.replicas,
            simulated_s=self.simulated_s,
            wall_s=self.wall_s,
            trace_span_s=self.trace_span_s,
            kv_events_applied=self.kv_events_applied,
            meta=self.meta,
        )

    def summary(self, slo_ttft_s: float, slo_tpot_s: float) -> dict[str, float]:
        """The figures `controlplane replay` prints and writes (see the module docstring)."""
        done = self.completed()
        ttft = np.array([r.ttft_s for r in done]) if done else np.zeros(1)
        e2e = np.array([r.e2e_s for r in done]) if done else np.zeros(1)
        multi = [r for r in done if r.output_tokens > 1]
        tpot = np.array([r.tpot_s for r in multi]) if multi else np.zeros(1)
        prompt = sum(r.prompt_tokens for r in done)
        cached = sum(r.cached_tokens for r in done)
        good = sum(
            1
            for r in done
            if r.ttft_s <= slo_ttft_s and (r.output_tokens <= 1 or r.tpot_s <= slo_tpot_s)
        )
        first = min((r.arrival_s for r in self.records), default=0.0)
        last_finish = max((r.finish_s for r in done), default=first)
        out_tokens = sum(r.output_tokens for r in done)
        busy = [s.busy_s for s in self.replicas if s.busy_s > 0] or [0.0]
        span = self.trace_span_s if self.trace_span_s > 0 else max(1e-9, last_finish - first)
        return {
            "requests": float(len(self.records)),
            "completed": float(len(done)),
            "failed": float(len(self.records) - len(done)),
            "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p90_s": float(np.percentile(ttft, 90)),
            "ttft_p99_s": float(np.percentile(ttft, 99)),
            "tpot_p50_s": float(np.percentile(tpot, 50)),
            "tpot_p99_s": float(np.percentile(tpot, 99)),
            "e2e_p50_s": float(np.percentile(e2e, 50)),
            "e2e_p99_s": float(np.percentile(e2e, 99)),
            "prefix_hit_rate": cached / prompt if prompt else 0.0,
            "goodput_rps": good / span,
            "slo_attainment": good / len(self.records) if self.records else 0.0,
            "output_tokens_per_s": out_tokens / max(1e-9, last_finish - first),
            "load_imbalance": max(busy) / (sum(busy) / len(busy)) if sum(busy) > 0 else 1.0,
            "preemptions": float(sum(s.preemptions for s in self.replicas)),
        }

    def reasons(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.records:
            counts[r.reason] = counts.get(r.reason, 0) + 1
        return counts
