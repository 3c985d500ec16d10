"""One request path, two hosts: the same requests through the simulator and through the live
router (in front of two simulated replicas that publish KV events) give the same decisions,
reservations, index operations and fair-queue charges.

Both hosts drive `RoutingBooks` and `TenantQueueCore`; the books' journal records every step
with its figures (route: replica, reason, expected hit blocks, prompt, uncached and predicted
tokens; speculate / retract: replica, blocks, TTL / grace; first token; finish: outputs). The
requests share documents (so prefix affinity has hits to find) and go one at a time, each after
the previous one's KV events, scrape and retract grace have settled, so both hosts see the same
fleet when they decide.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import httpx
import pytest
from router_fixtures import MODEL, router_settings, sim_args
from router_harness import RouterServer
from sim_fleet import SimReplica

from controlplane.roofline import profile
from controlplane.sim.fleet import FleetConfig, FleetSim
from controlplane.traces.tokens import token_trace
from deploy.tiny_model import CORPUS

BLOCK = 32
BLOCKS = 512
MAX_TOKENS = 8
GAP_S = 1.6  # > the retract grace (1 s) + KV-event delivery + one scrape (0.5 s)
REQUESTS = 9

pytestmark = pytest.mark.timeout(180)


def prompts(seed: int = 7) -> list[str]:
    """Three documents of ~200 words, each request one of them plus its own question."""
    rng = random.Random(seed)
    words = sorted({w.strip(".,;:!?()'\"").lower() for w in CORPUS.split()} - {""})
    words = [w for w in words if w.isalpha()]
    docs = [" ".join(rng.choice(words) for _ in range(200)) for _ in range(3)]
    order = [0, 1, 0, 2, 1, 0, 2, 2, 1][:REQUESTS]
    return [
        f"{docs[d]} question {i}: {' '.join(rng.choice(words) for _ in range(6))}"
        for i, d in enumerate(order)
    ]


def test_the_simulator_and_the_router_book_the_same(model_dir: Path) -> None:
    texts = prompts()
    args = [*sim_args(model_dir, kv_events=True), "--block-size", str(BLOCK)]
    args += ["--num-gpu-blocks", str(BLOCKS)]
    with SimReplica(*args) as r0, SimReplica(*args) as r1:
        entries = []
        for rid, replica in (("replica-0", r0), ("replica-1", r1)):
            pub, replay = replica.kv_endpoints()
            entries.append(
                {"id": rid, "url": replica.url, "gpu": "cpu", "model": MODEL}
                | {"kv_events": pub, "kv_replay": replay, "block_size": BLOCK}
                | {"num_gpu_blocks": BLOCKS}
            )
        settings = router_settings(model_dir, entries, policy={"name": "prefix_affinity"})
        tokens = [
            httpx.post(f"{r0.url}/tokenize", json={"model": MODEL, "prompt": t}).json()["tokens"]
            for t in texts
        ]
        with RouterServer(settings) as router:
            router.wait_ready(2)
            live_books = router.runtime.books
            live_books.journal = []
            with httpx.Client(base_url=router.url, timeout=30) as client:
                for i, text in enumerate(texts):
                    start = time.monotonic()
                    r = client.post(
                        "/v1/completions",
                        json={"model": MODEL, "prompt": text, "max_tokens": MAX_TOKENS},
                        headers={"x-request-id": f"req-{i}"},
                    )
                    assert r.status_code == 200, r.text
                    time.sleep(max(0.0, GAP_S - (time.monotonic() - start)))
            live_journal = list(live_books.journal)
            live_charged = dict(router.runtime.fairq.core.charged)
            assert len(router.runtime.ledger) == 0

    prof = profile("cpu", "tiny-llama", block_size=BLOCK, num_gpu_blocks_override=BLOCKS)
    config = FleetConfig(
        profile=prof, replicas=2, policy=settings.policy, fairness=settings.fairness
    )
    sim = FleetSim(config)
    sim.routers[0].books.journal = []
    trace = token_trace(
        "one-request-path",
        [i * GAP_S for i in range(len(tokens))],
        tokens,
        output_tokens=MAX_TOKENS,
        block=BLOCK,
    )
    result = sim.run(trace)
    assert all(rec.completed for rec in result.records)
    sim_journal = sim.routers[0].books.journal

    assert [e for e in live_journal if e[0] == "route"] == [
        e for e in sim_journal if e[0] == "route"
    ]
    assert live_journal == sim_journal
    assert any(e[0] == "route" and e[3] == "prefix_hit" for e in sim_journal)
    assert sim.queue is not None
    assert live_charged.keys() == sim.queue.charged.keys()
    for tenant, work in sim.queue.charged.items():
        assert live_charged[tenant] == pytest.approx(work, rel=1e-6)
