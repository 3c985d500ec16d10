"""Two models behind one router: simulated replicas (vLLM's HTTP protocol) serving `tiny-llama`
(two replicas, context 512) and `tiny-other` (one replica, context 1024), the OpenAI SDK in
front. Requests route by their `model` to that model's group; an unknown model is OpenAI's 404
error JSON listing what is served; `/v1/models` is the union; each group's context length is
the one its replicas report."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI
from router_fixtures import (
    assert_router_idle,
    finished_requests,
    replica_entry,
    router_settings,
    sim_args,
)
from router_harness import RouterServer
from sim_fleet import SimReplica, sim_replicas

from deploy.tiny_model import make_tiny_model
from router.config import load_settings

pytestmark = pytest.mark.timeout(120)

MAIN, OTHER = "tiny-llama", "tiny-other"
CONTEXT = {MAIN: 512, OTHER: 1024}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model(path)
    return path


@pytest.fixture(scope="module")
def sims(model_dir: Path) -> Iterator[dict[str, SimReplica]]:
    def sim(model: str) -> SimReplica:
        args = [*sim_args(model_dir, speed=20.0), "--model-name", model]
        return SimReplica(*args, "--max-model-len", str(CONTEXT[model]))

    reps = {"m1": sim(MAIN), "m2": sim(MAIN), "o1": sim(OTHER)}
    with sim_replicas(reps):
        yield reps


@pytest.fixture(scope="module")
def router(model_dir: Path, sims: dict[str, SimReplica]) -> Iterator[RouterServer]:
    entries = [replica_entry(rid, s) for rid, s in sims.items()]
    with RouterServer(router_settings(model_dir, entries)) as server:
        server.wait_ready(3)
        yield server


def _client(router: RouterServer) -> OpenAI:
    return OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)


def test_models_lists_the_union_with_each_groups_context(router: RouterServer) -> None:
    with _client(router) as client:
        cards = client.models.list().data
    assert [c.id for c in cards] == [MAIN, OTHER]
    raw = httpx.get(f"{router.url}/v1/models").json()["data"]
    assert {c["id"]: c["max_model_len"] for c in raw} == CONTEXT


@pytest.mark.parametrize(("model", "group"), [(MAIN, {"m1", "m2"}), (OTHER, {"o1"})])
def test_requests_route_to_their_models_group(
    router: RouterServer, sims: dict[str, SimReplica], model: str, group: set[str]
) -> None:
    before = {rid: finished_requests(s) for rid, s in sims.items()}
    with _client(router) as client:
        for i in range(6):
            out = client.completions.create(model=model, prompt=f"request {i} for", max_tokens=2)
            assert out.model == model
    after = {rid: finished_requests(s) for rid, s in sims.items()}
    served = {rid for rid in sims if after[rid] > before[rid]}
    assert served and served <= group
    assert sum(after[r] - before[r] for r in group) == 6
    assert_router_idle(router)


def test_unknown_model_is_openai_404_listing_the_served_models(router: RouterServer) -> None:
    with _client(router) as client, pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    err = info.value.body
    assert isinstance(err, dict)
    assert (err["code"], err["param"]) == ("model_not_found", "model")
    assert f"`{MAIN}`" in err["message"] and f"`{OTHER}`" in err["message"]
    assert_router_idle(router)


@pytest.mark.parametrize(
    ("model", "words", "status"),
    [
        (MAIN, 200, 400),  # ~600 prompt tokens > 512
        (OTHER, 200, 200),  # the other group's context is 1024
        (MAIN, 50, 200),  # ~150 tokens
    ],
)
def test_context_limit_is_the_groups_as_its_replicas_report(
    router: RouterServer, model: str, words: int, status: int
) -> None:
    body = {"model": model, "prompt": "word " * words, "max_tokens": 2}
    resp = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60.0)
    assert resp.status_code == status, resp.text
    if status == 400:
        error = resp.json()["error"]
        assert "maximum context length is 512 tokens" in error["message"]
    assert_router_idle(router)


def test_remote_tokenization_asks_only_the_configured_models_replicas(
    model_dir: Path, sims: dict[str, SimReplica]
) -> None:
    """tokenizer=remote: /tokenize goes to a replica serving `served_model`, never to one whose
    /tokenize would refuse that name, so both models' requests are served."""
    # the other model's replica first: the one a fleet-wide "first routable" would ask
    entries = [replica_entry(rid, sims[rid]) for rid in ("o1", "m1", "m2")]
    settings = load_settings(replicas=entries, tokenizer="remote", served_model=MAIN)
    with RouterServer(settings) as server:
        server.wait_ready(3)
        with _client(server) as client:
            for model in (MAIN, OTHER) * 3:
                out = client.completions.create(model=model, prompt="tokenize me", max_tokens=2)
                assert out.model == model
        assert_router_idle(server)
