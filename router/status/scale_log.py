"""The last decisions of an autoscaler running in the router's process, for the status view.

    log = ScaleLog(size=20)
    controller.on_tick.append(log.record)       every tick's `TickResult`
                                                (autoscaler/controller.py)
    runtime.status_sources.append(log.entries)   shown by /admin/status, /status and
                                                `controlplane status`

Bounded: the oldest decisions go first. Entries are stamped with the injected wall clock.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from autoscaler.controller import TickResult
from controlplane.errors import ConfigError
from router.status.model import ScaleEntry


class ScaleLog:
    def __init__(self, size: int = 20, *, wall: Callable[[], float] = time.time) -> None:
        if size < 1:
            raise ConfigError("the scale log needs room for at least one decision")
        self._entries: deque[ScaleEntry] = deque(maxlen=size)
        self._wall = wall

    def record(self, result: TickResult) -> None:
        self._entries.append(
            ScaleEntry(
                at_s=self._wall(),
                target=result.decision.target,
                reason=str(result.decision.reason),
                ready=result.fleet.ready,
                loading=max(0, result.fleet.spec - result.fleet.ready),
            )
        )

    def entries(self) -> list[ScaleEntry]:
        return list(self._entries)


__all__ = ["ScaleLog"]
