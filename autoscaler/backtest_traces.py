"""The backtest's traces: hours of load with a daily swing, deterministic for a seed.

Both compress a day into `day_s` seconds (default 2 h, so a run simulates in under a minute)
with the rate multiplier

    m(t) = trough + (1 - trough) * (1 - cos(2 pi t / day_s)) / 2        (m in [trough, 1])

that starts at the night-time trough, peaks at mid-day (`day_s / 2`) and comes back down. The
ramp is slow against a 240 s load time (trough to peak over 1 h), so a planner that looks one
load time ahead can follow it; what it cannot follow are the bursts inside it.

- `azure-code-diurnal`: the Azure LLM inference 2023 code trace (the real file under the data
  folder, else the bundled excerpt), replayed `peak_rate_scale` x faster (inter-arrival times
  divided, numbers.md 7.3), repeated back to back to cover the day, then thinned: each request is
  kept with probability `m(t)` (a seeded `random.Random`; max m = 1, so the peak keeps the
  trace's own rate and its bursts: they shrink with the thinning but are not smoothed away).
- `synthetic-diurnal-tenants`: three tenants with their own lengths (lognormal, `generators`),
  each a Poisson process whose rate is `peak_rate * m(t)`, piecewise constant over 60 s segments:
  `chat` (1,500-token prompts / 300 output, interactive), `longdoc` (8,000 / 300, interactive,
  prompts CV 0.3, capped at `MAX_PROMPT` = 12,000 tokens so every request can meet a 2-s TTFT)
  and `batch` (2,000 / 500, batch priority, whose day peaks a third of a day after the others,
  when offline jobs are submitted). Mixed long and short prompts make the
  prefill SCV well above 1, so the SLO-compatible utilization is lower than on the code trace.

Peaks are sized for Llama-3.1-70B at TP2 on H200 (`BACKTEST_MODEL`, `BACKTEST_GPU`, 141 GB per GPU
leaves ~380k tokens of KV next to the weights): a swing of about 4 to 17 replicas (static peak
17 on the code trace, 11 on the synthetic one). TP2 rather than TP4 on H100 halves the requests
per replica, so the simulated request count (the simulator's cost) stays near 90k per 2-h day.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from dataclasses import replace

from controlplane.errors import ConfigError
from controlplane.traces import load_trace, rebase, repeat, scale_rate, window
from controlplane.traces.generators.common import lognormal_int, make_trace, piecewise_poisson
from controlplane.traces.model import Trace, TraceRequest
from controlplane.types import PriorityClass

BACKTEST_MODEL = "llama-3.1-70b"
BACKTEST_GPU = "h200"
BACKTEST_TP = 2
DAY_S = 2 * 3600.0
# documents are chunked to this: a longer prompt's prefill alone would exceed a 2-s TTFT SLO
MAX_PROMPT = 12_000


def diurnal(t: float, day_s: float = DAY_S, trough: float = 0.25, shift_s: float = 0.0) -> float:
    """The day's rate multiplier m(t) in [trough, 1] (see the module docstring)."""
    phase = 2 * math.pi * (t - shift_s) / day_s
    return trough + (1.0 - trough) * (1.0 - math.cos(phase)) / 2.0


def trace_day(
    source: str,
    *,
    day_s: float = DAY_S,
    rate_scale: float = 1.0,
    trough: float = 0.25,
    diurnal_swing: bool = True,
    seed: int = 0,
    name: str | None = None,
) -> Trace:
    """Any trace `load_trace` reads (a JSONL or CSV file, a short name, a `gen:` spec) over a
    compressed day: arrivals `rate_scale` x faster, the trace repeated back to back to cover
    `day_s`, then (with `diurnal_swing`) thinned by `diurnal(t)` with a seeded RNG. Without
    the swing the trace keeps its own shape (a day-long file: `rate_scale = 86400 / day_s`
    compresses it into `day_s`)."""
    if day_s <= 0 or rate_scale <= 0 or not 0 < trough <= 1:
        raise ConfigError("day_s and rate_scale must be positive, trough in (0, 1]")
    base = rebase(scale_rate(load_trace(source), rate_scale))
    if not base.requests:
        raise ConfigError(f"trace {source!r} has no requests")
    copies = max(1, math.ceil(day_s / max(base.duration_s, 1e-9)) + 1)
    day = window(repeat(base, copies), 0.0, day_s)
    label = name or f"{base.name}-day"
    kept = list(day.requests)
    if diurnal_swing:
        rng = random.Random(f"{seed}:{label}")
        kept = [r for r in kept if rng.random() < diurnal(r.arrival_s, day_s, trough)]
    meta = {
        "source": base.name,
        "day_s": day_s,
        "peak_rate_scale": rate_scale,
        "trough": trough if diurnal_swing else 1.0,
        "seed": seed,
    }
    return replace(day, name=label).with_requests(kept, diurnal=meta)


