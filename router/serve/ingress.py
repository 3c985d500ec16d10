"""The router's request path on Ray Serve: the OpenAI ingress in front of an engine deployment.

    rt = IngressRuntime(settings, HandlePool(engine_handle), app="fleet", deployment="engine")
    app = create_app(settings, rt)          # the standalone router's app, endpoints and scope

One request goes through exactly the standalone router's code (router/http/relay.py): API key ->
tenant, validation and tokenizing (`RouterCore.build`), the quota, the fair queue, the request
scope and its hooks, the relay of the stream with usage accounting, the OpenAI error bodies.
Two steps differ, both seams of `RouterRuntime`:

    route     nothing here: the replica is chosen inside the handle, by the engine deployment's
              request router (router/serve/), when the call is made
    exchange  `HandleExchange.open`: the request goes to the engine deployment through the
              handle (router/serve/upstream.py, driven by the same `Proxy.send`: first-chunk
              deadline, a 503 or an unreachable replica retried once within the retry budget);
              when the engine's head arrives, the request router's decision for the request
              (router/serve/links.py) becomes the scope's `routed` (telemetry, `x-cp-decision`)
              and the fair queue's slot moves to the replica it chose

What the fleet is to the standalone router, the request router's view is here: the fair queue's
room and `/ready` count the engine replicas it sees (`links.view`: their routing stats plus its
books), and the model group (block size, context length: the 400 beyond it, `/v1/models`) is
read from it every `GROUPS_TICK_S`. The routing books (ledger, policies, speculative index
entries) are the request router's, kept by Serve's routing hooks in this same process; the
scope's hooks are the quota, the fair queue, the demand meter (what the ingress reports to the
engine deployment's autoscaler: autoscaler/hosts/ray_ingress.py) and the telemetry.

The configuration is the standalone router's (`RouterSettings`) without `replicas` (the engine
deployment's replicas are the fleet) and with a tokenizer of its own (a model directory or
`approx`: `remote` asks a replica's `/tokenize`, which the ingress does not address).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from controlplane.drift import GroupDrift
from controlplane.errors import ConfigError
from controlplane.roofline.profile import EngineProfile
from controlplane.routing.books import Routed
from controlplane.types import FleetSnapshot
from router.config import RouterSettings
from router.core import Prefetch, RouterCore
from router.fairness.queue import Ticket
from router.fleet.groups import ModelGroup, ModelGroups
from router.http.h1 import Header
from router.http.proxy import NotAccepted, Upstream
from router.http.relay import Exchange, _refusal
from router.runtime import RouterRuntime
from router.scope import RequestScope
from router.serve.links import LINKS, EngineView
from router.serve.upstream import HandlePool
from router.telemetry import DECISION_HEADER, parse_decision_header

log = logging.getLogger("controlplane.router.serve")

# how long the ingress waits at startup for its handle's request router (Serve creates it when the
# engine deployment's config reaches the handle) to see an engine replica: until then the fair
# queue sees none (503, as a standalone router before its replicas are ready)
VIEW_WAIT_S = 30.0

# how often the engines' model group (members, block size, context) is read from the view
GROUPS_TICK_S = 0.5

# the replica id `Proxy.send` records failures under before the decision is known (the live
# fleet of an ingress is empty: nothing is recorded)
UNDECIDED = "-"


class HandleExchange(Exchange):
    """The upstream side of one request on Serve: through the engine deployment's handle."""

    rt: IngressRuntime

    async def open(self, path: str, payload: bytes, headers: list[Header]) -> Upstream:
        rt, scope, proxy = self.rt, self.scope, self.rt.proxy
        proxy.budget.deposit()
        retried = False
        while True:
            try:
                scope.reached = True
                up = await proxy.send(rt.engines, UNDECIDED, path, payload, headers)
            except NotAccepted as exc:
                scope.reached = False
                refused = f"the engine deployment refused the request ({exc.kind})"
                if retried or not proxy.budget.spend():
                    raise _refusal(exc.kind, refused) from None
                retried = True
                rt.metrics.retries.labels(exc.kind).inc()
                continue
            rt.adopt(scope, up)
            return self.accepted(up)


