"""`controlplane.replica_info`: what a replica says about itself, read over vLLM's HTTP protocol
(an `httpx.MockTransport` answering with bodies shaped as vLLM 0.32 answers them)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.errors import ReplicaDescriptionError
from controlplane.replica_info import (
    ReplicaInfo,
    ServedModel,
    architecture_of,
    describe_replica,
    parse_models,
    read_capture,
    write_capture,
)

# the cache_config_info sample of a real vLLM CPU replica (0.32.0, block size 64), shortened
CACHE_INFO = (
    'vllm:cache_config_info{block_size="64",cache_dtype="auto",enable_prefix_caching="True",'
    'engine="0",gpu_memory_utilization="0.92",hash_block_size="None",'
    'kv_cache_max_concurrency="2048.0",num_gpu_blocks="16384",'
    'prefix_caching_hash_algo="sha256",user_specified_block_size="True"} 1.0'
)
METRICS = f"# TYPE vllm:cache_config_info gauge\n{CACHE_INFO}\n"


def card(
    name: str, root: str, max_model_len: Any = 1024, parent: str | None = None
) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": 1,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
    }


class Replica:
    """Answers /v1/models, /metrics and /version (each overridable)."""

    def __init__(self, root: str = "/models/tiny") -> None:
        self.models: httpx.Response = httpx.Response(
            200, json={"object": "list", "data": [card("tiny-llama", root)]}
        )
        self.metrics = httpx.Response(200, text=METRICS)
        self.version = httpx.Response(200, json={"version": "0.32.0"})
        self.paths: list[str] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        return {
            "/v1/models": self.models,
            "/metrics": self.metrics,
            "/version": self.version,
        }.get(request.url.path, httpx.Response(404))

    def describe(self) -> ReplicaInfo:
        async def go() -> ReplicaInfo:
            transport = httpx.MockTransport(self.handle)
            async with httpx.AsyncClient(base_url="http://r:8000", transport=transport) as c:
                return await describe_replica(c, timeout_s=1.0)

        return asyncio.run(go())


def test_a_replica_describes_models_cache_and_version(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    rep = Replica(root=str(tmp_path))
    info = rep.describe()
    assert info.url == "http://r:8000"
    assert info.models == (ServedModel("tiny-llama", 1024, str(tmp_path), None),)
    assert (info.block_size, info.num_gpu_blocks, info.hash_block_size) == (64, 16384, None)
    assert (info.enable_prefix_caching, info.prefix_caching_hash_algo) == (True, "sha256")
    assert (info.version, info.architecture, info.model_type) == (
        "0.32.0",
        "LlamaForCausalLM",
        "llama",
    )
    assert info.cache_labels["kv_cache_max_concurrency"] == "2048.0"
    assert rep.paths == ["/v1/models", "/metrics", "/version"]


def test_what_a_replica_does_not_report_stays_unknown() -> None:
    rep = Replica(root="meta-llama/Llama-3.1-8B")  # not a directory here: no architecture
    rep.version = httpx.Response(404)
    rep.metrics = httpx.Response(200, text="# nothing\n")
    info = rep.describe()
    assert (info.version, info.architecture, info.block_size, info.num_gpu_blocks) == (
        None,
        None,
        None,
        None,
    )
    assert info.model_names == ("tiny-llama",)


@pytest.mark.parametrize(
    ("models", "metrics", "message"),
    [
        (httpx.Response(500), None, "/v1/models answered 500"),
        (httpx.Response(200, text="<html>"), None, "not JSON"),
        (httpx.Response(200, json={"data": []}), None, "lists no model"),
        (httpx.Response(200, json={"object": "list"}), None, "no `data` list"),
        (httpx.Response(200, json={"data": [{"object": "model"}]}), None, "without an id"),
        (None, httpx.Response(503), "/metrics answered 503"),
        (None, httpx.Response(200, text=CACHE_INFO[:40] + " 1\n"), "not a Prometheus"),
    ],
)
def test_a_replica_that_cannot_describe_itself_raises(
    models: httpx.Response | None, metrics: httpx.Response | None, message: str
) -> None:
    rep = Replica()
    rep.models = models or rep.models
    rep.metrics = metrics or rep.metrics
    with pytest.raises(ReplicaDescriptionError, match=message):
        rep.describe()


def test_an_unreachable_replica_raises() -> None:
    async def go() -> None:
        def refuse(request: httpx.Request) -> httpx.Response:
            raise httpx.ConnectError("refused", request=request)

        transport = httpx.MockTransport(refuse)
        async with httpx.AsyncClient(base_url="http://r:8000", transport=transport) as c:
            await describe_replica(c)

    with pytest.raises(ReplicaDescriptionError, match="GET /v1/models failed"):
        asyncio.run(go())


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ([card("a", "/m", 4096)], (ServedModel("a", 4096, "/m"),)),
        ([card("a", "/m", "big")], (ServedModel("a", None, "/m"),)),
        ([card("a", "/m", 0)], (ServedModel("a", None, "/m"),)),
        (
            [card("base", "/m"), card("lora1", "/adapters/1", parent="base")],
            (ServedModel("base", 1024, "/m"), ServedModel("lora1", 1024, "/adapters/1", "base")),
        ),
    ],
)
def test_model_cards(data: list[dict[str, Any]], expected: tuple[ServedModel, ...]) -> None:
    assert parse_models({"object": "list", "data": data}) == expected


def test_architecture_needs_a_readable_config(tmp_path: Path) -> None:
    assert architecture_of(None) == (None, None)
    assert architecture_of(str(tmp_path)) == (None, None)
    (tmp_path / "config.json").write_text("[1, 2]")
    assert architecture_of(str(tmp_path)) == (None, None)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [], "model_type": 3}))
    assert architecture_of(str(tmp_path)) == (None, None)


def test_a_capture_round_trips() -> None:
    info = Replica().describe()
    text = write_capture({"a": info})
    assert read_capture(text) == {"a": info}
    assert json.loads(text)["format"] == "controlplane.replica_info/1"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "must be JSON"),
        ('{"replicas": {}}', "not a capture"),
        ('{"format": "controlplane.replica_info/1", "replicas": []}', "must be an object"),
        (
            '{"format": "controlplane.replica_info/1", "replicas": {"a": {"url": "x"}}}',
            "not a replica description",
        ),
    ],
)
def test_a_bad_capture_is_a_clear_error(text: str, message: str) -> None:
    with pytest.raises(ReplicaDescriptionError, match=message):
        read_capture(text)
