"""The arrival rate of demand, from a cumulative counter read whenever the status is asked for.

    window.observe(now, total) -> (rate, span) | None

Each call keeps (now, total) and drops readings older than `window_s`, but always keeps the
newest one older than the window, so the rate spans at least `window_s` once the router has been
watched that long. rate = (total - oldest total) / (now - oldest now); None until two readings
are `min_span_s` apart. A counter that went down (a reset) restarts the window. Memory is
bounded by `max_points` (the oldest readings go first).
"""

from __future__ import annotations

from collections import deque

from controlplane.errors import ConfigError


class RateWindow:
    def __init__(self, window_s: float = 30.0, *, min_span_s: float = 1.0, max_points: int = 512):
        if window_s <= 0 or min_span_s <= 0 or max_points < 2:
            raise ConfigError("a rate window needs a positive span and room for two readings")
        self.window_s = window_s
        self.min_span_s = min_span_s
        self._points: deque[tuple[float, float]] = deque(maxlen=max_points)

    def observe(self, now: float, total: float) -> tuple[float, float] | None:
        pts = self._points
        if pts and (total < pts[-1][1] or now < pts[-1][0]):
            pts.clear()
        pts.append((now, total))
        while len(pts) > 2 and now - pts[1][0] >= self.window_s:
            pts.popleft()
        t0, v0 = pts[0]
        span = now - t0
        if span < self.min_span_s:
            return None
        return (total - v0) / span, span


__all__ = ["RateWindow"]
