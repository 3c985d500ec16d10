"""Time-weighted averages of a metric over a trailing window, for the baselines' frozen state.

A baseline keeps the last few `(t_end, interval, value)` points (one per `DemandSample`: the
sample's time, its interval and the averaged metric) in a tuple. `window_average(points, now,
w)` weighs each point by the overlap of `[t_end - interval, t_end]` with `[now - w, now]`;
points outside the window weigh nothing, and `prune` drops them.
"""

from __future__ import annotations

Point = tuple[float, float, float]


def push(
    points: tuple[Point, ...], t_end: float, interval: float, value: float
) -> tuple[Point, ...]:
    return (*points, (t_end, max(0.0, interval), value))


def prune(points: tuple[Point, ...], now: float, keep_s: float) -> tuple[Point, ...]:
    """Drop the points that ended before `now - keep_s`."""
    lo = now - keep_s
    return tuple(p for p in points if p[0] > lo)


def window_average(points: tuple[Point, ...], now: float, window_s: float) -> float:
    """Time-weighted mean of the points over `[now - window_s, now]` (0 when nothing overlaps;
    a point with a zero interval counts as an instant with weight 1e-9)."""
    lo = now - window_s
    total = weight = 0.0
    for t_end, interval, value in points:
        start = t_end - interval
        overlap = min(now, t_end) - max(lo, start)
        if interval <= 0 and lo <= t_end <= now:
            overlap = 1e-9
        if overlap <= 0:
            continue
        total += value * overlap
        weight += overlap
    return total / weight if weight > 0 else 0.0
