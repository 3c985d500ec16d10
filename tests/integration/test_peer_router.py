"""An unmodified `vllm-router` (the Rust peer, `pip install vllm-router`) fronts simulated replicas.

The simulated replica must speak vLLM's protocol well enough for a production router written
against real vLLM: its health checks, worker discovery, round-robin and cache-aware policies, and
SSE streaming through the proxy.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from redis_server import free_port

from deploy.local_fleet import FleetSpec, LocalFleet
from deploy.processes import spawn

MODEL = "tiny-llama"


def _router_binary() -> str | None:
    local = Path(sys.executable).parent / "vllm-router"
    return str(local) if local.exists() else shutil.which("vllm-router")


pytestmark = pytest.mark.skipif(_router_binary() is None, reason="vllm-router is not installed")


@pytest.fixture(scope="module")
def sim_fleet() -> Iterator[LocalFleet]:
    spec = FleetSpec(replicas=2, engine="sim", base_port=0, model_name=MODEL, kv_events=False)
    with LocalFleet(spec) as fleet:
        yield fleet


@pytest.fixture(scope="module", params=["round_robin", "cache_aware"])
def router(request: pytest.FixtureRequest, sim_fleet: LocalFleet) -> Iterator[tuple[str, str]]:
    binary = _router_binary()
    assert binary is not None
    port = free_port()
    child = spawn(
        [
            binary,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--policy",
            request.param,
            "--worker-urls",
            *sim_fleet.urls,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert child.poll() is None, "vllm-router exited"
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "vllm-router never became ready"
            time.sleep(0.2)
        yield url, request.param
    finally:
        child.stop(10.0)


def test_completions_stream_through_the_peer_router(router: tuple[str, str]) -> None:
    router_url, _policy = router
    with openai.OpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0) as client:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Say something about prefix caches."}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        done = client.completions.create(model=MODEL, prompt="Hello, fleet", max_tokens=5)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert text and usage and usage[-1].completion_tokens == 12
    assert done.usage is not None and done.usage.completion_tokens == 5


def test_the_peer_router_routes_every_request_to_a_replica(
    router: tuple[str, str], sim_fleet: LocalFleet
) -> None:
    """Every request reaches a replica; round-robin spreads them over both (cache_aware keeps
    these shared-prefix prompts together, as it should)."""
    router_url, policy = router

    def served() -> list[float]:
        counts = []
        for url in sim_fleet.urls:
            text = httpx.get(f"{url}/metrics", timeout=5).text
            total = sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("vllm:request_success_total")
            )
            counts.append(total)
        return counts

    before = served()
    with openai.OpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0) as client:
        for i in range(12):
            client.completions.create(model=MODEL, prompt=f"request {i} " * (i + 1), max_tokens=2)
    after = served()
    assert sum(after) - sum(before) == 12
    if policy == "round_robin":
        assert [a - b for a, b in zip(after, before, strict=True)] == [6, 6]
