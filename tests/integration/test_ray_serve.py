"""The router on Ray Serve (`deploy/app.py`): two router replicas behind Serve's HTTP proxy,
sharing one Redis prefix index, in front of two simulated replicas that publish KV events.

A local Ray cluster (2 CPUs, no dashboard) runs the application `build_app` makes: the router
deployment (2 replicas, 0.1 CPU each) and the one KV-event follower (`kv_indexer`). Streams go
through Serve's proxy with the OpenAI SDK; `x-cp-router` names the router replica that answered,
`x-cp-decision` what it decided. Both router replicas must serve streams, and each must route a
prompt to the replica that cached its prefix when that prefix was first routed by the other one
(the index they share in Redis). Without Ray: `deploy/serve_config.yaml` is a valid Serve config
whose builder makes the application it describes, and `build_app` refuses what it must.
"""

from __future__ import annotations

import importlib
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families
from redis_server import RedisServer, available, free_port
from sim_fleet import SimReplica

from controlplane.errors import ConfigError
from deploy.tiny_model import default_model_dir, make_tiny_model
from router.config import RouterSettings
from router.telemetry import parse_decision_header

ROUTER_HEADER = "x-cp-router"
INDEXER_DEPLOYMENT = "kv_indexer"
CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "serve_config.yaml"
MODEL = "tiny-llama"
KEY_PREFIX = "t:serve"
APP = "router"


def build_app(args: dict[str, Any]) -> Any:
    # deploy.app imports Ray, which warns on import: imported here, under the filter above,
    # rather than at collection time
    from deploy import app

    assert (app.ROUTER_HEADER, app.INDEXER_DEPLOYMENT) == (ROUTER_HEADER, INDEXER_DEPLOYMENT)
    return app.build_app(args)


# -- the config file and the builder (no Ray cluster) -------------------------------------------
def test_serve_config_builds_the_application_it_describes() -> None:
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load(CONFIG.read_text())
    schema = ServeDeploySchema.model_validate(raw)
    (app_cfg,) = schema.applications
    assert app_cfg.route_prefix == "/"
    module, _, attr = app_cfg.import_path.partition(":")
    builder = getattr(importlib.import_module(module), attr)
    app = builder(app_cfg.args)

    router = app._bound_deployment
    assert router.num_replicas == app_cfg.args["num_replicas"] == 2
    assert router.ray_actor_options["num_cpus"] == app_cfg.args["num_cpus"]
    settings, indexer = router.init_args
    assert isinstance(settings, RouterSettings)
    assert [r.id for r in settings.replicas] == ["r0", "r1"]
    assert settings.redis.url == app_cfg.args["router"]["redis"]["url"]
    # the routers leave the KV events to the app's one follower
    assert settings.redis.ingest_events is False
    assert indexer._bound_deployment.name == INDEXER_DEPLOYMENT
    assert indexer._bound_deployment.num_replicas == 1


@dataclass(frozen=True)
class BuildCase:
    name: str
    args: dict[str, Any]
    error: str | None = None  # a fragment of the ConfigError; None: builds
    indexer: bool = False
    routers_follow_events: bool = False


REPLICA = {"id": "a", "url": "http://127.0.0.1:1", "kv_events": "tcp://127.0.0.1:2"}
BUILD_CASES = [
    BuildCase(
        "two replicas without redis",
        {"num_replicas": 2, "router": {"replicas": [REPLICA]}},
        error="need a shared prefix index",
    ),
    BuildCase("unknown argument", {"replicas": 2}, error="replicas"),
    BuildCase("bad replica count", {"num_replicas": 0}, error="num_replicas"),
    BuildCase(
        "bad router setting", {"num_replicas": 1, "router": {"port": -1}}, error="invalid router"
    ),
    BuildCase(
        "one replica, in-memory index: it follows the events itself",
        {"num_replicas": 1, "router": {"replicas": [REPLICA]}},
        routers_follow_events=True,
    ),
    BuildCase(
        "redis: one indexer for every router",
        {"num_replicas": 3, "router": {"replicas": [REPLICA], "redis": {"url": "redis://h:1"}}},
        indexer=True,
    ),
    BuildCase(
        "redis, ingest_events off: an external `controlplane indexer`",
        {
            "num_replicas": 3,
            "router": {
                "replicas": [REPLICA],
                "redis": {"url": "redis://h:1", "ingest_events": False},
            },
        },
    ),
    BuildCase(
        "redis, no replica publishes events: no indexer, settings as given",
        {
            "num_replicas": 2,
            "router": {"replicas": [{"id": "a", "url": "u"}], "redis": {"url": "redis://h:1"}},
        },
        routers_follow_events=True,
    ),
]


