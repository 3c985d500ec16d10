"""A hard quota holds with the approximate tokenizer (`tokenizer: approx`): the router's estimate
of a chat prompt can be far from what the replica counts (the model's chat template, a small
vocabulary), so the reservation must be an upper bound of what the replica reports, or the
settled usage outgrows it and the window overshoots.

A live router (uvicorn, real sockets) with the approximate tokenizer in front of a simulated
replica serving the tiny model (its own byte-level BPE and Llama-3-style template, which the
router does not have); one hard-quota tenant sends waves of concurrent chat requests (long and
short, with and without max_tokens, several messages, a system prompt) until the quota refuses
them. Neither the replica's own token counters nor what the store charged may pass the quota.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from router_fixtures import (
    MODEL,
    assert_router_idle,
    metric_value,
    replica_entry,
    scrape,
    sim_args,
)
from router_harness import RouterServer
from sim_fleet import SimReplica

from controlplane.tenancy.identity import key_digest
from router.config import load_settings

pytestmark = [pytest.mark.timeout(180)]

KEY = "cpk-approx-quota-0123"
QUOTA = 3000
WORDS = ("alpha", "beta", "gamma", "quota", "tenant", "router", "réplica", "naïve", "x", "7")


@pytest.fixture
def sim(model_dir: Path) -> Iterator[SimReplica]:
    with SimReplica(*sim_args(model_dir, speed=1.0)) as s:
        yield s


def chat_body(rng: random.Random) -> dict[str, Any]:
    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))

    messages = [{"role": "user", "content": text()}]
    if rng.random() < 0.5:
        messages = [{"role": "system", "content": text()}, *messages]
    if rng.random() < 0.3:
        messages += [{"role": "assistant", "content": text()}, {"role": "user", "content": text()}]
    body: dict[str, Any] = {"model": MODEL, "messages": messages}
    if rng.random() < 0.7:
        body["max_tokens"] = rng.randint(1, 24)
    return body


def replica_tokens(sim: SimReplica) -> float:
    text = scrape(sim.url)
    return metric_value(text, "vllm:prompt_tokens_total") + metric_value(
        text, "vllm:generation_tokens_total"
    )


async def wave(url: str, rng: random.Random, n: int, statuses: Counter[str]) -> None:
    headers = {"authorization": f"Bearer {KEY}"}
    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=60.0) as client:
        responses = await asyncio.gather(
            *(client.post(f"{url}/v1/chat/completions", json=chat_body(rng)) for _ in range(n))
        )
    statuses.update(str(r.status_code) for r in responses)


def test_a_hard_quota_holds_with_the_approximate_tokenizer(
    model_dir: Path, sim: SimReplica
) -> None:
    settings = load_settings(
        replicas=[replica_entry("a", sim)],
        served_model=MODEL,
        tokenizer="approx",
        tenants=[
            {
                "id": "t",
                "api_key_sha256": [key_digest(KEY)],
                "quota_tokens": QUOTA,
                "quota_window_s": 3600.0,
                "quota_mode": "hard",
            }
        ],
        quota={"default_max_tokens": 16},
        fairness={"mode": "off"},
        telemetry={"json_logs": False, "log_level": "WARNING"},
    )
    base = replica_tokens(sim)
    statuses: Counter[str] = Counter()
    rng = random.Random(5)
    with RouterServer(settings) as router:
        router.wait_ready(1)
        for _ in range(6):  # waves of concurrent requests until the quota refuses them
            asyncio.run(wave(router.url, rng, 24, statuses))
            if statuses["429"] >= 24:
                break
        assert_router_idle(router)
        stats = router.call(lambda: router.runtime.quotas.stats("t"))
    admitted = replica_tokens(sim) - base
    print(f"\nstatuses={dict(statuses)} replica tokens={admitted} charged={stats.charged}")
    assert statuses["200"] > 0 and statuses["429"] > 0  # the quota was the binding limit
    assert set(statuses) <= {"200", "429"}
    assert stats.open == 0 and stats.reserved == statuses["200"]
    # the hard bound, from the replica's own counters and from the store
    assert 0 < admitted <= stats.charged <= QUOTA
