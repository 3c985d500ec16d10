"""KV events of a replica serving a second model are indexed under that model: a simulated
replica of `tiny-other` (KV events on) behind a router whose configured `served_model` is
`tiny-llama`; after a request, the blocks its events confirm match the prompt as the router
hashes it for `tiny-other` (they would never match if keyed by the configured model)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_fixtures import (
    MODEL,
    assert_router_idle,
    replica_entry,
    router_settings,
    sim_args,
    wait_until,
)
from router_harness import RouterServer
from sim_fleet import SimReplica, sim_replicas

from controlplane.tenancy.model import DEFAULT_TENANT
from controlplane.types import PrefixMatch
from deploy.tiny_model import make_tiny_model
from router.http.openai_api import CompletionRequest

pytestmark = pytest.mark.timeout(120)

OTHER = "tiny-other"
PROMPT = "the same long prompt " * 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model(path)
    return path


@pytest.fixture(scope="module")
def sims(model_dir: Path) -> Iterator[dict[str, SimReplica]]:
    reps = {
        rid: SimReplica(*sim_args(model_dir, speed=20.0, kv_events=True), "--model-name", name)
        for rid, name in (("m1", MODEL), ("o1", OTHER))
    }
    with sim_replicas(reps):
        yield reps


def test_events_of_the_second_models_replica_confirm_its_prompts(
    model_dir: Path, sims: dict[str, SimReplica]
) -> None:
    entries = [replica_entry(rid, s, kv_events=True) for rid, s in sims.items()]
    with RouterServer(router_settings(model_dir, entries)) as router:
        router.wait_ready(2)
        rt = router.runtime
        body = {"model": OTHER, "prompt": PROMPT, "max_tokens": 2}
        resp = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60.0)
        assert resp.status_code == 200, resp.text

        async def hashes() -> tuple[int, ...]:
            req = await rt.core.build(
                CompletionRequest(model=OTHER, prompt=PROMPT, max_tokens=2),
                request_id="probe",
                tenant=DEFAULT_TENANT,
                session=None,
            )
            return req.block_hashes

        blocks: tuple[int, ...] = router.call(hashes)
        assert len(blocks) >= 2

        def confirmed() -> int:
            found: dict[str, PrefixMatch] | None = router.call(
                lambda: rt.index.lookup(blocks, ["o1"])
            )
            match = (found or {}).get("o1")
            return match.confirmed_blocks if match is not None else 0

        wait_until(lambda: confirmed() == len(blocks), 20.0, "o1's KV events to confirm the prompt")
        assert_router_idle(router)
