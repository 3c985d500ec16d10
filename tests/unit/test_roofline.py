"""Roofline: calibration anchors, derived constants (numbers.md §2, §3, §5), step-time shape,
concurrency ceilings and configuration errors."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.errors import ConfigError
from controlplane.roofline import GPUS, MODELS, StepCostModel, concurrency_ceilings, profile
from controlplane.roofline.calibration import TOLERANCE, Anchor, anchors
from controlplane.roofline.capacity import (
    CeilingKind,
    decode_seconds_per_token,
    decode_throughput,
    prefill_seconds_per_token,
)
from controlplane.roofline.profile import EngineProfile
from controlplane.roofline.specs import GIB, gpu, model

MIB = 1024**2
ALL_ANCHORS = anchors()
CALIBRATED = [a for a in ALL_ANCHORS if not a.held_out]


# -- calibration anchors ---------------------------------------------------------------------------
def test_tolerance_is_fifteen_percent_and_the_calibration_set_is_not_empty() -> None:
    assert TOLERANCE == 0.15
    assert len(CALIBRATED) >= 20
    assert any(a.fitted for a in CALIBRATED)
    assert any(a.held_out for a in ALL_ANCHORS)


@pytest.mark.parametrize(
    "anchor", CALIBRATED, ids=[f"{a.setting} [{a.quantity}]" for a in CALIBRATED]
)
def test_calibration_anchor_within_tolerance(anchor: Anchor) -> None:
    modelled = anchor.modelled()
    assert modelled > 0
    assert abs(modelled / anchor.measured - 1.0) <= TOLERANCE, (
        f"{anchor.source}: {anchor.setting}: measured {anchor.measured} {anchor.unit}, "
        f"modelled {modelled:.4g} ({anchor.error():+.1%})"
    )
    assert anchor.within_tolerance


# -- derived constants (numbers.md §1, §2) ---------------------------------------------------------
@pytest.mark.parametrize(
    ("key", "params", "kv_bytes_per_token"),
    [
        ("llama-3.1-8b", 8_030_261_248, 131_072),
        ("llama-3.1-70b", 70_553_706_496, 327_680),
        ("tiny-llama", 1_443_072, 1_024),
    ],
)
def test_model_parameter_counts_and_kv_bytes(
    key: str, params: int, kv_bytes_per_token: int
) -> None:
    m = model(key)
    assert m.params == params
    assert m.kv_bytes_per_token == kv_bytes_per_token


@pytest.mark.parametrize(
    ("key", "weight_gb", "weight_gib", "read_gb", "attn_per_pair", "kv_mib_per_block16", "digits"),
    [
        ("llama-3.1-8b", 16.06, 14.96, 15.01, 524_288, 2, 2),
        ("llama-3.1-70b", 141.1, 131.4, 139.0, 2_621_440, 5, 1),
    ],
)
def test_model_derived_sizes(
    key: str,
    weight_gb: float,
    weight_gib: float,
    read_gb: float,
    attn_per_pair: int,
    kv_mib_per_block16: int,
    digits: int,
) -> None:
    """numbers.md §2 rounds to `digits` decimals: 16.06 GB (14.96 GiB), 141.1 GB (131.4 GiB)."""
    m = model(key)
    assert round(m.weight_bytes / 1e9, digits) == weight_gb
    assert round(m.weight_bytes / GIB, digits) == weight_gib
    assert round(m.weight_bytes_read_per_step / 1e9, digits) == read_gb
    assert m.attn_flops_per_pair == attn_per_pair
    assert m.kv_bytes_per_token * 16 == kv_mib_per_block16 * MIB


@pytest.mark.parametrize(("key", "ridge"), [("h100", 295), ("h200", 206), ("a100", 153)])
def test_gpu_ridge_points(key: str, ridge: float) -> None:
    assert gpu(key).ridge_flop_per_byte == pytest.approx(ridge, abs=1.0)


def test_gpu_usable_memory_as_seen_by_vllm() -> None:
    assert gpu("h100").memory_bytes == pytest.approx(79.19 * GIB)
    assert gpu("h200").memory_bytes == pytest.approx(140.4 * GIB)
    assert gpu("a100").memory_bytes == pytest.approx(79.0 * GIB, rel=0.01)


# -- KV capacity (numbers.md §5) -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("gpu_key", "model_key", "tp", "low", "high"),
    [
        ("h100", "llama-3.1-8b", 1, 437_000, 441_000),
        ("h200", "llama-3.1-8b", 1, 888_000, 892_000),
        ("a100", "llama-3.1-8b", 1, 436_000, 441_000),
        ("h100", "llama-3.1-70b", 2, 17_000, 20_000),
        ("h200", "llama-3.1-70b", 2, 378_000, 381_000),
        ("a100", "llama-3.1-70b", 2, 17_000, 20_000),
        ("h100", "llama-3.1-70b", 4, 464_000, 471_000),
        ("h200", "llama-3.1-70b", 4, 1_180_000, 1_200_000),
        ("a100", "llama-3.1-70b", 4, 464_000, 470_000),
        ("h100", "llama-3.1-70b", 8, 1_355_000, 1_370_000),
        ("h200", "llama-3.1-70b", 8, 2_790_000, 2_820_000),
        ("a100", "llama-3.1-70b", 8, 1_355_000, 1_370_000),
    ],
    ids=lambda v: str(v),
)
def test_kv_capacity_tokens(gpu_key: str, model_key: str, tp: int, low: int, high: int) -> None:
    prof = profile(gpu_key, model_key, tp=tp)
    assert low <= prof.kv_capacity_tokens <= high
    assert prof.num_gpu_blocks == prof.kv_capacity_tokens // 16


def test_explicit_blocks_and_cpu_kv_space_override_the_memory_formula() -> None:
    assert profile("h100", "llama-3.1-8b", num_gpu_blocks_override=100).kv_capacity_tokens == 1_600
    cpu = profile("cpu", "tiny-llama", kv_cache_bytes=float(GIB))
    assert cpu.kv_capacity_tokens == GIB // 1_024
    assert cpu.num_gpu_blocks == GIB // 1_024 // 32


# -- vLLM defaults (numbers.md §3) -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("gpu_key", "model_key", "knobs", "seqs", "batched", "block"),
    [
        ("h100", "llama-3.1-8b", {}, 1_024, 8_192, 16),
        ("h200", "llama-3.1-8b", {}, 1_024, 8_192, 16),
        ("a100", "llama-3.1-8b", {}, 256, 2_048, 16),
        ("l40s", "llama-3.1-8b", {}, 256, 2_048, 16),
        ("cpu", "tiny-llama", {"kv_cache_bytes": float(GIB)}, 256, 2_048, 32),
        ("cpu", "tiny-llama", {"kv_cache_bytes": float(GIB), "block_size": 64}, 256, 2_048, 64),
        (
            "h100",
            "llama-3.1-8b",
            {"max_num_seqs": 64, "max_num_batched_tokens": 512, "block_size": 64},
            64,
            512,
            64,
        ),
    ],
    ids=["h100", "h200", "a100", "l40s", "cpu", "cpu_block_64", "h100_overrides"],
)
def test_vllm_batch_defaults_per_device_class(
    gpu_key: str, model_key: str, knobs: dict[str, object], seqs: int, batched: int, block: int
) -> None:
    prof = profile(gpu_key, model_key, tp=1, **knobs)
    assert prof.resolved_max_num_seqs == seqs
    assert prof.resolved_max_num_batched_tokens == batched
    assert prof.resolved_block_size == block
    assert prof.gpu_memory_utilization == 0.9
    assert prof.enable_prefix_caching


def test_max_model_len_defaults_to_the_models_context() -> None:
    assert profile().resolved_max_model_len == 131_072
    assert profile(max_model_len=8_192).resolved_max_model_len == 8_192


def test_step_overhead_calibrated_per_model_and_tp_else_gpu_default() -> None:
    assert profile("h200", "llama-3.1-8b").resolved_step_overhead_s == pytest.approx(1.86e-3)
    assert profile("h200", "llama-3.1-70b", tp=4).resolved_step_overhead_s == pytest.approx(4.14e-3)
    assert (
        profile("a100", "qwen3-32b", tp=2).resolved_step_overhead_s == gpu("a100").step_overhead_s
    )
    assert profile(step_overhead_s=0.0).resolved_step_overhead_s == 0.0


# -- configuration errors -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"gpu_key": "b200"}, "unknown GPU"),
        ({"model_key": "llama-4-400b"}, "unknown model"),
        ({"gpu_key": "l40s", "model_key": "llama-3.1-70b", "tp": 1}, "does not fit"),
        ({"gpu_key": "h100", "model_key": "llama-3.1-70b", "tp": 1}, "does not fit"),
        ({"gpu_key": "h100", "model_key": "llama-3.1-8b", "tp": 3}, "does not divide"),
        ({"gpu_key": "h100", "model_key": "llama-3.1-8b", "tp": 0}, "must be >= 1"),
        (
            {"gpu_key": "cpu", "model_key": "tiny-llama", "block_size": 16, "kv_cache_bytes": 1e9},
            "multiple of 32",
        ),
        ({"gpu_key": "h100", "model_key": "llama-3.1-8b", "block_size": -16}, "positive"),
        (
            {"gpu_key": "h100", "model_key": "llama-3.1-8b", "gpu_memory_utilization": 0.1},
            "does not fit",
        ),
    ],
    ids=[
        "unknown_gpu",
        "unknown_model",
        "70b_tp1_l40s",
        "70b_tp1_h100",
        "tp_not_dividing_kv_heads",
        "tp_zero",
        "cpu_block_16",
        "negative_block",
        "too_little_memory",
    ],
)
def test_config_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        profile(**kwargs)  # type: ignore[arg-type]


def test_names_are_case_insensitive_and_config_error_is_a_value_error() -> None:
    assert profile("H100", "Llama-3.1-8B") == profile("h100", "llama-3.1-8b")
    assert issubclass(ConfigError, ValueError)


def test_default_cpu_profile_fits_the_tiny_model() -> None:
    prof = profile("cpu", "tiny-llama")
    assert prof.kv_capacity_tokens > 0


def test_kv_bytes_per_gpu_when_tp_exceeds_kv_heads() -> None:
    prof = profile("h100", "tiny-llama", tp=4)  # 2 KV heads over 4 GPUs: one head per GPU
    assert prof.kv_bytes_per_token_per_gpu == 1_024 / 2


# -- step time ------------------------------------------------------------------------------------
COST_PROFILES = [
    profile("h100", "llama-3.1-8b"),
    profile("a100", "llama-3.1-8b"),
    profile("h100", "llama-3.1-70b", tp=4),
    profile("l40s", "llama-3.1-8b", tp=2),
    profile("cpu", "tiny-llama", kv_cache_bytes=float(GIB)),
]
COSTS = [StepCostModel.from_profile(p) for p in COST_PROFILES]
COST_IDS = [p.label for p in COST_PROFILES]


@pytest.mark.parametrize("cost", COSTS, ids=COST_IDS)
def test_step_time_table_is_monotone(cost: StepCostModel) -> None:
    tokens = [1, 8, 64, 256, 1_024, 4_096, 8_192]
    prefill = [cost.prefill_time(n) for n in tokens]
    assert prefill == sorted(prefill) and len(set(prefill)) == len(prefill)
    cached = [cost.prefill_time(512, c) for c in (0, 1_000, 10_000, 100_000)]
    assert cached == sorted(cached) and cached[0] < cached[-1]
    decode_batch = [cost.decode_step_time(b, b * 1_000) for b in (1, 8, 64, 256, 1_024)]
    assert decode_batch == sorted(decode_batch)
    decode_ctx = [cost.decode_step_time(32, c) for c in (0, 10_000, 100_000, 1_000_000)]
    assert decode_ctx == sorted(decode_ctx) and decode_ctx[0] < decode_ctx[-1]
    assert cost.step_time(0, 0, 0, 0) == 0.0
    assert cost.decode_step_time(1, 0) >= cost.overhead_s


@settings(max_examples=150, deadline=None)
@given(
    i=st.integers(0, len(COSTS) - 1),
    tokens=st.floats(1, 16_384),
    kv=st.floats(0, 2e6),
    pairs=st.floats(0, 1e9),
    samples=st.floats(0, 1_024),
    dt=st.floats(0.5, 4_096),
    dkv=st.floats(1, 1e6),
)
def test_step_time_is_monotone_in_tokens_and_context(
    i: int, tokens: float, kv: float, pairs: float, samples: float, dt: float, dkv: float
) -> None:
    cost = COSTS[i]
    base = cost.step_time(tokens, kv, pairs, samples)
    assert base > 0 and math.isfinite(base)
    assert cost.step_time(tokens + dt, kv, pairs, samples) > base
    assert cost.step_time(tokens, kv + dkv, pairs, samples) > base
    assert cost.step_time(tokens, kv, pairs + dkv, samples) > base
    assert cost.step_time(tokens, kv, pairs, samples + dt) >= base


def test_decode_step_is_memory_bound_at_small_batch_and_compute_grows() -> None:
    cost = StepCostModel.from_profile(profile())
    # one decode of an 8B model reads ~15 GB of weights: a few ms on an H100
    assert 4e-3 < cost.decode_step_time(1, 100) < 10e-3
    # numbers.md §4.1: 8B decode with a full KV pool (~56 GB) is ~27 ms
    assert 20e-3 < cost.decode_step_time(256, 430_000) < 35e-3
    # per-token decode cost falls with batch until the ridge
    assert decode_seconds_per_token(profile(), 64, 500) < decode_seconds_per_token(
        profile(), 1, 500
    )
    assert decode_throughput(profile(), 64, 500) > decode_throughput(profile(), 1, 500)
    assert prefill_seconds_per_token(profile(), 10_000) > prefill_seconds_per_token(profile(), 0)


# -- concurrency ceilings --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prof", "context", "binding"),
    [
        (profile("h100", "llama-3.1-8b"), 10, CeilingKind.COMPUTE_RIDGE),
        (profile("h100", "llama-3.1-8b"), 4_000, CeilingKind.KV_CAPACITY),
        (profile("a100", "llama-3.1-8b"), 1_000, CeilingKind.MAX_NUM_SEQS),
        (profile("l40s", "llama-3.1-8b"), 100, CeilingKind.MAX_NUM_SEQS),
        (profile("h100", "llama-3.1-70b", tp=4), 32_000, CeilingKind.KV_CAPACITY),
        (profile("h100", "llama-3.1-8b", max_num_seqs=16), 10, CeilingKind.MAX_NUM_SEQS),
    ],
    ids=["8b_h100_short", "8b_h100_long", "8b_a100_1k", "8b_l40s", "70b_tp4_32k", "max_seqs_16"],
)
def test_concurrency_ceilings_name_the_lowest(
    prof: EngineProfile, context: float, binding: CeilingKind
) -> None:
    c = concurrency_ceilings(prof, context)
    all_three = (c.max_num_seqs, c.kv_capacity, c.compute_ridge)
    assert c.binding.kind is binding
    assert c.binding.sequences == min(x.sequences for x in all_three)
    assert c.max_num_seqs.sequences == prof.resolved_max_num_seqs
    assert c.kv_capacity.sequences == pytest.approx(prof.kv_capacity_tokens / context, rel=1e-3)
    assert c.sequences == int(c.binding.sequences)


def test_compute_ridge_is_infinite_for_long_contexts() -> None:
    c = concurrency_ceilings(profile(), 32_000)
    assert math.isinf(c.compute_ridge.sequences)
    assert math.isfinite(concurrency_ceilings(profile(), 10).compute_ridge.sequences)


def test_registries_hold_the_documented_names() -> None:
    assert {"h100", "h200", "a100", "l40s", "cpu"} <= set(GPUS)
    assert {"llama-3.1-8b", "llama-3.1-70b", "qwen3-32b", "tiny-llama"} <= set(MODELS)
