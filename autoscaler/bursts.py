"""A burst memory: a log-binned, exponentially decayed histogram of burst ratios.

The headroom policy keeps, per tick, the ratio of the prefill work that arrived in the tick to
its recent mean, weighted by that work. `burst_quantile(weights, q)` then answers "the ratio
below which a share q of the prefill work arrived": a quantile over requests, not over ticks,
which is what an SLO over requests needs. Bins are log-spaced over [BURST_LO, BURST_HI)
(192 bins: about 3% wide), so the state is a small tuple of floats; a quantile is reported as
its bin's upper edge (conservative by at most one bin). Bins of 12% cost light traffic whole
replicas: a burst that needs 4.1 replicas was carried as up to 4.6, and a fleet of four held
five all day (docs/autoscaling.md, light traffic).
"""

from __future__ import annotations

import math

# burst-ratio histogram: log-spaced bins over [BURST_LO, BURST_HI)
BURST_LO, BURST_HI, BURST_BINS = 0.25, 64.0, 192
_BURST_STEP = math.log(BURST_HI / BURST_LO) / BURST_BINS


def burst_bin(ratio: float) -> int:
    if ratio <= BURST_LO:
        return 0
    return min(BURST_BINS - 1, int(math.log(ratio / BURST_LO) / _BURST_STEP))


def burst_quantile(weights: tuple[float, ...], q: float) -> float:
    """Upper edge of the bin where the weighted cumulative share reaches `q` (1.0 if empty)."""
    total = sum(weights)
    if total <= 0:
        return 1.0
    acc = 0.0
    for i, w in enumerate(weights):
        acc += w
        if acc >= q * total:
            return float(BURST_LO * math.exp(_BURST_STEP * (i + 1)))
    return BURST_HI


def empty_bursts() -> tuple[float, ...]:
    return (0.0,) * BURST_BINS


def add_burst(
    weights: tuple[float, ...], ratio: float, work: float, decay: float
) -> tuple[float, ...]:
    """Decay every bin by `decay` and add `work` to the bin of `ratio`."""
    i = burst_bin(ratio)
    return tuple(w * decay + (work if k == i else 0.0) for k, w in enumerate(weights))


__all__ = [
    "BURST_BINS",
    "BURST_HI",
    "BURST_LO",
    "add_burst",
    "burst_bin",
    "burst_quantile",
    "empty_bursts",
]
