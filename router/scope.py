"""One request's scope: everything it holds, and one place that releases it, exactly once.

    scope = RequestScope(request_id, tenant, model, hooks, started_s)
    scope.admitted()            quota reserved, entering the fair queue    -> on_admitted
    scope.routed_to(routed)     its replica is chosen (sets `routed`)       -> on_routed
    scope.first_token(at)       the replica's first chunk is here           -> on_first_token
    scope.tokens(n)             n more content events relayed               -> on_tokens
    scope.end(outcome, status)  however it ended, once                      -> on_end(outcome)

The hooks are the parts that keep books about a request, in the order they are called: the
quota (settles the reservation), the fair queue (frees the slot, refunds cached work), the
routing books (release the reservation on the replica, tell the policy), the demand meter (the
autoscaler's signal) and the telemetry (metrics, the access log line, the spans). A hook that
raises is logged and the others still run: nothing is leaked because one part failed. The scope
itself does no I/O: closing the upstream connection is the relay's, after `end`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from opentelemetry.trace import Span

from controlplane.routing.books import Routed
from controlplane.tenancy.model import Tenant
from controlplane.tenancy.quota import Reservation
from controlplane.types import RoutingRequest

if TYPE_CHECKING:
    from router.fairness.queue import Ticket
    from router.http.proxy import Usage

log = logging.getLogger("controlplane.router")


class Outcome(StrEnum):
    """How a request ended (a metric label and a span attribute)."""

    COMPLETED = "completed"  # relayed whole
    CLIENT_CLOSED = "client_closed"  # the client left
    UPSTREAM_DIED = "upstream_died"  # the replica broke the stream or went silent mid-way
    UPSTREAM_FAILED = "upstream_failed"  # no answer: refused, reset, timed out (502/503/504)
    REPLICA_ERROR = "replica_error"  # the replica answered with an error status, relayed
    REJECTED = "rejected"  # refused by the router before anything was sent (4xx, 429, 503)
    SHUTDOWN_CUT = "shutdown_cut"  # still streaming at the shutdown's grace deadline


class ScopeHooks(Protocol):
    """What a part that keeps books about requests hears of each one."""

    def on_admitted(self, scope: RequestScope) -> None: ...

    def on_routed(self, scope: RequestScope) -> None: ...

    def on_first_token(self, scope: RequestScope) -> None: ...

    def on_tokens(self, scope: RequestScope, n: int) -> None: ...

    def on_end(self, scope: RequestScope, outcome: Outcome) -> None: ...


class NoHooks:
    """Base for hooks that care about some events only."""

    def on_admitted(self, scope: RequestScope) -> None:
        return None

    def on_routed(self, scope: RequestScope) -> None:
        return None

    def on_first_token(self, scope: RequestScope) -> None:
        return None

    def on_tokens(self, scope: RequestScope, n: int) -> None:
        return None

    def on_end(self, scope: RequestScope, outcome: Outcome) -> None:
        return None


@dataclass(slots=True, eq=False)
class RequestScope:
    request_id: str
    tenant: Tenant
    model: str
    hooks: tuple[ScopeHooks, ...]
    started_s: float
    stream: bool = False
    request: RoutingRequest | None = None
    reservation: Reservation | None = None
    ticket: Ticket | None = None
    routed: Routed | None = None
    spans: tuple[Span, ...] = ()
    # a replica may have started the request (False: none ever accepted it)
    reached: bool = False
    # the replica answered with a 4xx: it did no work
    refused_by_replica: bool = False
    usage: Usage | None = None
    # content events relayed to the client
    streamed: int = 0
    first_at: float | None = None
    last_at: float | None = None
    outcome: Outcome | None = None
    # the `status` label: an HTTP status, or client_closed / upstream_died
    status: str = ""
    _admitted: bool = field(default=False, repr=False)
    _routed_told: str | None = field(default=None, repr=False)  # the replica the hooks know

    @property
    def ended(self) -> bool:
        return self.outcome is not None

    def admitted(self) -> None:
        if self._admitted or self.ended:
            return
        self._admitted = True
        for h in self.hooks:
            h.on_admitted(self)

    def routed_to(self, routed: Routed) -> None:
        """The request's replica is chosen (by this router, or by Serve's request router as the
        ingress learns it, or again after a reroute): `routed` is the scope's; the hooks hear
        of each new replica once, never after the end."""
        self.routed = routed
        if self._routed_told == routed.replica_id or self.ended:
            return
        self._routed_told = routed.replica_id
        for h in self.hooks:
            h.on_routed(self)

    def first_token(self, at: float) -> None:
        if self.first_at is not None or self.ended:
            return
        self.first_at = self.last_at = at
        for h in self.hooks:
            h.on_first_token(self)

    def tokens(self, n: int, at: float) -> None:
        self.last_at = at
        if n <= 0 or self.ended:
            return
        self.streamed += n
        for h in self.hooks:
            h.on_tokens(self, n)

    def end(self, outcome: Outcome, status: str) -> bool:
        """Release everything, once; True the first time."""
        if self.outcome is not None:
            return False
        self.outcome, self.status = outcome, status
        for h in self.hooks:
            try:
                h.on_end(self, outcome)
            except Exception:  # one part's bug must not leak the others' books
                log.exception("request %s: %s failed to close", self.request_id, type(h).__name__)
        return True


__all__ = ["NoHooks", "Outcome", "RequestScope", "ScopeHooks"]
