"""The KV-event indexer's spans (one per batch) and its /metrics, against a vLLM-like publisher."""

from __future__ import annotations

from typing import Any

import httpx
from kvevents_fakes import assert_no_other_tasks, until
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from controlplane.hashing import vllm_block_hashes
from controlplane.kvevents.config import ReplicaSource
from controlplane.kvevents.exporter import IndexerMetrics
from controlplane.kvevents.service import EventIndexer
from controlplane.kvevents.subscriber import BATCH_SPAN
from controlplane.kvevents.testing import FakePublisher
from controlplane.kvevents.wire import WireBlockRemoved, WireBlockStored
from controlplane.prefix.memory import InMemoryPrefixIndex


def scrape(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(url, timeout=5.0).text
    return {
        (s.name, s.labels.get("replica", "")): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


async def test_one_span_per_batch_and_metrics_of_a_gap() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    pub = await FakePublisher(topic="kv").start()
    src = ReplicaSource(
        "r0", pub.events_endpoint, "m", replay=pub.replay_endpoint, topic="kv", block_size=16
    )
    tokens = list(range(32))
    engine = vllm_block_hashes(tokens, 16, seed="0")
    index = InMemoryPrefixIndex(clock=lambda: 0.0)
    indexer = EventIndexer([src], index, tracer_provider=provider)
    metrics = IndexerMetrics(index)
    port = metrics.serve("127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        async with indexer:
            await pub.wait_for_subscribers(1)
            await indexer.subscribers["r0"].wait_synced(5.0)
            await pub.publish([WireBlockStored(engine, None, tokens, 16)])  # seq 0, live
            await pub.publish([WireBlockRemoved(engine[1:])], send=False)  # seq 1: missed
            await pub.publish([WireBlockRemoved(engine[:1])])  # seq 2: a gap -> replay
            await until(lambda: indexer.status()[0].applied_seq == 2)
            metrics.update(indexer.status())
            got = scrape(url)
    finally:
        metrics.close()
        await pub.close()
    spans = [s for s in exporter.get_finished_spans() if s.name == BATCH_SPAN]
    by_seq: dict[int, dict[str, Any]] = {}
    for span in spans:
        attrs = dict(span.attributes or {})
        by_seq[int(str(attrs["cp.kvevents.seq"]))] = attrs
    assert sorted(by_seq) == [0, 1, 2]  # each batch once, however it arrived
    assert all(a["cp.replica"] == "r0" for a in by_seq.values())
    assert (by_seq[0]["cp.kvevents.events"], by_seq[0]["cp.kvevents.replayed"]) == (1, False)
    assert by_seq[1]["cp.kvevents.replayed"] is True  # the missed batch came from the replay
    assert got[("cp_kv_events_applied_total", "r0")] == 3.0
    assert got[("cp_kv_events_gaps_total", "r0")] == 1.0
    assert got[("cp_kv_events_lost_total", "r0")] == 0.0
    assert got[("cp_kv_events_trusted", "r0")] == 1.0
    assert got[("cp_kv_events_last_batch_timestamp_seconds", "r0")] > 1.7e9
    # an in-memory index has no Redis breaker to report
    assert not any(name.startswith("cp_redis_breaker") for name, _ in got)
    provider.shutdown()
    assert_no_other_tasks()
