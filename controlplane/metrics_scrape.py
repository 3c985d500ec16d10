"""A vLLM replica's `/metrics` exposition, read into what the router needs.

Works on real vLLM (0.33; older names as fallbacks) and on the simulated replica, which exports
the same names (reference §3). Samples are matched by name and labels, never by position, so
label order, extra labels and unknown metrics do not matter. With several engines (data
parallel: one `engine` label value each) the engine-level values are combined: request counts
and counters are summed, KV usage is the block-weighted mean (each engine's
`cache_config_info{num_gpu_blocks}`; a plain mean when that is missing), and the cache config
is the first engine's with `num_gpu_blocks` summed. Missing metrics read as 0 (or None for the
cache config). `model_name` restricts the engine-level samples to one served model.

    scraped = parse_metrics(text, model_name="tiny-llama", now_s=clock())
    scraped.engine          # EngineMetrics(running, waiting, kv_usage, scraped_at_s)
    scraped.cache           # CacheConfigInfo(block_size, num_gpu_blocks, hash algo, ...)
    scraped.prefix_cache_hits / scraped.prefix_cache_queries   # tokens, cumulative
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from controlplane.errors import ControlPlaneError
from controlplane.types import EngineMetrics

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total")
PREFIX_HITS = ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PREEMPTIONS = "vllm:num_preemptions_total"
REQUEST_SUCCESS = "vllm:request_success_total"
CACHE_CONFIG_INFO = "vllm:cache_config_info"
_TRUE = {"true", "1", "yes"}


class MetricsScrapeError(ControlPlaneError):
    """A `/metrics` page that could not be fetched or parsed."""


@dataclass(frozen=True, slots=True)
class CacheConfigInfo:
    """`vllm:cache_config_info`: how the replica's KV cache is laid out and hashed."""

    block_size: int | None
    num_gpu_blocks: int | None
    hash_block_size: int | None = None
    prefix_caching_hash_algo: str | None = None
    enable_prefix_caching: bool | None = None
    # every label of the first engine's sample, as exported (strings)
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def kv_capacity_tokens(self) -> int | None:
        if self.block_size is None or self.num_gpu_blocks is None:
            return None
        return self.block_size * self.num_gpu_blocks


@dataclass(frozen=True, slots=True)
class ScrapedMetrics:
    """One scrape of one replica."""

    engine: EngineMetrics
    cache: CacheConfigInfo | None = None
    # cumulative counters (tokens for the prefix cache), summed over engines
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    num_preemptions: float = 0.0
    # finished_reason -> requests
    request_success: Mapping[str, float] = field(default_factory=dict)
    # engine label values seen, and served model names
    engines: tuple[str, ...] = ()
    model_names: tuple[str, ...] = ()

    @property
    def prefix_hit_rate(self) -> float | None:
        """Cumulative token hit rate (a router wants the rate between two scrapes)."""
        return (
            self.prefix_cache_hits / self.prefix_cache_queries
            if self.prefix_cache_queries
            else None
        )


def _int_label(labels: Mapping[str, str], name: str) -> int | None:
    value = labels.get(name)
    if value is None:
        return None
    try:
        return int(float(value))
    except ValueError:
        return None


def _bool_label(labels: Mapping[str, str], name: str) -> bool | None:
    value = labels.get(name)
    return None if value is None or value == "None" else value.strip().lower() in _TRUE


def _str_label(labels: Mapping[str, str], name: str) -> str | None:
    value = labels.get(name)
    return None if value in (None, "", "None") else value


_FAMILIES = tuple(
    name.removesuffix("_total")
    for name in (
        RUNNING,
        WAITING,
        *KV_USAGE,
        *PREFIX_QUERIES,
        *PREFIX_HITS,
        PROMPT_TOKENS,
        GENERATION_TOKENS,
        PREEMPTIONS,
        REQUEST_SUCCESS,
        CACHE_CONFIG_INFO,
    )
)


def _relevant(text: str) -> str:
    """Only the lines of the families read here (with their HELP/TYPE lines). A vLLM page has
    hundreds of histogram lines the router never reads, and the parser's cost is per line: the
    router scrapes every replica several times a second on its event loop."""
    keep = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) >= 3 and parts[2].startswith(_FAMILIES):
                keep.append(line)
        elif line.startswith(_FAMILIES):
            keep.append(line)
    keep.append("")
    return "\n".join(keep)


