"""A roofline `ModelSpec` built from a model's Hugging Face `config.json`, never guessed.

The algorithm, in four steps:

1. The family comes from `model_type` (llama, mistral, qwen2, qwen3, mixtral, qwen2_moe,
   qwen3_moe, deepseek_v2, deepseek_v3); any other is refused.
2. The shapes: layers, hidden, heads, KV heads (default: heads), head_dim (default:
   hidden / heads), MLP width, vocabulary, context (`max_position_embeddings`), tied embeddings
   (default False, as every one of these families' config classes defaults it).
3. MoE, in each family's own names: experts, top-k, expert width, shared-expert width and the
   layers that keep a dense MLP (DeepSeek's `first_k_dense_replace`, Qwen's `mlp_only_layers`).
   MLA (DeepSeek): the latent ranks and head dims; the KV cache holds kv_lora_rank +
   qk_rope_head_dim per token and layer, one "head" that vLLM replicates on every TP rank.
4. Bytes: activations are 16-bit (vLLM serves float32 checkpoints in 16 bits); FP8 checkpoints
   (`quant_method` fp8, or compressed-tensors with 8-bit float or int weights on every Linear)
   store the projections in 1 byte, while embeddings, lm_head, norms and routers stay 16-bit
   (vLLM never quantizes them); the KV cache follows `kv_cache_dtype` (vLLM's flag, "auto":
   16-bit).

A missing, mistyped or non-positive essential field raises `ConfigError` naming it. Biases
(Qwen2's q/k/v) are not counted (< 0.01% of the weights); sliding-window attention and other
quantization schemes are refused rather than modelled as something they are not.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from controlplane.errors import ConfigError
from controlplane.roofline.specs import MlaSpec, ModelSpec, MoeSpec


class Family(NamedTuple):
    qk_norm: bool  # q/k RMSNorm per head (Qwen3)
    moe: str  # whose MoE field names the config uses; "" for a dense model
    mla: bool  # multi-head latent attention (DeepSeek)
    window: str  # the field that switches sliding-window attention on; "" if none


FAMILIES: dict[str, Family] = {
    "llama": Family(False, "", False, ""),
    "mistral": Family(False, "", False, "sliding_window"),
    "qwen2": Family(False, "", False, "use_sliding_window"),
    "qwen3": Family(True, "", False, "use_sliding_window"),
    "mixtral": Family(False, "mixtral", False, "sliding_window"),
    "qwen2_moe": Family(False, "qwen", False, "use_sliding_window"),
    "qwen3_moe": Family(True, "qwen", False, "use_sliding_window"),
    "deepseek_v2": Family(False, "deepseek", True, ""),
    "deepseek_v3": Family(False, "deepseek", True, ""),
}
ACTIVATION_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 2}  # float32: served in 16 bits
KV_CACHE_DTYPES = {"auto": 0, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
# modules FP8 checkpoints leave in 16 bits that the spec keeps in 16 bits anyway
_SIXTEEN_BIT_MODULES = ("lm_head", "gate", "shared_expert_gate", "embed_tokens")


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a config.json; an unreadable file or anything but a JSON object is a ConfigError."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read model config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model config {path} is not a JSON object")
    return data


def model_spec_from_config(
    config: Mapping[str, Any], *, name: str, kv_cache_dtype: str = "auto"
) -> ModelSpec:
    """The roofline spec of the decoder `config` describes (see the module docstring)."""
    r = _Reader(config, name)
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        known = ", ".join(sorted(FAMILIES))
        raise ConfigError(f"{name}: model_type {model_type!r} is not modelled (known: {known})")
    family = FAMILIES[model_type]
    _refuse_sliding_window(config, r, family.window)

    layers, hidden = r.integer("num_hidden_layers"), r.integer("hidden_size")
    heads = r.integer("num_attention_heads")
    mla = _mla(r) if family.mla else None
    if mla is not None:
        kv_heads, head_dim = 1, mla.qk_nope_head_dim + mla.qk_rope_head_dim
    else:
        kv_heads = r.integer("num_key_value_heads", default=heads)
        if heads % kv_heads:
            raise r.error(f"num_key_value_heads ({kv_heads}) does not divide {heads} heads")
        if "head_dim" not in config and hidden % heads:
            raise r.error("no head_dim, and hidden_size is not a multiple of the heads")
        head_dim = r.integer("head_dim", default=hidden // heads)
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise r.error(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {sorted(KV_CACHE_DTYPES)}")
    return ModelSpec(
        name=name,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=r.integer("intermediate_size"),
        vocab=r.integer("vocab_size"),
        max_context=r.integer("max_position_embeddings"),
        tied_embeddings=r.flag("tie_word_embeddings", default=False),
        qk_norm=family.qk_norm,
        dtype_bytes=_activation_bytes(config, r),
        weight_dtype_bytes=_weight_bytes(config, r),
        kv_dtype_bytes=KV_CACHE_DTYPES[kv_cache_dtype],
        moe=_moe(r, family.moe, layers) if family.moe else None,
        mla=mla,
    )


class _Reader:
    """Typed access to config fields; every failure names the model and the field."""

    def __init__(self, config: Mapping[str, Any], name: str) -> None:
        self.config, self.name = config, name

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"{self.name}: config.json: {message}")

    def integer(self, field: str, *, default: int | None = None, minimum: int = 1) -> int:
        value = self.config.get(field)
        if value is None:
            if default is None:
                raise self.error(f"missing {field!r}")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(f"{field!r} must be an integer, got {value!r}")
        if value < minimum:
            raise self.error(f"{field!r} must be >= {minimum}, got {value}")
        return value

    def present(self, field: str) -> None:
        """Fields whose default differs between config classes must be spelled out."""
        if field not in self.config:
            raise self.error(f"missing {field!r}")

    def flag(self, field: str, *, default: bool) -> bool:
        value = self.config.get(field, default)
        if not isinstance(value, bool):
            raise self.error(f"{field!r} must be true or false, got {value!r}")
        return value


def _refuse_sliding_window(config: Mapping[str, Any], r: _Reader, switch: str) -> None:
    if not switch:
        return
    on = config.get(switch)
    if on not in (None, False):
        raise r.error(
            f"sliding-window attention ({switch}={on!r}) is not modelled: the KV model "
            "assumes every layer keeps the whole context"
        )


def _mla(r: _Reader) -> MlaSpec:
    return MlaSpec(
        kv_lora_rank=r.integer("kv_lora_rank"),
        qk_nope_head_dim=r.integer("qk_nope_head_dim"),
        qk_rope_head_dim=r.integer("qk_rope_head_dim"),
        v_head_dim=r.integer("v_head_dim"),
        q_lora_rank=r.integer("q_lora_rank", default=0, minimum=0),  # null: a full-rank q
    )


def _moe(r: _Reader, dialect: str, layers: int) -> MoeSpec | None:
    top_k = r.integer("num_experts_per_tok")
    if dialect == "mixtral":
        experts, width, shared = r.integer("num_local_experts"), r.integer("intermediate_size"), 0
        sparse = layers
    elif dialect == "qwen":
        experts, width = r.integer("num_experts"), r.integer("moe_intermediate_size")
        has_shared = r.config.get("model_type") == "qwen2_moe"
        shared = r.integer("shared_expert_intermediate_size") if has_shared else 0
        step = r.integer("decoder_sparse_step", default=1)
        dense = r.config.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) for i in dense):
            raise r.error(f"'mlp_only_layers' must be a list of layer indices, got {dense!r}")
        sparse = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    else:  # deepseek
        r.present("n_routed_experts")
        if r.config.get("n_routed_experts") is None:
            return None  # DeepSeek's own code: no routed experts, a dense model
        experts, width = r.integer("n_routed_experts"), r.integer("moe_intermediate_size")
        r.present("n_shared_experts")
        shared = r.integer("n_shared_experts", default=0, minimum=0) * width
        r.present("first_k_dense_replace")
        first = r.integer("first_k_dense_replace", minimum=0)
        freq = r.integer("moe_layer_freq", default=1)
        sparse = sum(1 for i in range(layers) if i >= first and i % freq == 0)
    if top_k > experts:
        raise r.error(f"num_experts_per_tok ({top_k}) exceeds the {experts} experts")
    return MoeSpec(experts, top_k, width, shared, dense_layers=layers - sparse)


def _activation_bytes(config: Mapping[str, Any], r: _Reader) -> int:
    dtype = config.get("dtype", config.get("torch_dtype"))
    if dtype is None:
        return 2  # transformers reads a missing dtype as float32, which vLLM serves in 16 bits
    if dtype not in ACTIVATION_DTYPES:
        raise r.error(f"dtype {dtype!r} is not one of {sorted(ACTIVATION_DTYPES)}")
    return ACTIVATION_DTYPES[dtype]


def _weight_bytes(config: Mapping[str, Any], r: _Reader) -> int:
    """0 (the activation dtype) unless the checkpoint is FP8 (or 8-bit int) quantized."""
    qc = config.get("quantization_config")
    if qc is None:
        return 0
    if not isinstance(qc, Mapping):
        raise r.error(f"'quantization_config' must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "fp8":
        _check_unquantized(r, qc.get("ignored_layers") or qc.get("modules_to_not_convert"))
        return 1
    if method == "compressed-tensors":
        groups = qc.get("config_groups")
        if not isinstance(groups, Mapping) or not groups:
            raise r.error("compressed-tensors 'quantization_config' has no 'config_groups'")
        for key, group in groups.items():
            weights = group.get("weights") if isinstance(group, Mapping) else None
            bits = weights.get("num_bits") if isinstance(weights, Mapping) else None
            if bits != 8:
                raise r.error(f"config_groups.{key}: {bits}-bit weights are not modelled")
            if group.get("targets") != ["Linear"]:
                raise r.error(
                    f"config_groups.{key} targets {group.get('targets')!r}; only every Linear "
                    "layer quantized alike is modelled"
                )
        if qc.get("sparsity_config"):
            raise r.error("sparse compressed-tensors checkpoints are not modelled")
        _check_unquantized(r, qc.get("ignore"))
        return 1
    raise r.error(
        f"quantization_config.quant_method {method!r} is not modelled "
        "(fp8, or compressed-tensors with 8-bit weights)"
    )


def _check_unquantized(r: _Reader, modules: object) -> None:
    """Only modules the spec keeps in 16 bits anyway may be left out of quantization."""
    if modules is None:
        return
    if not isinstance(modules, list):
        raise r.error(f"the quantization ignore list must be a list, got {modules!r}")
    for entry in modules:
        tail = str(entry).removeprefix("re:").rstrip("$").rsplit(".", 1)[-1].lstrip("*")
        if tail not in _SIXTEEN_BIT_MODULES:
            raise r.error(
                f"quantization leaves {entry!r} unquantized; a partly quantized body is not "
                "modelled"
            )
