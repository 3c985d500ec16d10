"""The last routing decisions of this router, for the status view: a bounded ring.

    ring.record(routed)     called by `RouterCore.route` once a decision is committed: O(1)
    ring.entries()          the kept `DecisionEntry`s, oldest first (at most `size`)

The entry keeps the chosen replica, the decision's reason, the tenant, the policy (A/B arm) and
the predicted prefix-hit tokens, stamped with the injected wall clock; never the prompt, its
hashes or the request's salt. A reroute moves a request without a new decision: not recorded.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from controlplane.errors import ConfigError
from controlplane.routing.books import Routed
from router.status.model import DecisionEntry

DEFAULT_SIZE = 50


class DecisionRing:
    def __init__(self, size: int = DEFAULT_SIZE, *, wall: Callable[[], float] = time.time) -> None:
        if size < 1:
            raise ConfigError("the decision ring needs room for at least one decision")
        self._entries: deque[DecisionEntry] = deque(maxlen=size)
        self._wall = wall

    @property
    def size(self) -> int:
        return self._entries.maxlen or 0

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, routed: Routed) -> None:
        self._entries.append(
            DecisionEntry(
                at_s=self._wall(),
                replica=routed.replica_id,
                reason=str(routed.decision.reason),
                tenant=routed.request.tenant,
                policy=routed.arm.name,
                hit_tokens=routed.predicted_hit_tokens,
            )
        )

    def entries(self) -> list[DecisionEntry]:
        return list(self._entries)


__all__ = ["DEFAULT_SIZE", "DecisionRing"]
