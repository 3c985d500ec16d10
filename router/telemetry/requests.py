"""What the router reports about each request when it ends: metrics, the access log, the spans.

A `RequestScope` hook (router/scope.py). Routed requests count in `cp_requests_total` by arm,
policy, decision reason and status, with their TTFT, TPOT and end-to-end time from the request's
arrival in the router, prompt and cached tokens (engine-reported and predicted); every request,
routed or refused, ends its spans with its outcome (`cp.outcome`) and usage, and a routed one
logs one JSON line.
"""

from __future__ import annotations

import logging
import time

from opentelemetry.trace import Span

from router.scope import NoHooks, Outcome, RequestScope
from router.telemetry.metrics import RouterMetrics
from router.telemetry.tracing import set_decision_attributes, set_usage_attributes

log = logging.getLogger("controlplane.router")


def decision_attributes(span: Span, scope: RequestScope) -> None:
    routed = scope.routed
    if routed is None:
        return
    set_decision_attributes(
        span,
        arm=routed.arm.name,
        policy=routed.arm.policy,
        reason=routed.decision.reason,
        replica=routed.replica_id,
        predicted_hit_blocks=routed.decision.expected_hit_blocks,
    )


class RequestTelemetry(NoHooks):
    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics

    def on_end(self, scope: RequestScope, outcome: Outcome) -> None:
        if scope.routed is not None:
            self._record(scope)
        usage = scope.usage
        for span in scope.spans:
            decision_attributes(span, scope)  # the replica may have changed on a retry
            span.set_attribute("cp.outcome", str(outcome))
            if scope.status:
                span.set_attribute("http.response.status_code", scope.status)
            if usage is not None:
                set_usage_attributes(
                    span,
                    input_tokens=usage.prompt_tokens,
                    output_tokens=usage.completion_tokens,
                    cached_tokens=usage.cached_tokens,
                )
            span.end()

    def _record(self, scope: RequestScope) -> None:
        routed = scope.routed
        assert routed is not None
        m, arm, policy = self.metrics, routed.arm.name, routed.arm.policy
        status, usage, first_at, last_at = scope.status, scope.usage, scope.first_at, scope.last_at
        m.requests.labels(arm, policy, str(routed.decision.reason), status).inc()
        started = scope.started_s
        m.e2e.labels(arm, policy).observe(time.monotonic() - started)
        if first_at is not None:
            m.ttft.labels(arm, policy).observe(first_at - started)
        if usage is not None:
            tenant = scope.tenant.tenant_id
            m.tenant_tokens.labels(tenant, "prompt").inc(usage.prompt_tokens)
            m.tenant_tokens.labels(tenant, "completion").inc(usage.completion_tokens)
            m.prompt_tokens.labels(arm, policy).inc(usage.prompt_tokens)
            m.engine_cached_tokens.labels(arm, policy).inc(usage.cached_tokens)
            m.predicted_hit_tokens.labels(arm, policy).inc(
                min(usage.prompt_tokens, routed.predicted_hit_tokens)
            )
            if first_at is not None and last_at is not None and usage.completion_tokens > 1:
                m.tpot.labels(arm, policy).observe(
                    (last_at - first_at) / (usage.completion_tokens - 1)
                )
        if log.isEnabledFor(logging.INFO):
            log.info(
                "request finished",
                extra={
                    "request_id": routed.request_id,
                    "arm": arm,
                    "policy": policy,
                    "replica": routed.replica_id,
                    "reason": str(routed.decision.reason),
                    "status": status,
                    "outcome": str(scope.outcome),
                    "lookup": routed.lookup,
                    "prompt_tokens": routed.request.prompt_tokens,
                    "predicted_hit_tokens": routed.predicted_hit_tokens,
                    "retried": len(routed.tried) > 1,
                },
            )


__all__ = ["RequestTelemetry", "decision_attributes"]
