"""Building blocks shared by the synthetic workload generators.

Determinism: every generator draws from `random.Random` instances seeded from its `seed` (and, for
independent streams, a label: `random.Random(f"{seed}:{label}")`, which Python hashes with SHA-512,
so it does not depend on `PYTHONHASHSEED`). Nothing reads the global `random` state or the clock.

Content ids. Generators describe content in blocks of `block` tokens (default 64, which engine
block sizes 16, 32 and 64 all divide). Ids come from an `IdAllocator`: a counter inside a
namespace,

    id = namespace << 32 | counter,      namespace in [1, 2**16),   counter < 2**32

so ids stay below 2**48 (engine hashes `id * (block // B)` stay far below the simulator's unique
tag at 2**62), never equal a file trace's ids (Mooncake ids are small counters, namespace 0), and
one generator call never reuses an id. The default namespace is derived from the generator's
name and seed (`namespace_for`); two different generator calls collide only if their derived
namespaces do (probability 2**-16 per pair): pass distinct `namespace=` values, or combine traces
with `transform.concat(..., distinct_ids=True)`, when that matters.

Arrival processes: Poisson (exponential gaps), a Gamma renewal process with a given coefficient
of variation (cv = 1 is Poisson, cv > 1 burstier), and a piecewise-constant-rate Poisson process
(restarting the exponential clock at each segment boundary is exact, by memorylessness).

Lengths: `lognormal_int(mean, cv)` has the requested mean and coefficient of variation
(sigma^2 = ln(1 + cv^2), mu = ln(mean) - sigma^2 / 2), rounded and clipped to [lo, hi]; cv = 0
returns the mean.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence

from controlplane.errors import ConfigError
from controlplane.traces.model import Trace, TraceRequest

DEFAULT_ID_BLOCK = 64
_NAMESPACES = 1 << 16
_COUNTER_BITS = 32


def namespace_for(kind: str, seed: int) -> int:
    """A stable namespace in [1, 2**16) for a generator kind and seed."""
    digest = hashlib.blake2b(f"{kind}:{seed}".encode(), digest_size=8).digest()
    return 1 + int.from_bytes(digest, "big") % (_NAMESPACES - 1)


class IdAllocator:
    """Hands out fresh content ids `namespace << 32 | counter`, counting up from 0."""

    __slots__ = ("_next", "namespace")

    def __init__(self, namespace: int) -> None:
        if not 1 <= namespace < _NAMESPACES:
            raise ConfigError(f"id namespace must be in [1, {_NAMESPACES}), got {namespace}")
        self.namespace = namespace
        self._next = namespace << _COUNTER_BITS

    def take(self, n: int) -> tuple[int, ...]:
        """`n` ids never handed out before by this allocator."""
        start = self._next
        self._next += max(0, n)
        if self._next - (self.namespace << _COUNTER_BITS) >= 1 << _COUNTER_BITS:
            raise ConfigError("content id namespace exhausted (2**32 ids); generate less")
        return tuple(range(start, self._next))


def allocator(kind: str, seed: int, namespace: int = 0) -> IdAllocator:
    """The allocator a generator uses: `namespace` if given (non-zero), else derived."""
    return IdAllocator(namespace or namespace_for(kind, seed))


def blocks_for(tokens: int, block: int) -> int:
    """Ids needed to describe `tokens` tokens (the last one may be partial)."""
    return -(-tokens // block)


def check_positive(**values: float) -> None:
    for key, value in values.items():
        if not value > 0:
            raise ConfigError(f"{key} must be positive, got {value}")


def check_block(block: int) -> None:
    if block <= 0 or block % 16:
        raise ConfigError(f"block must be a positive multiple of 16 tokens, got {block}")


def lognormal_int(
    rng: random.Random, mean: float, cv: float, lo: int = 1, hi: int = 1 << 30
) -> int:
    """A lognormal draw with the given mean and coefficient of variation, as a clipped int."""
    if cv <= 0:
        return min(hi, max(lo, round(mean)))
    sigma2 = math.log1p(cv * cv)
    value = rng.lognormvariate(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))
    return min(hi, max(lo, round(value)))


def renewal_times(
    rng: random.Random,
    rate: float,
    *,
    cv: float = 1.0,
    duration: float | None = None,
    count: int | None = None,
    start: float = 0.0,
) -> list[float]:
    """Arrival times of a renewal process (Gamma gaps of mean 1/rate and CV `cv`).

    Stops at `count` arrivals or at `start + duration`, whichever comes first (one is required).
    """
    if duration is None and count is None:
        raise ConfigError("an arrival process needs a duration or a count")
    check_positive(rate=rate, cv=cv)
    shape = 1.0 / (cv * cv)
    end = math.inf if duration is None else start + duration
    limit = math.inf if count is None else count
    times: list[float] = []
    t = start
    while len(times) < limit:
        t += rng.expovariate(rate) if cv == 1.0 else rng.gammavariate(shape, 1.0 / (rate * shape))
        if t >= end:
            break
        times.append(t)
    return times


def piecewise_poisson(
    rng: random.Random, segments: Sequence[tuple[float, float, float]]
) -> list[float]:
    """Poisson arrivals over consecutive segments `(start, end, rate)` (rate 0 = silent)."""
    times: list[float] = []
    for a, b, rate in segments:
        if rate <= 0 or b <= a:
            continue
        t = a + rng.expovariate(rate)
        while t < b:
            times.append(t)
            t += rng.expovariate(rate)
    return times


def make_trace(name: str, requests: Sequence[TraceRequest], meta: dict[str, object]) -> Trace:
    """The generator's result: sorted by arrival, request ids filled as `<name>-<index>`."""
    return Trace(name=name, requests=tuple(requests), meta=meta).sorted()
