"""Two-tenant scenarios for the fair queue (`gen:long-documents`, `gen:batch-flood`).

`long_documents`: tenant `A` sends `doc_prompt`-token documents (`doc_output` tokens out) at
`doc_rate`/s, tenant `B` sends `chat_prompt`/`chat_output` chats at `chat_rate`/s, both
interactive, Poisson arrivals over `duration` s, fixed lengths (so the cost ratio of the two
request kinds is exact: about 21x in roofline work on an H100 with Llama-3.1-8B). On a few H100
replicas of Llama-3.1-8B the default rates ask, with both tenants present, for more than either
one's half of the GPU work (A alone would more than fill the fleet), so both stay backlogged:
that is where a request-fair queue hands A ~95% of the GPU and a work-fair one splits it by
weight.

`batch_flood`: an `interactive` tenant (chats, lognormal lengths, Poisson at `chat_rate`/s) and a
`batch` tenant of class batch (`batch_prompt`/`batch_output`, at `batch_rate`/s, far more than
the fleet serves): the batch tenant saturates whatever the queue lets it have.

`tenants` keeps a subset (`tenants=B` is B alone on the same arrivals: each tenant draws from its
own stream, see `multi_tenant`).
"""

from __future__ import annotations

from controlplane.errors import ConfigError
from controlplane.traces.generators.common import DEFAULT_ID_BLOCK
from controlplane.traces.generators.tenants import TenantSpec, multi_tenant
from controlplane.traces.model import Trace
from controlplane.types import PriorityClass


def _keep(specs: list[TenantSpec], tenants: str, kind: str) -> list[TenantSpec]:
    names = [t.strip() for t in tenants.split(",") if t.strip()]
    known = {s.name for s in specs}
    if not names or any(n not in known for n in names):
        raise ConfigError(f"{kind}: tenants must name some of {sorted(known)}, got {tenants!r}")
    return [s for s in specs if s.name in names]


def long_documents(
    *,
    duration: float = 60.0,
    doc_rate: float = 8.0,
    doc_prompt: int = 16_000,
    doc_output: int = 300,
    chat_rate: float = 150.0,
    chat_prompt: int = 200,
    chat_output: int = 200,
    tenants: str = "A,B",
    seed: int = 0,
    block: int = DEFAULT_ID_BLOCK,
    namespace: int = 0,
) -> Trace:
    """Tenant A: long documents; tenant B: short chats; both backlogged (see the module)."""
    specs = [
        TenantSpec("A", doc_rate, doc_prompt, doc_output, prompt_cv=0.0, output_cv=0.0),
        TenantSpec("B", chat_rate, chat_prompt, chat_output, prompt_cv=0.0, output_cv=0.0),
    ]
    trace = multi_tenant(
        tenants=_keep(specs, tenants, "long-documents"),
        duration=duration,
        seed=seed,
        block=block,
        namespace=namespace,
    )
    meta = {**trace.meta, "generator": "long-documents", "scenario": {"tenants": tenants}}
    return Trace(name=f"long-documents-s{seed}", requests=trace.requests, meta=meta)


def batch_flood(
    *,
    duration: float = 60.0,
    chat_rate: float = 20.0,
    chat_prompt: int = 400,
    chat_output: int = 250,
    batch_rate: float = 60.0,
    batch_prompt: int = 1000,
    batch_output: int = 500,
    tenants: str = "interactive,batch",
    seed: int = 0,
    block: int = DEFAULT_ID_BLOCK,
    namespace: int = 0,
) -> Trace:
    """An interactive chat tenant and a batch tenant flooding the fleet (see the module)."""
    specs = [
        TenantSpec(
            "interactive", chat_rate, chat_prompt, chat_output, prompt_cv=0.5, output_cv=0.5
        ),
        TenantSpec(
            "batch",
            batch_rate,
            batch_prompt,
            batch_output,
            prompt_cv=0.5,
            output_cv=0.5,
            priority=PriorityClass.BATCH,
        ),
    ]
    trace = multi_tenant(
        tenants=_keep(specs, tenants, "batch-flood"),
        duration=duration,
        seed=seed,
        block=block,
        namespace=namespace,
    )
    meta = {**trace.meta, "generator": "batch-flood", "scenario": {"tenants": tenants}}
    return Trace(name=f"batch-flood-s{seed}", requests=trace.requests, meta=meta)


__all__ = ["batch_flood", "long_documents"]
