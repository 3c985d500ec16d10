"""Deterministic synthetic workloads (seeded `random.Random`), each returning a sorted `Trace`.

`GENERATORS` maps the names used in `gen:<name>?key=value&...` specs to the functions; every
function takes keyword arguments only, with simple typed defaults, and records them in
`meta["params"]`.
"""

from __future__ import annotations

from collections.abc import Callable

from controlplane.traces.generators.bursts import bursty
from controlplane.traces.generators.common import IdAllocator, namespace_for
from controlplane.traces.generators.fairness import batch_flood, long_documents
from controlplane.traces.generators.sessions import multi_turn
from controlplane.traces.generators.shared_prefix import shared_prefix
from controlplane.traces.generators.tenants import TENANT_PRESETS, TenantSpec, multi_tenant
from controlplane.traces.model import Trace

GENERATORS: dict[str, Callable[..., Trace]] = {
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "sessions": multi_turn,
    "tenants": multi_tenant,
    "bursty": bursty,
    "long-documents": long_documents,
    "batch-flood": batch_flood,
}

__all__ = [
    "GENERATORS",
    "TENANT_PRESETS",
    "IdAllocator",
    "TenantSpec",
    "batch_flood",
    "bursty",
    "long_documents",
    "multi_tenant",
    "multi_turn",
    "namespace_for",
    "shared_prefix",
]
