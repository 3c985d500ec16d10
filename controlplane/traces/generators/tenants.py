"""Several tenants with their own length distributions, arrival processes and priorities.

Each `TenantSpec` describes one tenant:

- arrivals: a Gamma renewal process at `rate` requests/s with inter-arrival CV `arrival_cv`
  (1 = Poisson, > 1 burstier), over `[0, duration)`;
- prompt = `shared_prefix` tokens common to all of the tenant's requests (its system prompt) +
  a lognormal body (mean `prompt`, CV `prompt_cv`, clipped to [1, `max_prompt`]);
- output lognormal (mean `output`, CV `output_cv`, clipped to [1, `max_output`]);
- `tenant` = the spec's name, `priority` = its class.

Content ids: the tenant's shared prefix owns `shared_prefix // block` ids used by all its
requests; every request owns fresh ids for the rest of its prompt (nothing else is shared).

Algorithm: tenant k draws from its own stream `Random(f"{seed}:tenant:{name}")`, so adding,
removing or re-rating one tenant leaves the others' requests unchanged; the union is sorted by
arrival (stable, in tenant order within a tick).

Presets (`TENANT_PRESETS`): `chat` (200 / 200 tokens, 4 req/s, interactive), `longdoc`
(16k / 300, 0.25 req/s, interactive), `batch` (1000 / 500, 1 req/s, batch priority, arrival CV 2),
`rag` (2000-token shared system prompt + 1500 / 250, 1 req/s, interactive).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from controlplane.errors import ConfigError
from controlplane.traces.generators.common import (
    DEFAULT_ID_BLOCK,
    allocator,
    blocks_for,
    check_block,
    check_positive,
    lognormal_int,
    make_trace,
    renewal_times,
)
from controlplane.traces.model import Trace, TraceRequest
from controlplane.types import PriorityClass


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """One tenant's workload (see the module docstring)."""

    name: str
    rate: float
    prompt: float
    output: float
    prompt_cv: float = 1.0
    output_cv: float = 1.0
    arrival_cv: float = 1.0
    priority: PriorityClass = PriorityClass.INTERACTIVE
    shared_prefix: int = 0
    max_prompt: int = 128_000
    max_output: int = 8192


TENANT_PRESETS: dict[str, TenantSpec] = {
    "chat": TenantSpec("chat", rate=4.0, prompt=200, output=200),
    "longdoc": TenantSpec(
        "longdoc", rate=0.25, prompt=16_000, output=300, prompt_cv=0.3, output_cv=0.5
    ),
    "batch": TenantSpec(
        "batch",
        rate=1.0,
        prompt=1000,
        output=500,
        prompt_cv=0.5,
        output_cv=0.5,
        arrival_cv=2.0,
        priority=PriorityClass.BATCH,
    ),
    "rag": TenantSpec("rag", rate=1.0, prompt=1500, output=250, prompt_cv=0.5, shared_prefix=2000),
}


def resolve_tenants(tenants: str | Sequence[TenantSpec]) -> list[TenantSpec]:
    """Specs from a comma-separated list of preset names, or the specs themselves."""
    if not isinstance(tenants, str):
        specs = list(tenants)
    else:
        specs = []
        for key in (t.strip() for t in tenants.split(",")):
            if key not in TENANT_PRESETS:
                known = ", ".join(sorted(TENANT_PRESETS))
                raise ConfigError(f"unknown tenant preset {key!r} (known: {known})")
            specs.append(TENANT_PRESETS[key])
    if not specs:
        raise ConfigError("at least one tenant is needed")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"tenant names must be distinct, got {names}")
    return specs


def multi_tenant(
    *,
    tenants: str | Sequence[TenantSpec] = "chat,longdoc,batch",
    duration: float = 600.0,
    rate_scale: float = 1.0,
    seed: int = 0,
    block: int = DEFAULT_ID_BLOCK,
    namespace: int = 0,
) -> Trace:
    """Each tenant's own arrivals and lengths over `duration` s, merged (see the module)."""
    check_positive(duration=duration, rate_scale=rate_scale)
    check_block(block)
    specs = [replace(s, rate=s.rate * rate_scale) for s in resolve_tenants(tenants)]
    ids = allocator("tenants", seed, namespace)
    reqs: list[TraceRequest] = []
    for spec in specs:
        check_positive(rate=spec.rate, prompt=spec.prompt, output=spec.output)
        rng = random.Random(f"{seed}:tenant:{spec.name}")
        shared = ids.take(spec.shared_prefix // block)
        for t in renewal_times(rng, spec.rate, cv=spec.arrival_cv, duration=duration):
            body = lognormal_int(rng, spec.prompt, spec.prompt_cv, hi=spec.max_prompt)
            prompt = spec.shared_prefix + body
            out = lognormal_int(rng, spec.output, spec.output_cv, hi=spec.max_output)
            own = ids.take(blocks_for(prompt, block) - len(shared))
            reqs.append(
                TraceRequest(
                    arrival_s=t,
                    prompt_tokens=prompt,
                    output_tokens=out,
                    content_ids=shared + own,
                    id_block_tokens=block,
                    tenant=spec.name,
                    priority=spec.priority,
                )
            )
    meta: dict[str, object] = {
        "generator": "tenants",
        "params": {"duration": duration, "rate_scale": rate_scale, "seed": seed, "block": block},
        "tenants": [{**asdict(s), "priority": str(s.priority)} for s in specs],
        "id_namespace": ids.namespace,
    }
    return make_trace(f"tenants-s{seed}", reqs, meta)
