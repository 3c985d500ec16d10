"""What an ingress replica and its handle's request router share: one process, two event loops.

The Serve ingress (router/serve/ingress.py) calls the engine deployment through a
`DeploymentHandle`; the handle's request router (ours, router/serve/) runs in the same process,
on Serve's router event loop. The ingress needs two things only the request router knows:

    view(app, deployment)    the engine replicas as the request router sees them: a
                             `FleetSnapshot` of their routing stats plus its own books (the fair
                             queue's room is computed on it, as on the standalone router's fleet)
    take(request_id)         the request router's decision for a request (`Routed`: arm, policy,
                             reason, replica), once its engine answered (telemetry, the
                             `x-cp-decision` header, the fair queue's placement)

The request router `publish`es its view when Serve creates it and `decided` each decision; a
decision nobody takes (a call that did not come from an ingress) is dropped once `MAX_DECISIONS`
newer ones arrived. Reads and writes are single dict operations (atomic under the GIL); the
values are immutable snapshots or decisions the ingress only reads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Protocol

from controlplane.routing.books import Routed
from controlplane.types import FleetSnapshot

MAX_DECISIONS = 4096


class EngineView(Protocol):
    """The engine replicas as one request router sees them."""

    def snapshot(self) -> FleetSnapshot: ...


class Links:
    def __init__(self) -> None:
        self._views: dict[tuple[str, str], EngineView] = {}
        self._decisions: OrderedDict[str, Routed] = OrderedDict()
        self._lock = threading.Lock()

    def publish(self, app: str, deployment: str, view: EngineView) -> None:
        self._views[(app, deployment)] = view

    def withdraw(self, app: str, deployment: str, view: EngineView) -> None:
        if self._views.get((app, deployment)) is view:
            del self._views[(app, deployment)]

    def view(self, app: str, deployment: str) -> EngineView | None:
        return self._views.get((app, deployment))

    def decided(self, request_id: str, routed: Routed) -> None:
        with self._lock:
            self._decisions[request_id] = routed
            while len(self._decisions) > MAX_DECISIONS:
                self._decisions.popitem(last=False)

    def take(self, request_id: str) -> Routed | None:
        with self._lock:
            return self._decisions.pop(request_id, None)


# this process's links (an ingress replica and the request routers of its handles)
LINKS = Links()

__all__ = ["LINKS", "MAX_DECISIONS", "EngineView", "Links"]
