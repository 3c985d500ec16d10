"""Reading vLLM's `/metrics` exposition: a golden sample of vLLM 0.33 output and variants."""

from __future__ import annotations

import httpx
import pytest

from controlplane.metrics_scrape import (
    MetricsScrapeError,
    metrics_url,
    parse_metrics,
    scrape,
)

# What vLLM 0.33's PrometheusStatLogger exposes for one engine (names, types and labels from
# vllm-interfaces.md §3; values made up). prometheus_client writes labels in declaration order
# (model_name, engine) and adds `_created` samples to counters and histograms. A backslash at
# the end of a line joins it with the next (long label sets).
GOLDEN = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="tiny-llama",engine="0"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="tiny-llama",engine="0"} 2.0
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{model_name="tiny-llama",engine="0",reason="capacity"} 2.0
vllm:num_requests_waiting_by_reason{model_name="tiny-llama",engine="0",reason="deferred"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="tiny-llama",engine="0"} 0.4375
# HELP vllm:engine_sleep_state Engine sleep state
# TYPE vllm:engine_sleep_state gauge
vllm:engine_sleep_state{engine="0",model_name="tiny-llama",sleep_state="awake"} 1.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{model_name="tiny-llama",engine="0"} 1292.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{model_name="tiny-llama",engine="0"} 1.7e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{model_name="tiny-llama",engine="0"} 960.0
# HELP vllm:external_prefix_cache_queries_total External prefix cache queries.
# TYPE vllm:external_prefix_cache_queries_total counter
vllm:external_prefix_cache_queries_total{model_name="tiny-llama",engine="0"} 0.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{model_name="tiny-llama",engine="0"} 1.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="tiny-llama",engine="0"} 1292.0
# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{model_name="tiny-llama",engine="0",source="local_compute"} 332.0
vllm:prompt_tokens_by_source_total{model_name="tiny-llama",engine="0",source="local_cache_hit"} \
960.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name="tiny-llama",engine="0"} 64.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny-llama"} 1.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny-llama"} 3.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny-llama"} 0.0
vllm:request_success_total{engine="0",finished_reason="error",model_name="tiny-llama"} 0.0
vllm:request_success_total{engine="0",finished_reason="repetition",model_name="tiny-llama"} 0.0
# HELP vllm:admission_rejections_total Requests rejected at admission.
# TYPE vllm:admission_rejections_total counter
vllm:admission_rejections_total{model_name="tiny-llama",reason="queue_full"} 0.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny-llama"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="tiny-llama"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="2560.0",model_name="tiny-llama"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny-llama"} 4.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny-llama"} 4.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny-llama"} 0.1234
# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="tiny-llama"} 60.0
vllm:iteration_tokens_total_bucket{engine="0",le="+Inf",model_name="tiny-llama"} 70.0
vllm:iteration_tokens_total_count{engine="0",model_name="tiny-llama"} 70.0
vllm:iteration_tokens_total_sum{engine="0",model_name="tiny-llama"} 1356.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",calculate_kv_scales="False",\
cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",\
hash_block_size="32",is_attention_free="False",kv_sharing_fast_prefill="False",\
mamba_block_size="None",num_cpu_blocks="None",num_gpu_blocks="32768",\
num_gpu_blocks_override="None",prefix_caching_hash_algo="sha256",sliding_window="None",\
swap_space="4"} 1.0
# HELP http_requests_total Total number of requests by method, status and handler.
# TYPE http_requests_total counter
http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 4.0
"""


def test_golden_vllm_exposition() -> None:
    m = parse_metrics(GOLDEN, now_s=12.5)
    assert (m.engine.running, m.engine.waiting, m.engine.kv_usage) == (3, 2, 0.4375)
    assert m.engine.scraped_at_s == 12.5
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (1292.0, 960.0)
    assert m.prefix_hit_rate == pytest.approx(960 / 1292)
    assert (m.prompt_tokens, m.generation_tokens, m.num_preemptions) == (1292.0, 64.0, 1.0)
    assert m.request_success["length"] == 3.0 and m.request_success["stop"] == 1.0
    assert m.engines == ("0",) and m.model_names == ("tiny-llama",)
    cache = m.cache
    assert cache is not None
    assert (cache.block_size, cache.num_gpu_blocks, cache.hash_block_size) == (32, 32768, 32)
    assert cache.prefix_caching_hash_algo == "sha256" and cache.enable_prefix_caching is True
    assert cache.kv_capacity_tokens == 32 * 32768
    assert cache.labels["cache_dtype"] == "auto"


def test_label_order_and_extra_labels_do_not_matter() -> None:
    text = (
        'vllm:num_requests_running{pod="a",engine="0",model_name="m",zone="x"} 4\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
        'vllm:cache_config_info{num_gpu_blocks="100",engine="0",block_size="16",extra="1"} 1\n'
    )
    m = parse_metrics(text)
    assert m.engine.running == 4 and m.engine.kv_usage == 0.5
    assert m.cache is not None and (m.cache.block_size, m.cache.num_gpu_blocks) == (16, 100)
    assert m.cache.prefix_caching_hash_algo is None and m.cache.enable_prefix_caching is None


def test_several_engines_are_combined() -> None:
    text = "\n".join(
        [
            'vllm:num_requests_running{model_name="m",engine="0"} 2',
            'vllm:num_requests_running{model_name="m",engine="1"} 3',
            'vllm:num_requests_waiting{model_name="m",engine="0"} 1',
            'vllm:num_requests_waiting{model_name="m",engine="1"} 0',
            'vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.2',
            'vllm:kv_cache_usage_perc{model_name="m",engine="1"} 0.8',
            'vllm:prefix_cache_hits_total{model_name="m",engine="0"} 10',
            'vllm:prefix_cache_hits_total{model_name="m",engine="1"} 5',
            'vllm:cache_config_info{engine="0",block_size="32",num_gpu_blocks="100"} 1',
            'vllm:cache_config_info{engine="1",block_size="32",num_gpu_blocks="300"} 1',
            "",
        ]
    )
    m = parse_metrics(text)
    assert (m.engine.running, m.engine.waiting) == (5, 1)
    assert m.engine.kv_usage == pytest.approx((0.2 * 100 + 0.8 * 300) / 400)
    assert m.prefix_cache_hits == 15 and m.engines == ("0", "1")
    assert m.cache is not None and m.cache.num_gpu_blocks == 400
    # without the block counts: a plain mean
    plain = parse_metrics(
        "\n".join(line for line in text.splitlines() if "cache_config" not in line)
    )
    assert plain.engine.kv_usage == pytest.approx(0.5) and plain.cache is None


def test_missing_metrics_and_model_filter() -> None:
    empty = parse_metrics("")
    assert empty.engine.running == 0 and empty.engine.kv_usage == 0.0 and empty.cache is None
    assert empty.prefix_hit_rate is None
    text = (
        'vllm:num_requests_running{model_name="a",engine="0"} 1\n'
        'vllm:num_requests_running{model_name="b",engine="0"} 7\n'
    )
    assert parse_metrics(text, model_name="a").engine.running == 1
    assert parse_metrics(text).engine.running == 8
    assert parse_metrics(text).model_names == ("a", "b")


def test_legacy_names_are_fallbacks() -> None:
    text = (
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.25\n'
        'vllm:gpu_prefix_cache_queries_total{model_name="m"} 100\n'
        'vllm:gpu_prefix_cache_hits_total{model_name="m"} 40\n'
    )
    m = parse_metrics(text)
    assert m.engine.kv_usage == 0.25 and (m.prefix_cache_queries, m.prefix_cache_hits) == (100, 40)


def test_garbage_is_an_error() -> None:
    with pytest.raises(MetricsScrapeError):
        parse_metrics('vllm:num_requests_running{model_name="m" 1\n')


async def test_scrape_over_http() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        if request.url.host == "down":
            return httpx.Response(503)
        return httpx.Response(200, text=GOLDEN)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        m = await scrape("http://replica:8000", client, clock=lambda: 7.0)
        assert m.engine.running == 3 and m.engine.scraped_at_s == 7.0
        with pytest.raises(MetricsScrapeError, match="503"):
            await scrape("http://down/metrics", client)
    assert seen[0] == "http://replica:8000/metrics"
    assert metrics_url("http://x/metrics/") == "http://x/metrics"

    def broken(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(broken)) as client:
        with pytest.raises(MetricsScrapeError, match="failed"):
            await scrape("http://replica", client)