def azure_code_diurnal(
    *,
    day_s: float = DAY_S,
    peak_rate_scale: float = 8.0,
    trough: float = 0.25,
    seed: int = 0,
    source: str = "azure-code",
) -> Trace:
    """The Azure code trace over a compressed day (see the module docstring)."""
    return trace_day(
        source,
        day_s=day_s,
        rate_scale=peak_rate_scale,
        trough=trough,
        seed=seed,
        name="azure-code-diurnal",
    )


# (name, peak requests/s, prompt mean, prompt CV, output mean, output CV, priority, peak shift)
_TENANTS: tuple[tuple[str, float, float, float, float, float, PriorityClass, float], ...] = (
    ("chat", 11.0, 1500, 1.0, 300, 1.0, PriorityClass.INTERACTIVE, 0.0),
    ("longdoc", 1.0, 8000, 0.3, 300, 0.5, PriorityClass.INTERACTIVE, 0.0),
    ("batch", 1.5, 2000, 0.5, 500, 0.5, PriorityClass.BATCH, 2400.0),
)


def synthetic_diurnal_tenants(
    *,
    day_s: float = DAY_S,
    rate_scale: float = 2.0,
    trough: float = 0.25,
    seed: int = 0,
    segment_s: float = 60.0,
) -> Trace:
    """Chat, long-document and batch tenants with diurnal Poisson rates (see the module)."""
    if day_s <= 0 or rate_scale <= 0 or segment_s <= 0 or not 0 < trough <= 1:
        raise ConfigError("day_s, rate_scale and segment_s must be positive, trough in (0, 1]")
    reqs: list[TraceRequest] = []
    edges = [k * segment_s for k in range(math.ceil(day_s / segment_s) + 1)]
    for name, peak, prompt, prompt_cv, out, out_cv, prio, shift in _TENANTS:
        rng = random.Random(f"{seed}:diurnal-tenant:{name}")
        shift_scaled = shift * day_s / DAY_S
        segments = [
            (
                a,
                min(b, day_s),
                peak * rate_scale * diurnal((a + b) / 2, day_s, trough, shift_scaled),
            )
            for a, b in itertools.pairwise(edges)
        ]
        for t in piecewise_poisson(rng, segments):
            reqs.append(
                TraceRequest(
                    arrival_s=t,
                    prompt_tokens=lognormal_int(rng, prompt, prompt_cv, hi=MAX_PROMPT),
                    output_tokens=lognormal_int(rng, out, out_cv, hi=4096),
                    tenant=name,
                    priority=prio,
                )
            )
    meta: dict[str, object] = {
        "generator": "synthetic-diurnal-tenants",
        "params": {"day_s": day_s, "rate_scale": rate_scale, "trough": trough, "seed": seed},
    }
    return make_trace("synthetic-diurnal-tenants", reqs, meta)


BACKTEST_TRACES: dict[str, Callable[..., Trace]] = {
    "azure-code-diurnal": azure_code_diurnal,
    "synthetic-diurnal-tenants": synthetic_diurnal_tenants,
}


def backtest_trace(name: str, **params: object) -> Trace:
    """A backtest trace by name (`BACKTEST_TRACES`), or any `load_trace` spec: as it is
    without `params`, else over a compressed day (`trace_day`'s keywords)."""
    fn = BACKTEST_TRACES.get(name)
    if fn is not None:
        return fn(**params)
    return trace_day(name, **params) if params else load_trace(name)  # type: ignore[arg-type]


__all__ = [
    "BACKTEST_GPU",
    "BACKTEST_MODEL",
    "BACKTEST_TP",
    "BACKTEST_TRACES",
    "DAY_S",
    "azure_code_diurnal",
    "backtest_trace",
    "diurnal",
    "synthetic_diurnal_tenants",
    "trace_day",
]
