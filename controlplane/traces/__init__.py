"""Workload traces: loaders (Mooncake, Azure), synthetic generators, transforms and ceilings.

Every source produces a `Trace` of `TraceRequest`s (see `model`); `load_trace(spec)` is the one
entry point the CLI and benchmarks use.
"""

from __future__ import annotations

from controlplane.traces.azure import load_azure, parse_azure, parse_timestamp_ns
from controlplane.traces.ceiling import (
    Ceiling,
    LruCeiling,
    infinite_cache_ceiling,
    lru_ceiling,
    naive_infinite_cache_ceiling,
)
from controlplane.traces.generators import (
    GENERATORS,
    TENANT_PRESETS,
    TenantSpec,
    bursty,
    multi_tenant,
    multi_turn,
    shared_prefix,
)
from controlplane.traces.loader import fixture_path, generate, load_trace, trace_stats
from controlplane.traces.model import Trace, TraceRequest
from controlplane.traces.mooncake import load_mooncake, parse_mooncake
from controlplane.traces.transform import (
    cap_output,
    concat,
    densest_window,
    head,
    overlay_tenants,
    rebase,
    repeat,
    scale_rate,
    window,
)

__all__ = [
    "GENERATORS",
    "TENANT_PRESETS",
    "Ceiling",
    "LruCeiling",
    "TenantSpec",
    "Trace",
    "TraceRequest",
    "bursty",
    "cap_output",
    "concat",
    "densest_window",
    "fixture_path",
    "generate",
    "head",
    "infinite_cache_ceiling",
    "load_azure",
    "load_mooncake",
    "load_trace",
    "lru_ceiling",
    "multi_tenant",
    "multi_turn",
    "naive_infinite_cache_ceiling",
    "overlay_tenants",
    "parse_azure",
    "parse_mooncake",
    "parse_timestamp_ns",
    "rebase",
    "repeat",
    "scale_rate",
    "shared_prefix",
    "trace_stats",
    "window",
]
