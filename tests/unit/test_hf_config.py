"""The roofline spec built from a Hugging Face config.json: it agrees with the hand-written specs
and with the publishers' own figures, FP8 and MLA bytes follow their formulas, and every missing
or unmodelled field is refused by name."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.errors import ConfigError
from controlplane.roofline import StepCostModel, profile
from controlplane.roofline.hf_config import load_config, model_spec_from_config
from controlplane.roofline.specs import MODELS, ModelSpec
from deploy.tiny_model import TinyLlamaSpec, model_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_configs"
TOLERANCE = 0.01
B = 1e9
_DELETE = object()  # a `spec` change that removes the field


def config(fixture: str) -> dict[str, Any]:
    return load_config(FIXTURES / f"{fixture}.json")


def spec(fixture: str, **changes: Any) -> ModelSpec:
    cfg = config(fixture)
    for key, value in changes.items():
        if value is _DELETE:
            cfg.pop(key)
        else:
            cfg[key] = value
    return model_spec_from_config(cfg, name=fixture)


# -- the hand-written table --------------------------------------------------------------------
COMPARED = (
    "weight_bytes",
    "weight_bytes_read_per_step",
    "kv_bytes_per_token",
    "body_flops_per_token",
    "lm_head_flops_per_sample",
    "attn_flops_per_pair",
    "params",
    "max_context",
    "layers",
    "hidden",
    "heads",
    "kv_heads",
    "head_dim",
    "intermediate",
    "vocab",
    "tied_embeddings",
    "qk_norm",
)
HAND_WRITTEN = [
    ("llama-3.1-8b", "llama-3.1-8b-instruct"),
    ("llama-3.1-70b", "llama-3.1-70b-instruct"),
    ("qwen3-32b", "qwen3-32b"),
]


@pytest.mark.parametrize("field", COMPARED)
@pytest.mark.parametrize(("key", "fixture"), HAND_WRITTEN, ids=[k for k, _ in HAND_WRITTEN])
def test_config_agrees_with_the_hand_written_spec(key: str, fixture: str, field: str) -> None:
    hand, derived = getattr(MODELS[key], field), getattr(spec(fixture), field)
    assert derived == pytest.approx(hand, rel=TOLERANCE), f"{key}.{field}: {hand} vs {derived}"


@pytest.mark.parametrize(
    "field", [f for f in COMPARED if f not in ("weight_bytes", "weight_bytes_read_per_step")]
)
def test_an_fp8_llama_3_config_agrees_with_the_hand_written_llama_3_8b(field: str) -> None:
    assert getattr(spec("meta-llama-3-8b-instruct-fp8"), field) == getattr(
        MODELS["llama-3-8b"], field
    )


def test_a_config_without_kv_heads_is_multi_head_and_matches_llama_2_7b() -> None:
    derived = spec(
        "llama-3.1-8b-instruct",
        num_key_value_heads=_DELETE,
        intermediate_size=11008,
        vocab_size=32000,
        max_position_embeddings=4096,
    )
    assert derived.kv_heads == derived.heads == 32
    for field in COMPARED:
        assert getattr(derived, field) == getattr(MODELS["llama-2-7b"], field), field


def test_the_tiny_fleet_model_describes_itself_as_its_hand_written_spec() -> None:
    derived = model_spec_from_config(model_config(TinyLlamaSpec()), name="tiny")
    for field in COMPARED:
        assert getattr(derived, field) == getattr(MODELS["tiny-llama"], field), field


# -- the publishers' figures (no hand-written spec) --------------------------------------------
# (fixture, quantity, published figure in billions, one unit of its last digit): publishers
# round (Mixtral's 12.88B is "12.9B") or truncate (Qwen3-30B-A3B's 3.35B is "3.3B"), so the
# derived count must lie within one unit of the last digit published.
PUBLISHED = [
    ("mixtral-8x7b-instruct-v0.1", "params", 46.7, 0.1),  # Mistral's announcement
    ("mixtral-8x7b-instruct-v0.1", "active_params", 12.9, 0.1),
    ("qwen3-30b-a3b", "params", 30.5, 0.1),  # the Qwen3 model card
    ("qwen3-30b-a3b", "active_params", 3.3, 0.1),
    ("deepseek-v3", "params", 671, 1),  # README_WEIGHTS: the main model, MTP layer excluded
    ("deepseek-v3", "active_without_input_embedding", 36.6, 0.1),  # "including the 0.9B head"
    ("deepseek-v2-lite", "params", 15.7, 0.1),  # DeepSeek-V2 paper
    ("deepseek-v2-lite", "active_without_input_embedding", 2.4, 0.1),
]


@pytest.mark.parametrize(
    ("fixture", "quantity", "published", "unit"),
    PUBLISHED,
    ids=[f"{f}-{q}" for f, q, _, _ in PUBLISHED],
)
def test_moe_parameter_counts_match_the_published_figures(
    fixture: str, quantity: str, published: float, unit: float
) -> None:
    m = spec(fixture)
    if quantity == "active_without_input_embedding":
        derived = m.active_params - m.embedding_params
    else:
        derived = getattr(m, quantity)
    assert abs(derived / B - published) < unit, f"{fixture} {quantity}: {derived / B:.3f}B"


@pytest.mark.parametrize(
    ("fixture", "kv_bytes"),
    [
        ("mixtral-8x7b-instruct-v0.1", 2 * 32 * 8 * 128 * 2),  # GQA 8 x 128 over 32 layers
        ("qwen3-30b-a3b", 2 * 48 * 4 * 128 * 2),  # 4 KV heads x 128 over 48 layers
    ],
)
def test_moe_kv_bytes_flops_and_weights(fixture: str, kv_bytes: int) -> None:
    m = spec(fixture)
    assert m.kv_bytes_per_token == kv_bytes
    assert m.body_flops_per_token == 2 * m.active_body_params < 2 * m.body_params
    assert m.weight_bytes == 2 * m.params  # bf16 everywhere
    assert m.weight_bytes_read_per_step == m.weight_bytes - 2 * m.embedding_params


def test_deepseek_v3_layout() -> None:
    m = spec("deepseek-v3")
    assert m.lm_head_params == pytest.approx(0.9 * B, rel=0.05)
    assert m.moe is not None and m.moe.dense_layers == 3 and m.moe_layers == 58
    assert m.moe.shared_intermediate == 2048 and m.moe.experts_per_token == 8


# -- MLA -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fixture", "layers", "kv_lora_rank", "rope_dim"),
    [("deepseek-v3", 61, 512, 64), ("deepseek-v2-lite", 27, 512, 64)],
)
def test_mla_kv_bytes_are_the_latent_plus_the_rotary_key(
    fixture: str, layers: int, kv_lora_rank: int, rope_dim: int
) -> None:
    m = spec(fixture)
    assert m.kv_bytes_per_token == layers * (kv_lora_rank + rope_dim) * 2
    assert m.kv_heads == 1  # one latent, replicated on every TP rank
    fp8_kv = model_spec_from_config(config(fixture), name=fixture, kv_cache_dtype="fp8")
    assert fp8_kv.kv_bytes_per_token == layers * (kv_lora_rank + rope_dim)


def test_mla_without_a_q_lora_projects_q_at_full_rank() -> None:
    m = spec("deepseek-v2-lite")
    assert m.mla is not None and m.mla.q_lora_rank == 0
    with_rank = spec("deepseek-v2-lite", q_lora_rank=256)
    assert with_rank.attn_params_per_layer < m.attn_params_per_layer


def test_deepseek_v3_is_fp8_in_its_projections_only() -> None:
    m = spec("deepseek-v3")
    assert m.linear_dtype_bytes == 1 and m.dtype_bytes == 2 and m.kv_cache_dtype_bytes == 2
    sixteen_bit = 2 * m.embedding_params + 2 * m.lm_head_params
    assert m.params < m.weight_bytes < m.params + sixteen_bit


# -- FP8 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fixture", ["llama-3.1-8b-instruct-fp8", "llama-3.1-8b-instruct-fp8-compressed-tensors"]
)
def test_fp8_halves_the_projections_and_keeps_the_kv_cache(fixture: str) -> None:
    bf16, fp8 = spec("llama-3.1-8b-instruct"), spec(fixture)
    # about half: embeddings and lm_head (1.05B of the 8.03B parameters) stay bf16
    assert 0.5 < fp8.weight_bytes / bf16.weight_bytes < 0.6
    # neuralmagic/Meta-Llama-3.1-8B-Instruct-FP8 is 9.08 GB on disk (5 GB + 4.08 GB)
    assert fp8.weight_bytes == pytest.approx(9.08 * B, rel=TOLERANCE)
    assert fp8.kv_bytes_per_token == bf16.kv_bytes_per_token
    assert fp8.body_flops_per_token == bf16.body_flops_per_token
    assert fp8.params == bf16.params and fp8.dtype_bytes == 2


def test_kv_cache_dtype_fp8_halves_the_kv_bytes_only() -> None:
    auto = spec("llama-3.1-8b-instruct")
    fp8 = model_spec_from_config(config("llama-3.1-8b-instruct"), name="x", kv_cache_dtype="fp8")
    assert fp8.kv_bytes_per_token * 2 == auto.kv_bytes_per_token
    assert fp8.weight_bytes == auto.weight_bytes


def test_gates_left_unquantized_are_accepted() -> None:
    cfg = config("mixtral-8x7b-instruct-v0.1")
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "ignored_layers": ["lm_head", "model.layers.0.block_sparse_moe.gate", "re:.*mlp.gate$"],
    }
    assert model_spec_from_config(cfg, name="m").linear_dtype_bytes == 1


def test_qwen2_moe_counts_its_shared_expert_and_its_dense_layers() -> None:
    base = spec("qwen3-30b-a3b")
    moe = spec(
        "qwen3-30b-a3b",
        model_type="qwen2_moe",
        shared_expert_intermediate_size=4096,
        mlp_only_layers=[0, 1],
    )
    assert moe.moe is not None and moe.moe.shared_intermediate == 4096
    assert moe.moe.dense_layers == 2 and moe.qk_norm is False
    assert spec("qwen3-30b-a3b", decoder_sparse_step=2).moe_layers == 24
    assert moe.active_params > base.active_params


# -- what profiles and step times make of a derived spec -----------------------------------------
def test_derived_specs_serve_as_profiles(monkeypatch: pytest.MonkeyPatch) -> None:
    for fixture in ("llama-3.1-8b-instruct", "llama-3.1-8b-instruct-fp8", "deepseek-v2-lite"):
        monkeypatch.setitem(MODELS, fixture, spec(fixture))
    bf16 = profile("h100", "llama-3.1-8b-instruct")
    fp8 = profile("h100", "llama-3.1-8b-instruct-fp8")
    assert bf16.kv_capacity_tokens == profile("h100", "llama-3.1-8b").kv_capacity_tokens
    assert fp8.kv_capacity_tokens > bf16.kv_capacity_tokens  # the weights freed 7 GB
    fast, slow = StepCostModel.from_profile(fp8), StepCostModel.from_profile(bf16)
    assert fast.decode_step_time(8, 8_000) < slow.decode_step_time(8, 8_000)
    mla = profile("h100", "deepseek-v2-lite", tp=2)
    assert mla.kv_bytes_per_token_per_gpu == mla.model.kv_bytes_per_token  # replicated latent
    assert StepCostModel.from_profile(mla).prefill_time(1_000) > 0


# -- refusals ----------------------------------------------------------------------------------
DROPPED = [
    ("llama-3.1-8b-instruct", "num_hidden_layers"),
    ("llama-3.1-8b-instruct", "hidden_size"),
    ("llama-3.1-8b-instruct", "num_attention_heads"),
    ("llama-3.1-8b-instruct", "intermediate_size"),
    ("llama-3.1-8b-instruct", "vocab_size"),
    ("llama-3.1-8b-instruct", "max_position_embeddings"),
    ("mixtral-8x7b-instruct-v0.1", "num_local_experts"),
    ("mixtral-8x7b-instruct-v0.1", "num_experts_per_tok"),
    ("qwen3-30b-a3b", "num_experts"),
    ("qwen3-30b-a3b", "moe_intermediate_size"),
    ("deepseek-v3", "kv_lora_rank"),
    ("deepseek-v3", "qk_rope_head_dim"),
    ("deepseek-v3", "qk_nope_head_dim"),
    ("deepseek-v3", "v_head_dim"),
    ("deepseek-v3", "n_routed_experts"),
    ("deepseek-v3", "n_shared_experts"),
    ("deepseek-v3", "first_k_dense_replace"),
]


@pytest.mark.parametrize(("fixture", "field"), DROPPED, ids=[f"{f}-{k}" for f, k in DROPPED])
def test_a_missing_essential_field_is_refused_by_name(fixture: str, field: str) -> None:
    with pytest.raises(ConfigError, match=f"missing '{field}'"):
        spec(fixture, **{field: _DELETE})


WRONG = [
    ("llama-3.1-8b-instruct", {"model_type": "gemma"}, "model_type 'gemma'"),
    ("llama-3.1-8b-instruct", {"model_type": _DELETE}, "model_type None"),
    ("llama-3.1-8b-instruct", {"hidden_size": "4096"}, "'hidden_size' must be an integer"),
    ("llama-3.1-8b-instruct", {"num_hidden_layers": True}, "'num_hidden_layers' must be an int"),
    ("llama-3.1-8b-instruct", {"num_hidden_layers": 0}, "'num_hidden_layers' must be >= 1"),
    ("llama-3.1-8b-instruct", {"num_key_value_heads": 5}, "num_key_value_heads"),
    ("llama-3.1-8b-instruct", {"num_attention_heads": 24}, "no head_dim"),
    ("llama-3.1-8b-instruct", {"tie_word_embeddings": "no"}, "'tie_word_embeddings'"),
    ("llama-3.1-8b-instruct", {"torch_dtype": "int8"}, "dtype 'int8'"),
    ("llama-3.1-8b-instruct", {"quantization_config": {"quant_method": "awq"}}, "'awq'"),
    ("mixtral-8x7b-instruct-v0.1", {"sliding_window": 4096}, "sliding_window=4096"),
    ("mixtral-8x7b-instruct-v0.1", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("qwen3-32b", {"use_sliding_window": True}, "use_sliding_window=True"),
    ("qwen3-30b-a3b", {"mlp_only_layers": "0"}, "mlp_only_layers"),
    (
        "llama-3.1-8b-instruct-fp8",
        {"quantization_config": {"quant_method": "fp8", "ignored_layers": ["model.norm", "x"]}},
        "'model.norm' unquantized",
    ),
]


@pytest.mark.parametrize(("fixture", "changes", "message"), WRONG, ids=[m for _, _, m in WRONG])
def test_an_unmodelled_or_mistyped_field_is_refused(
    fixture: str, changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        spec(fixture, **changes)


@pytest.mark.parametrize(
    ("weights", "targets", "message"),
    [
        ({"num_bits": 4, "type": "int"}, ["Linear"], "4-bit weights"),
        ({"num_bits": 8, "type": "float"}, ["re:.*mlp.*"], "targets"),
    ],
)
def test_compressed_tensors_other_than_8_bit_linear_is_refused(
    weights: dict[str, Any], targets: list[str], message: str
) -> None:
    cfg = config("llama-3.1-8b-instruct-fp8-compressed-tensors")
    group = cfg["quantization_config"]["config_groups"]["group_0"]
    group["weights"], group["targets"] = weights, targets
    with pytest.raises(ConfigError, match=message):
        model_spec_from_config(cfg, name="x")


def test_an_unknown_kv_cache_dtype_and_an_unreadable_file_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="kv_cache_dtype 'int4'"):
        model_spec_from_config(config("qwen3-32b"), name="q", kv_cache_dtype="int4")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a JSON object"):
        load_config(tmp_path / "list.json")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.json")


def test_the_config_is_not_modified() -> None:
    cfg = config("deepseek-v3")
    before = copy.deepcopy(cfg)
    model_spec_from_config(cfg, name="d")
    assert cfg == before


# -- monotone in depth -------------------------------------------------------------------------
ALL_FIXTURES = sorted(p.stem for p in FIXTURES.glob("*.json"))


@given(
    fixture=st.sampled_from(ALL_FIXTURES),
    layers=st.integers(min_value=1, max_value=160),
    more=st.integers(min_value=1, max_value=40),
)
def test_weights_and_kv_bytes_grow_with_layers(fixture: str, layers: int, more: int) -> None:
    shallow = spec(fixture, num_hidden_layers=layers)
    deep = spec(fixture, num_hidden_layers=layers + more)
    assert deep.weight_bytes > shallow.weight_bytes
    assert deep.kv_bytes_per_token > shallow.kv_bytes_per_token
    assert deep.body_flops_per_token > shallow.body_flops_per_token


@given(
    heads=st.integers(min_value=1, max_value=64),
    group=st.integers(min_value=1, max_value=8),
    head_dim=st.sampled_from([32, 64, 128, 256]),
    intermediate=st.integers(min_value=1, max_value=60_000),
    layers=st.integers(min_value=1, max_value=120),
    more=st.integers(min_value=1, max_value=40),
)
def test_random_dense_shapes_grow_with_layers(
    heads: int, group: int, head_dim: int, intermediate: int, layers: int, more: int
) -> None:
    shape = {
        "num_attention_heads": heads * group,
        "num_key_value_heads": heads,
        "hidden_size": heads * group * head_dim,
        "intermediate_size": intermediate,
    }
    shallow = spec("llama-3.1-8b-instruct", num_hidden_layers=layers, **shape)
    deep = spec("llama-3.1-8b-instruct", num_hidden_layers=layers + more, **shape)
    assert deep.weight_bytes > shallow.weight_bytes
    assert deep.kv_bytes_per_token == shallow.kv_bytes_per_token * (layers + more) // layers


# -- KV capacity of profiles built from config.json (numbers.md §5, published figures) ----------
@pytest.mark.parametrize(
    ("fixture", "gpu_key", "tp", "low", "high"),
    [
        # the derived capacities of the reference (gpu_memory_utilization 0.9)
        ("llama-3.1-8b-instruct", "h100", 1, 437_000, 441_000),
        ("llama-3.1-8b-instruct", "h200", 1, 888_000, 892_000),
        ("llama-3.1-8b-instruct", "a100", 1, 436_000, 441_000),
        ("llama-3.1-70b-instruct", "h100", 4, 464_000, 471_000),
        ("llama-3.1-70b-instruct", "h200", 4, 1_180_000, 1_200_000),
        ("llama-3.1-70b-instruct", "h100", 8, 1_355_000, 1_370_000),
        # llm-d's benchmark: 307,328 KV tokens per pod for Qwen3-32B on 2 x H100 (within 2%: its
        # memory utilization and reserve are not published)
        ("qwen3-32b", "h100", 2, 301_181, 313_475),
    ],
    ids=lambda v: str(v),
)
def test_profiles_from_config_json_hold_the_published_kv_capacity(
    monkeypatch: pytest.MonkeyPatch, fixture: str, gpu_key: str, tp: int, low: int, high: int
) -> None:
    monkeypatch.setitem(MODELS, fixture, spec(fixture))
    prof = profile(gpu_key, fixture, tp=tp)
    assert low <= prof.kv_capacity_tokens <= high
    assert prof.num_gpu_blocks == prof.kv_capacity_tokens // 16
