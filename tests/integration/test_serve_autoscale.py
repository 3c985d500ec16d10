"""The headroom policy scales the simulated-engine deployment on Ray Serve, on the ingress's demand.

One local Ray cluster (2 CPUs) runs `build_fleet` (deploy/ray/fleet.py): the OpenAI ingress (one
replica) in front of the simulated-engine deployment with our RequestRouter, the engines'
`autoscaling_config.policy` our adapter running the headroom policy (its time constants scaled to
a 3-second load time, `deploy.local_autoscale.local_policy`) on the demand the INGRESS replica
measures (autoscaler/hosts/ray_ingress.py). The engines load for 3 s and run at the roofline speed
of a 32B model on an A100, so a few requests per second need several of them. A load step (a
ramp of streamed chat requests through Serve's proxy) goes up and comes down. Asserted:

- every request succeeds (none refused, none cut), through the scale-up and the scale-down;
- the deployment scaled up under the step (two or more engine replicas running at once) and back
  down to one after it;
- the scale-down drained: a replica was seen STOPPING while requests routed to a replica other
  than the one that stayed were still streaming, and those requests completed;
- after the scale-down every request goes to the replica that stayed (our RequestRouter picks no
  stopped replica).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from redis_server import free_port

from controlplane.loadgen import LoadConfig, LoadResult, Ramp, replica_of, run_load
from deploy.tiny_model import default_model_dir, make_tiny_model

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning"),
]

APP, ENGINE = "fleet", "engine"
LOAD_TIME_S = 3.0
TICK_S = 1.0
PROFILE = ["a100", "qwen3-32b"]
# requests/s: one replica's worth, a step to about three, back to one replica's worth
RAMP = "0:0.5,8:7,23:7,28:0.5,45:0.5"
# the witnesses: sent as the step ends, long enough to outlast the scale-down
WITNESS_AT_S = 24.0
WITNESS_TOKENS = 1500


@dataclass
class Timeline:
    """Serve's replica states of the engine deployment, polled."""

    rows: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def poll(self, t0: float) -> None:
        from ray import serve

        while not self.stop.is_set():
            status = serve.status().applications[APP].deployments[ENGINE]
            states = {str(k).split(".")[-1]: n for k, n in status.replica_states.items()}
            self.rows.append((time.monotonic() - t0, states))
            time.sleep(0.2)

    def running(self) -> int:
        return self.rows[-1][1].get("RUNNING", 0) if self.rows else 0

    def max_running(self) -> int:
        return max((s.get("RUNNING", 0) for _, s in self.rows), default=0)

    def first_stopping(self) -> float | None:
        return next((t for t, s in self.rows if s.get("STOPPING", 0) > 0), None)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    import ray
    from ray import serve

    from deploy.ray.fleet import build_fleet

    md = default_model_dir()
    make_tiny_model(md)
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {
            "engine": "sim",
            "engine_args": {
                "load_time_s": LOAD_TIME_S,
                "gpu": PROFILE[0],
                "roofline_model": PROFILE[1],
                "max_model_len": 8192,
            },
            "autoscaling": {
                "min_replicas": 1,
                "max_replicas": 3,
                "initial_replicas": 1,
                "policy": "deploy.local_autoscale:local_policy",
                "policy_params": {
                    "load_time_s": LOAD_TIME_S,
                    "tick_s": TICK_S,
                    "profile_key": PROFILE,
                },
                "tick_s": TICK_S,
                "load_time_s": LOAD_TIME_S,
            },
            "graceful_shutdown_wait_loop_s": 0.2,
            "router": {
                "served_model": "tiny-llama",
                "tokenizer": str(md),
                "telemetry": {"decision_header": True},
                "demand": {"gpu": PROFILE[0], "model": PROFILE[1]},
            },
        }
        serve.run(build_fleet(args), name=APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


@dataclass
class Witness:
    """A long stream, sent when the step ends: one per replica, still streaming when Serve
    removes replicas, so a removed replica has work to drain."""

    replica: str = ""
    ok: bool = False
    done_s: float = 0.0


async def witness(url: str, t0: float) -> Witness:
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": WITNESS_TOKENS,
        "stream": True,
    }
    w = Witness()
    async with (
        httpx.AsyncClient(timeout=180.0) as client,
        client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp,
    ):
        w.replica = replica_of(resp.headers.get("x-cp-decision")) or ""
        text = "".join([chunk async for chunk in resp.aiter_text()])
        w.ok = resp.status_code == 200 and text.rstrip().endswith("data: [DONE]")
    w.done_s = time.monotonic() - t0
    return w


async def load_with_witnesses(url: str, t0: float) -> tuple[LoadResult, list[Witness]]:
    load = asyncio.create_task(
        run_load([url], Ramp.parse(RAMP), LoadConfig(max_tokens=48, timeout_s=120.0))
    )
    await asyncio.sleep(WITNESS_AT_S)
    witnesses = await asyncio.gather(*(witness(url, t0) for _ in range(3)))
    return await load, list(witnesses)


def test_headroom_scales_the_engines_up_and_down_with_no_failed_request(url: str) -> None:
    timeline = Timeline()
    t0 = time.monotonic()
    poller = threading.Thread(target=timeline.poll, args=(t0,), daemon=True)
    poller.start()
    try:
        assert timeline.running() <= 1
        load_t0 = time.monotonic() - t0
        result, witnesses = asyncio.run(load_with_witnesses(url, t0))
        wait_until(lambda: timeline.running() == 1 and timeline.max_running() >= 2, "down", 120)
        # after the scale-down: everything on the replica that stayed
        after = [
            httpx.post(
                f"{url}/v1/completions",
                json={"model": "tiny-llama", "prompt": f"after {i}", "max_tokens": 2},
                timeout=30.0,
            )
            for i in range(4)
        ]
    finally:
        timeline.stop.set()
        poller.join(5.0)

    failed = [r for r in result.records if not r.ok]
    assert not failed, failed[:5]
    assert len(result.records) == len(Ramp.parse(RAMP).departures())
    assert timeline.max_running() >= 2, timeline.rows[-20:]
    assert all(r.status_code == 200 for r in after)
    stayed = {replica_of(r.headers.get("x-cp-decision")) for r in after}
    assert len(stayed) == 1 and None not in stayed, stayed
    # the drain: replicas were stopped while a witness was streaming on one that left, and
    # every witness ended with its [DONE]
    assert all(w.ok for w in witnesses), witnesses
    stopping = timeline.first_stopping()
    assert stopping is not None, timeline.rows[-20:]
    drained = [w for w in witnesses if w.replica not in stayed and w.done_s > stopping]
    assert drained, (witnesses, stopping, load_t0)