@pytest.mark.parametrize("case", BUILD_CASES, ids=[c.name for c in BUILD_CASES])
def test_build_app(case: BuildCase) -> None:
    if case.error is not None:
        with pytest.raises(ConfigError, match=case.error):
            build_app(case.args)
        return
    router = build_app(case.args)._bound_deployment
    assert router.num_replicas == case.args["num_replicas"]
    settings, indexer = router.init_args
    assert (indexer is not None) == case.indexer
    follows = not settings.redis.url or settings.redis.ingest_events
    assert follows == case.routers_follow_events


def test_router_config_file_under_args_and_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`router` args > CP_* env > the `router_config` file, as `load_settings` resolves."""
    cfg = tmp_path / "router.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {"served_model": "file-model", "tokenizer": "approx", "redis": {"url": "redis://f:1"}}
        )
    )
    monkeypatch.setenv("CP_TOKENIZER", "remote")
    monkeypatch.setenv("CP_REDIS__KEY_PREFIX", "env-prefix")
    args = {"num_replicas": 2, "router_config": str(cfg), "router": {"served_model": "arg-model"}}
    settings, _ = build_app(args)._bound_deployment.init_args
    assert (settings.served_model, settings.tokenizer) == ("arg-model", "remote")
    assert (settings.redis.url, settings.redis.key_prefix) == ("redis://f:1", "env-prefix")
    with pytest.raises(ConfigError, match="config file not found"):
        build_app({**args, "router_config": str(tmp_path / "missing.yaml")})


# -- on a local Ray cluster -----------------------------------------------------------------------
@dataclass
class Stack:
    url: str  # Serve's HTTP proxy
    redis: redis.Redis
    replica_urls: dict[str, str]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    if not available():
        pytest.skip("redis-server is not installed")
    import ray
    from ray import serve

    md = default_model_dir()
    make_tiny_model(md)
    events = ("--kv-events-endpoint", "tcp://*:0", "--kv-events-replay-endpoint", "tcp://*:0")
    sim_args = ("--model-dir", str(md), "--speed", "5", *events)
    with (
        RedisServer() as server,
        SimReplica(*sim_args) as r0,
        SimReplica(*sim_args) as r1,
    ):
        replicas = []
        for rid, sim in (("r0", r0), ("r1", r1)):
            pub, replay = sim.kv_endpoints()
            replicas.append(
                {"id": rid, "url": sim.url, "gpu": "cpu", "model": MODEL,
                 "kv_events": pub, "kv_replay": replay}
            )  # fmt: skip
        args = {
            "num_replicas": 2,
            "num_cpus": 0.1,
            "indexer_num_cpus": 0.1,
            "router": {
                "served_model": MODEL,
                "tokenizer": str(md),
                "replicas": replicas,
                "redis": {"url": server.url, "key_prefix": KEY_PREFIX},
                "telemetry": {"decision_header": True, "json_logs": False},
            },
        }
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        admin = redis.Redis.from_url(server.url, socket_timeout=5)
        try:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_app(args), name=APP, route_prefix="/")
            url = f"http://127.0.0.1:{port}"
            wait_both_ready(url)
            yield Stack(url, admin, {"r0": r0.url, "r1": r1.url})
        finally:
            admin.close()
            serve.shutdown()  # type: ignore[no-untyped-call]
            ray.shutdown()


def wait_both_ready(url: str, attempts: int = 200) -> None:
    """/ready through the proxy until both router replicas answered 'ready'."""
    ready: set[str] = set()
    with httpx.Client(timeout=10.0) as client:
        for _ in range(attempts):
            resp = client.get(f"{url}/ready")
            if resp.status_code == 200 and resp.json().get("status") == "ready":
                ready.add(resp.headers[ROUTER_HEADER])
            if len(ready) == 2:
                return
            time.sleep(0.05)
    raise AssertionError(f"router replicas ready: {ready}")


@dataclass(frozen=True)
class Answer:
    router: str
    replica: str
    predicted_hit_tokens: int
    text: str
    request_ids: list[str]


def stream(client: openai.OpenAI, prompt: str, rid: str) -> Answer:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-request-id": rid},
    )
    chunks = list(raw.parse())
    assert chunks and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens > 0
    decision = parse_decision_header(raw.headers["x-cp-decision"])
    return Answer(
        router=raw.headers[ROUTER_HEADER],
        replica=decision["replica"],
        predicted_hit_tokens=int(decision["predicted_hit_tokens"]),
        text="".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
        request_ids=raw.headers.get_list("x-request-id"),
    )


def words(rng: random.Random, n: int) -> str:
    return " ".join(
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
        for _ in range(n)
    )


@pytest.fixture
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60.0
    ) as c:
        yield c


def wait_confirmed(stack: Stack, replica: str, above: int, timeout_s: float = 10.0) -> None:
    """Until the index holds more than `above` confirmed blocks of `replica`."""
    deadline = time.monotonic() + timeout_s
    while stack.redis.scard(f"{KEY_PREFIX}:c:{replica}") <= above:
        assert time.monotonic() < deadline, f"no new confirmed block of {replica} in Redis"
        time.sleep(0.02)


def until_other_router(send: Callable[[int], Answer], first: str, attempts: int = 40) -> Answer:
    """`send(i)` until an answer comes from a router replica other than `first`."""
    for i in range(attempts):
        answer = send(i)
        if answer.router != first:
            return answer
    raise AssertionError(f"{attempts} requests, all served by router replica {first}")


@pytest.mark.redis
@pytest.mark.timeout(300)
def test_streams_through_both_router_replicas(stack: Stack, client: openai.OpenAI) -> None:
    rng = random.Random(1)
    first = stream(client, words(rng, 8), "stream-0")
    other = until_other_router(
        lambda i: stream(client, words(rng, 8), f"stream-{i + 1}"), first.router
    )
    for answer, rid in ((first, "stream-0"), (other, None)):
        assert answer.text
        assert answer.replica in stack.replica_urls
        # one x-request-id (Serve's proxy adds it; the router's echo is dropped), the client's
        assert len(answer.request_ids) == 1
        if rid is not None:
            assert answer.request_ids == [rid]


@pytest.mark.redis
@pytest.mark.timeout(300)
def test_router_replicas_share_the_redis_index(stack: Stack, client: openai.OpenAI) -> None:
    """A prefix first routed by one router replica is a prefix hit on the other, both ways."""
    from ray import serve

    rng = random.Random(2)
    learnt_from: dict[str, str] = {}  # first router -> the router that then hit its prefix
    replicas: set[str] = set()  # the replicas those prefixes went to
    for p in range(12):
        prefix = words(rng, 60)
        confirmed = {rid: stack.redis.scard(f"{KEY_PREFIX}:c:{rid}") for rid in stack.replica_urls}
        first = stream(client, f"{prefix} question zero", f"p{p}-0")
        if first.router in learnt_from:
            continue  # that direction is shown; the next prefix may start on the other router
        # the replica's KV events reach the shared index (through the app's indexer) before the
        # other router is asked
        wait_confirmed(stack, first.replica, above=confirmed[first.replica])

        def again(i: int, prefix: str = prefix, p: int = p) -> Answer:
            return stream(client, f"{prefix} question {i + 1}", f"p{p}-{i + 1}")

        second = until_other_router(again, first.router)
        assert second.replica == first.replica, (first, second)
        assert second.predicted_hit_tokens > 0, (first, second)
        learnt_from[first.router] = second.router
        replicas.add(first.replica)
        if len(learnt_from) == 2:
            break
    assert len(learnt_from) == 2, f"prefixes first routed by one router replica only: {learnt_from}"

    # the shared index holds, for those replicas, the routers' speculative entries and the
    # indexer's confirmed ones (from the replicas' KV events)
    for rid in replicas:
        assert stack.redis.zcard(f"{KEY_PREFIX}:s:{rid}") > 0, rid
        assert stack.redis.scard(f"{KEY_PREFIX}:c:{rid}") > 0, rid
    names = [c.get("name") for c in stack.redis.client_list()]
    assert names.count("cp-kv-indexer") >= 1
    assert names.count("cp-router") >= 2

    # the app's one KV-event follower follows both replicas, with nothing lost
    handle = serve.get_deployment_handle(INDEXER_DEPLOYMENT, app_name=APP)
    rows = {row["replica_id"]: row for row in handle.status.remote().result(timeout_s=30)}
    assert set(rows) == set(stack.replica_urls)
    assert all(row["lost"] == 0 for row in rows.values())
    assert sum(row["batches"] for row in rows.values()) > 0


def requests_by_status(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "cp_requests_total":
                status = sample.labels["status"]
                out[status] = out.get(status, 0.0) + sample.value
    return out


@pytest.mark.redis
@pytest.mark.timeout(300)
def test_streams_read_to_the_end_count_as_served(stack: Stack, client: openai.OpenAI) -> None:
    """Each router replica's /metrics (reached through the proxy, named by `x-cp-router`)
    counts every stream its client read to the end as 200, none as client_closed."""
    rng = random.Random(3)
    routers = {stream(client, words(rng, 8), f"m-{i}").router for i in range(6)}
    scraped: dict[str, dict[str, float]] = {}
    with httpx.Client(timeout=10.0) as http:
        for _ in range(100):
            resp = http.get(f"{stack.url}/metrics")
            assert resp.status_code == 200
            scraped[resp.headers[ROUTER_HEADER]] = requests_by_status(resp.text)
            if set(scraped) >= routers:
                break
    assert set(scraped) >= routers
    for router, by_status in scraped.items():
        assert by_status.get("200", 0) > 0, (router, by_status)
        assert set(by_status) == {"200"}, (router, by_status)