def _samples(text: str) -> Iterable[Sample]:
    try:
        for family in text_string_to_metric_families(_relevant(text)):
            yield from family.samples
    except ValueError as exc:
        raise MetricsScrapeError(f"not a Prometheus text exposition: {exc}") from exc


def parse_metrics(
    text: str, *, model_name: str | None = None, now_s: float = 0.0
) -> ScrapedMetrics:
    """Read a `/metrics` page (see the module docstring)."""
    # name -> engine -> summed value
    values: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    success: dict[str, float] = defaultdict(float)
    cache_by_engine: dict[str, dict[str, str]] = {}
    engines: list[str] = []
    models: list[str] = []
    for s in _samples(text):
        if s.name == CACHE_CONFIG_INFO:
            cache_by_engine.setdefault(s.labels.get("engine", "0"), dict(s.labels))
            continue
        if not s.name.startswith("vllm:") or math.isnan(s.value):
            continue
        model = s.labels.get("model_name")
        if model is not None:
            if model not in models:
                models.append(model)
            if model_name is not None and model != model_name:
                continue
        engine = s.labels.get("engine", "0")
        if s.name == REQUEST_SUCCESS:
            success[s.labels.get("finished_reason", "")] += s.value
            continue
        values[s.name][engine] += s.value
        if engine not in engines and s.name in (RUNNING, WAITING, *KV_USAGE):
            engines.append(engine)

    def total(*names: str) -> float:
        for name in names:
            if name in values:
                return sum(values[name].values())
        return 0.0

    cache = _cache_info(cache_by_engine)
    usage = _kv_usage(values, cache_by_engine)
    return ScrapedMetrics(
        engine=EngineMetrics(
            running=round(total(RUNNING)),
            waiting=round(total(WAITING)),
            kv_usage=usage,
            scraped_at_s=now_s,
        ),
        cache=cache,
        prefix_cache_queries=total(*PREFIX_QUERIES),
        prefix_cache_hits=total(*PREFIX_HITS),
        prompt_tokens=total(PROMPT_TOKENS),
        generation_tokens=total(GENERATION_TOKENS),
        num_preemptions=total(PREEMPTIONS),
        request_success=dict(success),
        engines=tuple(engines),
        model_names=tuple(models),
    )


def _kv_usage(
    values: Mapping[str, Mapping[str, float]], cache_by_engine: Mapping[str, Mapping[str, str]]
) -> float:
    per_engine: Mapping[str, float] = {}
    for name in KV_USAGE:
        if name in values:
            per_engine = values[name]
            break
    if not per_engine:
        return 0.0
    weights = {e: _int_label(cache_by_engine.get(e, {}), "num_gpu_blocks") for e in per_engine}
    if all(w for w in weights.values()):
        blocks = sum(w for w in weights.values() if w)
        return sum(per_engine[e] * (weights[e] or 0) for e in per_engine) / blocks
    return sum(per_engine.values()) / len(per_engine)


def _cache_info(cache_by_engine: Mapping[str, Mapping[str, str]]) -> CacheConfigInfo | None:
    if not cache_by_engine:
        return None
    first = cache_by_engine[min(cache_by_engine)]
    blocks = [_int_label(labels, "num_gpu_blocks") for labels in cache_by_engine.values()]
    return CacheConfigInfo(
        block_size=_int_label(first, "block_size"),
        num_gpu_blocks=sum(b for b in blocks if b) if all(blocks) else None,
        hash_block_size=_int_label(first, "hash_block_size"),
        prefix_caching_hash_algo=_str_label(first, "prefix_caching_hash_algo"),
        enable_prefix_caching=_bool_label(first, "enable_prefix_caching"),
        labels=dict(first),
    )


def metrics_url(url: str) -> str:
    """A replica's base URL or its metrics URL, as the metrics URL."""
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else f"{url}/metrics"


async def scrape(
    url: str,
    client: httpx.AsyncClient,
    timeout: float = 2.0,
    *,
    model_name: str | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> ScrapedMetrics:
    """GET and parse one replica's `/metrics`; `scraped_at_s` is `clock()` at the response."""
    target = metrics_url(url)
    try:
        resp = await client.get(target, timeout=timeout)
    except httpx.HTTPError as exc:
        raise MetricsScrapeError(f"GET {target} failed: {exc!r}") from exc
    if resp.status_code != 200:
        raise MetricsScrapeError(f"GET {target} -> {resp.status_code}")
    return parse_metrics(resp.text, model_name=model_name, now_s=clock())
