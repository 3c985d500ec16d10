"""Our RequestRouter as the Serve ingress's handle runs it: `IngressRequestRouter`.

`PolicyRequestRouter` (router/serve/request_router.py) with the two things the OpenAI ingress in
the same process reads from it (router/serve/links.py):

- its view of the engine replicas: `snapshot()`, the `FleetSnapshot` its policies decide on
  (every running replica's last routing stats plus this router's books), published under
  (app, deployment) when Serve creates the router; the ingress's fair queue sizes its room on it;
- each decision, under the request id the ingress sent in the call's `x-request-id` header, once
  Serve routed the call (re-published when Serve sent it to a later tier than the first choice).

Select it with `RequestRouterConfig(request_router_class=INGRESS_ROUTER, request_router_kwargs=
...)` (the kwargs of `PolicyRequestRouter.initialize_state`; without `redis_url`, the Redis of the
router settings in this process's environment, `CP_REDIS__URL`, as the ingress reads it); calls
without an ingress behind them are routed exactly as by `PolicyRequestRouter`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from controlplane.types import FleetSnapshot
from router.serve.links import Links
from router.serve.request_router import PolicyRequestRouter
from router.serve.stats import EngineStats

INGRESS_ROUTER = "router.serve.ingress_router:IngressRequestRouter"


def _links() -> Links:
    """This process's links. Serve ships a request router's module by value (cloudpickle), so
    a module-level reference to the singleton would travel as a copy: import it where it runs."""
    from router.serve.links import LINKS

    return LINKS


def request_key(pending: PendingRequest | None) -> str | None:
    """The `x-request-id` of an engine call's headers (the ingress's request id)."""
    if pending is None:
        return None
    headers: Any = pending.kwargs.get("headers")
    if headers is None and len(pending.args) > 2:
        headers = pending.args[2]
    if not isinstance(headers, Sequence):
        return None
    for pair in headers:
        if len(pair) == 2 and str(pair[0]).lower() == "x-request-id":
            return str(pair[1])
    return None


class IngressRequestRouter(PolicyRequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:  # type: ignore[override]
        if "redis_url" not in kwargs:  # the environment's, as the ingress beside it reads it
            from router.config import load_settings

            redis = load_settings().redis
            kwargs |= {"redis_url": redis.url, "key_prefix": redis.key_prefix}
        super().initialize_state(**kwargs)
        dep = self._deployment_id
        self._view_key = (dep.app_name, dep.name) if dep is not None else None
        if self._view_key is not None:
            _links().publish(*self._view_key, self)

    def snapshot(self) -> FleetSnapshot:
        """The engine replicas that reported their stats, as the policies see them (any
        thread). One that has not reported yet (just started) is not in it: its KV capacity
        and profile are unknown, so the ingress's fair queue gives it no room yet."""
        stats = {}
        for r in list(self.curr_replicas.values()):
            s = EngineStats.from_dict(r.routing_stats)
            if s is not None:
                stats[r.replica_id.unique_id] = s
        if not stats:
            return FleetSnapshot((), time.time())
        with self._lock:
            return self.routing.snapshot(dict(stats), self.books.ledger, time.time())

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        tiers = await super().choose_replicas(candidate_replicas, pending_request)
        self._publish(pending_request)
        return tiers

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        self._publish(pending_request)  # the booking may have moved to a later tier

    def _publish(self, pending: PendingRequest | None) -> None:
        key = request_key(pending)
        if key is None or pending is None:
            return
        with self._lock:
            routed = self._routed.get(pending.metadata.internal_request_id)
        if routed is not None:
            _links().decided(key, routed)


__all__ = ["INGRESS_ROUTER", "IngressRequestRouter", "request_key"]
