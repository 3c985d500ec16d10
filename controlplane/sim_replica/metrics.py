"""The replica's `/metrics`: vLLM 0.33's Prometheus names, labels, types and buckets.

Source of truth: `vllm/v1/metrics/loggers.py` and `buckets.py`, summarised in
`/work/shared/reference/vllm-interfaces.md` §3. Every per-engine series carries
`model_name` (the served name) and `engine` ("0"); `vllm:cache_config_info` carries the
CacheConfig fields (strings, as `str(value)` renders them) plus `engine`.

Gauges and the engine's own counters (prefix-cache queries and hits in tokens, preemptions) are
read from the engine when scraped; request-level counters and histograms are recorded by the
engine loop as requests produce tokens and finish. Each replica has a private
`CollectorRegistry`, so several replicas can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controlplane.roofline.profile import EngineProfile

# vllm/v1/metrics/loggers.py
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """vLLM's `build_1_2_5_buckets`: 1, 2, 5, 10, 20, 50, ... up to `max_value`."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return out
            out.append(float(value))
        exponent += 1


@dataclass(frozen=True, slots=True)
class EngineGauges:
    """Engine state read at scrape time."""

    running: int
    waiting: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    preemptions: int


def cache_config_labels(
    prof: EngineProfile, *, hash_algo: str, num_gpu_blocks: int
) -> dict[str, str]:
    """vLLM's `CacheConfig.metrics_info()` for this replica (values as `str(value)`)."""
    fields: dict[str, object] = {
        "block_size": prof.resolved_block_size,
        "hash_block_size": prof.resolved_block_size,
        "gpu_memory_utilization": prof.gpu_memory_utilization,
        "swap_space": 4,
        "cache_dtype": "auto",
        "is_attention_free": False,
        "num_gpu_blocks_override": prof.num_gpu_blocks_override or None,
        "sliding_window": None,
        "enable_prefix_caching": prof.enable_prefix_caching,
        "prefix_caching_hash_algo": hash_algo,
        "cpu_offload_gb": 0,
        "calculate_kv_scales": False,
        "kv_sharing_fast_prefill": False,
        "mamba_page_size_padded": None,
        "mamba_block_size": None,
        "mamba_cache_dtype": "auto",
        "mamba_ssm_cache_dtype": "auto",
        "kv_offloading_size": None,
        "kv_offloading_backend": None,
        "num_gpu_blocks": num_gpu_blocks,
        "num_cpu_blocks": None,
    }
    return {k: str(v) for k, v in fields.items()}


class _EngineCollector(Collector):
    def __init__(
        self,
        read: Callable[[], EngineGauges],
        base: Mapping[str, str],
        cache_info: Mapping[str, str],
    ) -> None:
        self._read = read
        self._names = list(base)
        self._values = list(base.values())
        self._cache = dict(cache_info)

    def collect(self) -> Iterator[Metric]:
        s = self._read()
        names, values = self._names, self._values

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            s.running,
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            s.waiting,
        )
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of requests waiting, by reason.",
            labels=[*names, "reason"],
        )
        by_reason.add_metric([*values, "capacity"], s.waiting)
        by_reason.add_metric([*values, "deferred"], 0)
        yield by_reason
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            s.kv_usage,
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_hits,
        )
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            s.preemptions,
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[*self._cache, "engine"],
        )
        info.add_metric([*self._cache.values(), values[names.index("engine")]], 1.0)
        yield info


class ReplicaMetrics:
    """The registry behind `/metrics` and the recording calls the engine loop makes."""

    def __init__(
        self,
        *,
        model_name: str,
        max_model_len: int,
        cache_info: Mapping[str, str],
        read_engine: Callable[[], EngineGauges],
        engine: str = "0",
    ) -> None:
        self.registry = CollectorRegistry()
        base = {"model_name": model_name, "engine": engine}
        labels = list(base)
        reg = self.registry
        reg.register(_EngineCollector(read_engine, base, cache_info))

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=reg).labels(**base)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(**base)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            [*labels, "source"],
            registry=reg,
        )
        self.prompt_computed = by_source.labels(**base, source="local_compute")
        self.prompt_cache_hit = by_source.labels(**base, source="local_cache_hit")
        by_source.labels(**base, source="external_kv_transfer")
        self.prompt_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self.success = {r: success.labels(**base, finished_reason=r) for r in FINISH_REASONS}
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            token_buckets,
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        )
        self.request_max_tokens = histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
