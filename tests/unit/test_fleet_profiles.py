"""A live replica's self-description and roofline profile: `router.fleet.profiles` and the
LiveFleet lifecycle around it (read at join, read again after a restart, a description that
fails keeps the replica routed as configured, a profile that cannot be built keeps it LOADING).
The replicas are in-process fakes answering vLLM's `/health`, `/metrics`, `/v1/models`,
`/version`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from controlplane.errors import ConfigError
from controlplane.replica_info import ReplicaInfo, ServedModel
from controlplane.types import Phase
from router.config import ModelGroupConfig, ReplicaConfig, RouterSettings
from router.fleet.live_fleet import LiveFleet
from router.fleet.profiles import ProfileSource, resolve_profile

TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "torch_dtype": "bfloat16",
}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return tmp_path


def described(root: str, name: str = "tiny-llama") -> ReplicaInfo:
    return ReplicaInfo(url="http://r", models=(ServedModel(name, 512, root),), block_size=32)


def resolve(
    cfg: ReplicaConfig, info: ReplicaInfo | None, groups: list[ModelGroupConfig]
) -> tuple[str, ProfileSource, int]:
    prof, source = resolve_profile(cfg, info, groups, block_size=32, num_gpu_blocks=100)
    return prof.label, source, prof.max_model_len


def test_profile_from_the_groups_config_json_and_gpu(model_dir: Path) -> None:
    cfg = ReplicaConfig(id="r", url="http://r")
    group = ModelGroupConfig(name="tiny-llama", gpu="cpu")
    # the root the replica reports is a directory here
    label, source, ctx = resolve(cfg, described(str(model_dir)), [group])
    assert (label.endswith("TP1 on cpu"), label.startswith("hf:tiny-llama:"), source, ctx) == (
        True,
        True,
        ProfileSource.CONFIG_JSON,
        512,
    )
    # or the group names the file, wherever the replica's root is
    pinned = ModelGroupConfig(name="tiny-llama", gpu="cpu", config_json=str(model_dir))
    assert resolve(cfg, described("meta/tiny"), [pinned])[:2] == (label, source)


@pytest.mark.parametrize(
    ("cfg", "source", "label"),
    [
        (ReplicaConfig(id="r", url="http://r"), ProfileSource.DEFAULTS, "llama-3.1-8b TP1 on h100"),
        (
            ReplicaConfig(id="r", url="http://r", gpu="cpu", model="tiny-llama"),
            ProfileSource.REPLICA_KEYS,
            "tiny-llama TP1 on cpu",
        ),
    ],
)
def test_without_a_model_group_the_legacy_keys_say_where_they_came_from(
    cfg: ReplicaConfig, source: ProfileSource, label: str
) -> None:
    other = ModelGroupConfig(name="another-model", gpu="a100")
    for info in (None, described("/nowhere")):
        assert resolve(cfg, info, [other])[:2] == (label, source)


@pytest.mark.parametrize(
    ("group", "message"),
    [
        (ModelGroupConfig(name="tiny-llama", gpu="cpu"), "no config.json for model 'tiny-llama'"),
        (
            ModelGroupConfig(name="tiny-llama", gpu="cpu", config_json="/no/such/dir"),
            "tried /no/such/dir",
        ),
        (ModelGroupConfig(name="tiny-llama", gpu="tpu-v9"), "unknown GPU 'tpu-v9'"),
    ],
)
def test_a_profile_that_cannot_be_built_is_a_clear_error(
    group: ModelGroupConfig, message: str, model_dir: Path
) -> None:
    root = str(model_dir) if "tpu" in group.gpu else "/not/here"
    with pytest.raises(ConfigError, match=message):
        resolve(ReplicaConfig(id="r", url="http://r"), described(root), [group])


# -- the live fleet --------------------------------------------------------------------------------
@dataclass
class Fake:
    root: str
    model: str = "tiny-llama"
    block_size: int = 32
    version: str = "0.32.0"
    describes: bool = True
    created: float = 1.7e9

    def metrics(self) -> str:
        lab = f'engine="0",model_name="{self.model}"'
        return (
            f"vllm:num_requests_running{{{lab}}} 0.0\n"
            f"vllm:num_requests_waiting{{{lab}}} 0.0\n"
            f"vllm:prefix_cache_queries_total{{{lab}}} 0.0\n"
            f"vllm:prefix_cache_queries_created{{{lab}}} {self.created}\n"
            f'vllm:cache_config_info{{block_size="{self.block_size}",enable_prefix_caching="True"'
            f',engine="0",num_gpu_blocks="100",prefix_caching_hash_algo="sha256"}} 1.0\n'
        )

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/metrics":
            return httpx.Response(200, text=self.metrics())
        if path == "/v1/models" and self.describes:
            card = {"id": self.model, "root": self.root, "max_model_len": 512, "parent": None}
            return httpx.Response(200, json={"object": "list", "data": [card]})
        if path == "/version" and self.describes:
            return httpx.Response(200, json={"version": self.version})
        return httpx.Response(404)


class Env:
    def __init__(self, fakes: dict[str, Fake], models: list[ModelGroupConfig]) -> None:
        self.fakes = fakes
        self.now = 0.0
        replicas = [ReplicaConfig(id=rid, url=f"http://{rid}:8000") for rid in fakes]
        settings = RouterSettings(served_model="tiny-llama", replicas=replicas, models=models)
        self.fleet = LiveFleet(
            settings, clock=lambda: self.now, transport=httpx.MockTransport(self.handle)
        )

    def handle(self, request: httpx.Request) -> httpx.Response:
        return self.fakes[request.url.host].handle(request)


@pytest.fixture
async def env(model_dir: Path) -> AsyncIterator[Env]:
    fakes = {"a": Fake(str(model_dir)), "b": Fake(str(model_dir))}
    e = Env(fakes, [ModelGroupConfig(name="tiny-llama", gpu="cpu")])
    yield e
    await e.fleet.aclose()


async def test_replicas_are_described_at_join_and_profiled_from_config_json(env: Env) -> None:
    await env.fleet.refresh()
    a = env.fleet.get("a")
    assert a.phase is Phase.READY and a.info is not None
    assert (a.info.version, a.profile_source, a.profile.max_model_len) == (
        "0.32.0",
        ProfileSource.CONFIG_JSON,
        512,
    )
    row = next(r for r in env.fleet.status() if r["id"] == "a")
    assert (row["profile_source"], row["description_error"], row["drift"]) == (
        "config_json",
        None,
        [],
    )


async def test_an_upgrade_is_seen_after_the_restart_and_reported_as_drift(env: Env) -> None:
    await env.fleet.refresh()
    b = env.fleet.get("b")
    env.fakes["b"].version, env.fakes["b"].created = "0.33.0", 1.8e9  # restarted, upgraded
    env.now += 10.0
    await env.fleet.refresh()
    assert b.incarnation == 1 and b.info is not None and b.info.version == "0.33.0"
    # a tie: the smallest id's configuration is the reference
    assert (b.phase, [str(f) for f in b.drift]) == (Phase.READY, ["version"])
    assert env.fleet.get("a").drift == ()


async def test_a_replica_that_cannot_describe_itself_is_routed_as_configured(
    model_dir: Path,
) -> None:
    e = Env({"a": Fake(str(model_dir), describes=False)}, [])
    try:
        await e.fleet.refresh()
        a = e.fleet.get("a")
        assert (a.phase, a.info, a.profile_source) == (Phase.READY, None, ProfileSource.DEFAULTS)
        assert a.describe_error is not None and "/v1/models answered 404" in a.describe_error
        assert e.fleet.groups.models == ("tiny-llama",)  # the configured served_model
        # retried on a later scrape once probe_interval_s has passed, not on every one
        e.fakes["a"].describes = True
        await e.fleet.refresh()
        assert a.info is None
        e.now += e.fleet.settings.health.probe_interval_s
        await e.fleet.refresh()
        assert a.info is not None and a.describe_error is None
    finally:
        await e.fleet.aclose()


async def test_a_model_group_without_config_json_keeps_its_replica_loading() -> None:
    e = Env({"a": Fake("/not/on/this/machine")}, [ModelGroupConfig(name="tiny-llama", gpu="cpu")])
    try:
        await e.fleet.refresh()
        a = e.fleet.get("a")
        assert a.phase is Phase.LOADING
        row = e.fleet.status()[0]
        assert "no config.json for model 'tiny-llama'" in str(row["last_error"])
    finally:
        await e.fleet.aclose()


@pytest.mark.parametrize(
    ("models", "message"),
    [
        ([{"name": "m", "gpu": "cpu"}, {"name": "m", "gpu": "h100"}], "must be unique"),
        ([{"name": "m"}], "gpu"),  # the GPU kind is never guessed
        ([{"name": "", "gpu": "cpu"}], "name"),
    ],
)
def test_model_groups_in_settings_are_checked(models: list[dict[str, str]], message: str) -> None:
    from router.config import load_settings

    with pytest.raises(ConfigError, match=message):
        load_settings(models=models)


def test_an_old_config_keeps_working() -> None:
    from router.config import load_settings

    s = load_settings(replicas=[{"id": "r", "url": "http://r:8000", "gpu": "cpu"}])
    assert (s.models, s.replicas[0].model) == ([], "llama-3.1-8b")
