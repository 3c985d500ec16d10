"""Request parsing and validation, output tokens, fault knobs and config of the sim replica."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from controlplane.errors import ConfigError
from controlplane.sim_replica.config import (
    KVEventsSettings,
    ReplicaConfig,
    default_hash_seed,
    is_bind_endpoint,
)
from controlplane.sim_replica.faults import Faults, parse_fault_flags
from controlplane.sim_replica.protocol import ApiError, error_body, output_ids, parse_generation
from controlplane.sim_replica.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
LEN = 1024


def parse(kind: str, body: dict[str, Any], **kw: Any) -> Any:
    kw.setdefault("served_model", "m")
    kw.setdefault("max_model_len", LEN)
    return parse_generation(kind, body, TOK, **kw)  # type: ignore[arg-type]


def refused(kind: str, body: dict[str, Any], status: int = 400, **kw: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(kind, body, **kw)
    assert info.value.status == status
    return info.value


def test_completion_prompt_forms_and_defaults() -> None:
    spec = parse("completion", {"prompt": "ab"})
    assert spec.prompts == [[1, 100, 101]] and spec.max_tokens == [16]
    assert spec.output_tokens == [16] and spec.model == "m"
    assert parse("completion", {"prompt": "ab", "add_special_tokens": False}).prompts == [
        [100, 101]
    ]
    assert parse("completion", {"prompt": [5, 6, 7]}).prompts == [[5, 6, 7]]
    assert parse("completion", {"prompt": [[5], [6, 7]]}).prompts == [[5], [6, 7]]
    assert parse("completion", {"prompt": ["a", "b"], "model": "m"}).prompts == [[1, 100], [1, 101]]


def test_chat_defaults() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    spec = parse("chat", {"messages": msgs})
    n = len(spec.prompts[0])
    assert spec.prompts[0][0] == 1 and spec.prompts[0].count(1) == 1  # BOS from the template
    assert spec.max_tokens == [LEN - n]
    assert parse("chat", {"messages": msgs}, default_max_tokens=50).max_tokens == [50]
    both = {"messages": msgs, "max_tokens": 9, "max_completion_tokens": 7}
    assert parse("chat", both).max_tokens == [7]
    gen = parse("chat", {"messages": msgs, "add_generation_prompt": False}).prompts[0]
    assert len(gen) < n


def test_simulated_stop_and_min_tokens() -> None:
    spec = parse(
        "completion", {"prompt": "x", "max_tokens": 10, "vllm_xargs": {"sim_output_tokens": 3}}
    )
    assert spec.output_tokens == [3] and spec.max_tokens == [10]
    spec = parse(
        "completion",
        {"prompt": "x", "max_tokens": 10, "min_tokens": 5, "vllm_xargs": {"sim_output_tokens": 3}},
    )
    assert spec.output_tokens == [5]
    refused("completion", {"prompt": "x", "max_tokens": 2, "min_tokens": 3})


def test_stream_options() -> None:
    spec = parse(
        "completion",
        {
            "prompt": "x",
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    )
    assert spec.stream and spec.include_usage and spec.continuous_usage
    refused("completion", {"prompt": "x", "stream_options": {"include_usage": True}})


def test_refusals_match_vllm() -> None:
    err = refused("completion", {"prompt": [5] * 1000, "max_tokens": 100})
    assert "maximum context length is 1024 tokens" in err.message
    assert "requested 1100 tokens (1000 in the messages, 100 in the completion)" in err.message
    assert (
        "longer than the maximum model length"
        in refused("completion", {"prompt": [5] * LEN}).message
    )
    refused("completion", {"prompt": "x", "model": "other"}, status=404)
    refused("completion", {"prompt": "x", "n": 2})
    refused("completion", {"prompt": "x", "max_tokens": 0})
    refused("completion", {"prompt": "x", "max_tokens": "5"})
    refused("completion", {"prompt": [600]})  # out of the vocabulary
    refused("completion", {"prompt": []})
    refused("completion", {"prompt": [[]]})
    refused("completion", {})
    refused("chat", {"messages": []})
    refused("chat", {"messages": [{"content": "no role"}]})
    refused("completion", {"prompt": "x", "priority": 1})
    assert parse("completion", {"prompt": "x", "priority": 1}, priority_enabled=True).priority == 1


def test_error_body_shape() -> None:
    assert error_body(503, "down") == {
        "error": {"message": "down", "type": "ServiceUnavailableError", "param": None, "code": 503}
    }
    assert ApiError(400, "bad", param="prompt").body()["error"]["param"] == "prompt"


def test_output_tokens_are_deterministic_per_prompt_and_seed() -> None:
    pool = np.arange(100, 200, dtype=np.int64)
    a = output_ids([1, 2, 3], 50, 0, pool)
    assert a == output_ids([1, 2, 3], 50, 0, pool)
    assert a != output_ids([1, 2, 4], 50, 0, pool)
    assert a != output_ids([1, 2, 3], 50, 7, pool)
    assert set(a) <= set(range(100, 200))
    assert output_ids([1, 2, 3], 10, 0, pool) == a[:10]


def test_fault_knobs() -> None:
    f = Faults()
    f.update(parse_fault_flags(["stall", "slow-factor=3", "die_after_chunks=2", "refuse-s=inf"]))
    assert f.stall and f.slow_factor == 3.0 and f.die_after_chunks == 2
    assert math.isinf(f.refuse_s) and f.to_json()["refuse_s"] == "inf"
    f.update({"reset": True, "unavailable": "true"})
    assert f.unavailable and not f.stall and f.die_after_chunks == -1
    for bad in ({"nope": 1}, {"stall": "maybe"}, {"slow_factor": 0}, {"hang_after_chunks": 1.5}):
        with pytest.raises(ConfigError):
            f.update(bad)
    with pytest.raises(ConfigError):
        parse_fault_flags(["=3"])


def test_config() -> None:
    assert is_bind_endpoint("tcp://*:5557") and is_bind_endpoint("ipc:///tmp/x")
    assert is_bind_endpoint("tcp://[::]:5557") and not is_bind_endpoint("tcp://router:5557")
    assert not KVEventsSettings().enabled
    with pytest.raises(ConfigError, match="needs more KV cache"):
        ReplicaConfig(num_gpu_blocks=8).build_profile()
    prof = ReplicaConfig(num_gpu_blocks=8, max_model_len=200).build_profile()
    assert prof.num_gpu_blocks == 8 and prof.resolved_block_size == 32
    with pytest.raises(ConfigError):
        ReplicaConfig(speed=0)
    with pytest.raises(ConfigError):
        ReplicaConfig(hash_algo="md5")  # type: ignore[arg-type]


def test_default_hash_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert default_hash_seed() == "0" and ReplicaConfig().resolved_hash_seed == "0"
    monkeypatch.delenv("PYTHONHASHSEED")
    assert default_hash_seed() == "vllm-none-hash"
    assert ReplicaConfig(hash_seed="s").resolved_hash_seed == "s"