class IngressRuntime(RouterRuntime):
    exchange_type = HandleExchange

    def __init__(
        self,
        settings: RouterSettings,
        engines: HandlePool,
        *,
        app: str,
        deployment: str,
        **kwargs: Any,
    ) -> None:
        check_settings(settings)
        self.engines = engines
        self.app_name, self.deployment = app, deployment
        super().__init__(settings, **kwargs)
        # the routing books are the request router's (kept by Serve's hooks): not this scope's
        self.hooks = tuple(h for h in self.hooks if h is not self.core)

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + VIEW_WAIT_S
        while self.ready_count() == 0 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        self.refresh_groups()
        self._groups = asyncio.get_running_loop().create_task(self._track_groups())
        if self.view is None:
            log.warning(
                "no request router of ours for %s/%s after %.0f s: is the engine deployment's "
                "request_router_class router.serve.ingress_router:IngressRequestRouter?",
                self.app_name,
                self.deployment,
                VIEW_WAIT_S,
            )

    def refresh_groups(self) -> None:
        """The engines' model group, as a standalone router's fleet describes its replicas:
        the members, their block size and context length (`max_model_len`) from their reports
        (one model per engine deployment). `RouterCore.build` refuses a request beyond the
        context with the standalone's 400, and `/v1/models` lists the context."""
        replicas = self.fleet_snapshot().replicas
        if not replicas:
            return  # keep the last known group while no replica reports
        model = self.settings.served_model
        contexts = {r.replica_id: r.profile.resolved_max_model_len for r in replicas}
        ref = replicas[0].profile
        group = ModelGroup(
            model=model,
            members=frozenset(contexts),
            drift=GroupDrift(model, None, {}),
            block_size=ref.resolved_block_size,
            max_model_len=ref.resolved_max_model_len,
            contexts=contexts,
        )
        self.fleet.groups = ModelGroups({model: group})

    async def _track_groups(self) -> None:
        while True:
            await asyncio.sleep(GROUPS_TICK_S)
            try:
                self.refresh_groups()
            except Exception:  # a malformed report must not end the tracking
                log.exception("cannot read the engines' model group")

    async def aclose(self) -> None:
        task = getattr(self, "_groups", None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await super().aclose()

    @property
    def view(self) -> EngineView | None:
        return LINKS.view(self.app_name, self.deployment)

    def fleet_snapshot(self) -> FleetSnapshot:
        view = self.view
        return view.snapshot() if view is not None else FleetSnapshot(())

    def ready_count(self) -> int:
        return len(self.fleet_snapshot().routable())

    async def route(self, scope: RequestScope, ticket: Ticket, prefetched: Prefetch | None) -> None:
        """The handle's request router chooses, when the call is made (see `adopt`)."""
        RouterCore.discard(prefetched)

    def adopt(self, scope: RequestScope, up: Upstream) -> None:
        """The engine answered: its request router's decision becomes the scope's."""
        routed = LINKS.take(scope.request_id)
        if routed is not None:
            scope.routed_to(routed)
            up.replica_id = routed.replica_id
        else:  # a request router that is not ours: the replica, if the engine names it
            named = parse_decision_header(up.response.header(DECISION_HEADER.encode()).decode())
            up.replica_id = named.get("replica", UNDECIDED)
        if scope.ticket is not None and up.replica_id != UNDECIDED:
            prof = self.profile_named(up.replica_id)
            if prof is not None:
                self.fairq.place(scope.ticket, up.replica_id, prof)

    def profile_named(self, replica_id: str) -> EngineProfile | None:
        rep = self.fleet_snapshot().by_id().get(replica_id)
        return rep.profile if rep is not None else None

    def profile_of(self, routed: Routed) -> EngineProfile:
        prof = self.profile_named(routed.replica_id)
        if prof is None:
            raise ConfigError(f"engine replica {routed.replica_id} is not in the request view")
        return prof


def check_settings(settings: RouterSettings) -> None:
    """What the Serve ingress refuses of a standalone router's settings (`ConfigError`)."""
    if settings.replicas:
        raise ConfigError(
            "the Serve ingress's replicas are its engine deployment's: remove `replicas` from "
            "its router settings"
        )
    if settings.tokenizer == "remote":
        raise ConfigError(
            "the Serve ingress tokenizes prompts itself: set `tokenizer` to the model's "
            "directory (or tokenizer.json), or to `approx`"
        )
    f = settings.fleet
    if f.shared or f.dns_name or f.kubernetes is not None:
        raise ConfigError(
            "the Serve ingress discovers no replicas (fleet.shared, fleet.dns_name, "
            "fleet.kubernetes): its engines are its engine deployment's replicas"
        )


__all__ = ["UNDECIDED", "HandleExchange", "IngressRuntime", "check_settings"]
