"""Every `cp_*` series the code exports, with its labels, read from the live objects.

    catalog = await metric_catalog()      # {sample name: frozenset of label names}

The router's names come from a live in-process router's `GET /metrics` (in front of fake vLLM
replicas), the autoscaler's from its `/metrics` app (Kubernetes mode, so the scaler's drain and
victim counters are there), the KV-event indexer's from its exporter's registry. A family without
samples yet shows only as `# HELP`/`# TYPE` in the exposition, so its label names are read from
the registered collectors (prometheus_client's `_labelnames`: the library has no public getter).
Sample names follow the exposition: a counter `x` is `x_total`, a histogram `x` is `x_bucket`
(with `le`), `x_count` and `x_sum`.
"""

from __future__ import annotations

from collections.abc import Iterable

import httpx
from fake_vllm import FakeVllmFleet
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr

from autoscaler.hosts.kubernetes import HostSettings, build, metrics_app
from controlplane.kvevents.exporter import IndexerMetrics
from controlplane.prefix.memory import InMemoryPrefixIndex
from router.config import load_settings
from router.http.service import create_app
from router.runtime import RouterRuntime

Catalog = dict[str, frozenset[str]]


def _samples(name: str, kind: str, labels: Iterable[str]) -> Catalog:
    base = frozenset(labels)
    if kind == "counter":
        return {f"{name}_total": base}
    if kind == "histogram":
        return {f"{name}_bucket": base | {"le"}, f"{name}_count": base, f"{name}_sum": base}
    return {name: base}


def _labels(registry: CollectorRegistry) -> dict[str, tuple[str, ...]]:
    """Family name -> label names of every collector registered."""
    out: dict[str, tuple[str, ...]] = {}
    for collector in list(registry._collector_to_names):
        name = getattr(collector, "_name", None)
        if name is not None:
            out[name.removesuffix("_total")] = tuple(getattr(collector, "_labelnames", ()))
    return out


def _from_exposition(text: str, registry: CollectorRegistry) -> Catalog:
    labels = _labels(registry)
    catalog: Catalog = {}
    for family in text_string_to_metric_families(text):
        # an unlabelled counter's `_created` sample parses as a family of its own: not a name
        if family.name.startswith("cp_") and not family.name.endswith("_created"):
            catalog |= _samples(family.name, family.type, labels.get(family.name, ()))
    return catalog


async def router_catalog() -> Catalog:
    fakes = FakeVllmFleet(["a", "b"])
    settings = load_settings(
        replicas=fakes.replica_configs(), tokenizer="approx", served_model="m",
        telemetry={"json_logs": False},
    )  # fmt: skip
    runtime = RouterRuntime(settings, transport=fakes.transport, resolve=fakes.resolve)
    app = create_app(settings, runtime=runtime)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://router") as client,
    ):
        text = (await client.get("/metrics")).text
    return _from_exposition(text, runtime.metrics.registry)


async def autoscaler_catalog() -> Catalog:
    settings = HostSettings(
        routers=["http://127.0.0.1:9"], mode="kubernetes", deployment="vllm", namespace="ns",
        api_url="http://127.0.0.1:9", token=SecretStr("t"),
    )  # fmt: skip
    controller, actuator, scrape = build(settings)
    try:
        transport = httpx.ASGITransport(app=metrics_app(controller))
        async with httpx.AsyncClient(transport=transport, base_url="http://autoscaler") as client:
            text = (await client.get("/metrics")).text
    finally:
        await actuator.aclose()
        await scrape.aclose()
    return _from_exposition(text, controller.metrics.registry)


def indexer_catalog() -> Catalog:
    exporter = IndexerMetrics(InMemoryPrefixIndex(clock=lambda: 0.0))
    labels = _labels(exporter.registry)
    catalog: Catalog = {}
    for family in exporter.registry.collect():
        catalog |= _samples(family.name, family.type, labels.get(family.name, ()))
    return catalog


async def metric_catalog() -> Catalog:
    """The union; a name two processes export must have the same labels in both."""
    catalog: Catalog = {}
    for part in (await router_catalog(), await autoscaler_catalog(), indexer_catalog()):
        for name, labels in part.items():
            assert catalog.get(name, labels) == labels, f"{name}: two label sets"
            catalog[name] = labels
    return catalog
