"""The live router under faults: Redis dying under load, replicas dying, refusing, hanging, and
clients walking away. Real clients (httpx, the OpenAI SDK) talk to a `RouterServer` in front of
simulated replicas; every test has a hard timeout and its teardown checks that the router holds
no request any more (empty ledger, in-flight gauges at zero).

Two replicas `a` and `b` live for the whole module (faults reset after each test); tests that
kill a replica start one of their own. Router settings are per test, with short deadlines.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from redis_server import RedisServer
from router_fixtures import (
    MODEL,
    assert_router_idle,
    finished_requests,
    ledger_size,
    metric_value,
    replica_entry,
    replica_status,
    router_metric,
    router_settings,
    router_tasks,
    running_requests,
    sim_args,
    wait_until,
)
from router_harness import RouterServer
from sim_fleet import SimReplica

from deploy.tiny_model import default_model_dir, make_tiny_model
from router.http.proxy import RetryBudget
from router.telemetry import parse_decision_header

ADMIN_KEY = "fault-test-admin"
ABORTS = "vllm:request_success_total"
ABORTED = {"finished_reason": "abort"}
# a probe interval long enough that the router never notices a fault through /health
NO_PROBES = {"probe_interval_s": 60.0}
RR = {"name": "round_robin"}
DECISIONS = {"decision_header": True}


# -- fixtures --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir() -> Path:
    md = default_model_dir()
    make_tiny_model(md)
    return md


@pytest.fixture(scope="module")
def pair(model_dir: Path) -> Iterator[tuple[SimReplica, SimReplica]]:
    """Replicas `a` and `b` (with KV events), shared by the module."""
    with (
        SimReplica(*sim_args(model_dir, kv_events=True)) as a,
        SimReplica(*sim_args(model_dir, kv_events=True)) as b,
    ):
        yield a, b


def _healthy(sim: SimReplica) -> bool:
    try:
        return httpx.get(f"{sim.url}/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _idle(sim: SimReplica) -> bool:
    return running_requests(sim) == 0


@pytest.fixture
def replicas(pair: tuple[SimReplica, SimReplica]) -> Iterator[tuple[SimReplica, SimReplica]]:
    """`a` and `b` with no fault; afterwards faults cleared and both engines idle again."""
    for sim in pair:
        sim.set_faults(reset=True)
    yield pair
    for sim in pair:
        wait_until(partial(_healthy, sim), 10.0, "the replica to listen again")
        sim.set_faults(reset=True)
    for sim in pair:
        wait_until(partial(_idle, sim), 5.0, "the replica's engine to idle")


@pytest.fixture
def doomed(model_dir: Path) -> Iterator[SimReplica]:
    """A replica of this test alone (it may be killed)."""
    with SimReplica(*sim_args(model_dir)) as sim:
        yield sim


@pytest.fixture
def start_router(model_dir: Path) -> Iterator[Callable[..., RouterServer]]:
    """`start_router(replica_entries, **settings)`: a started router with every replica ready.
    Teardown: the router holds no request (ledger empty, gauges zero), then it stops."""
    servers: list[RouterServer] = []

    def start(replicas: list[dict[str, Any]], **overrides: Any) -> RouterServer:
        server = RouterServer(router_settings(model_dir, replicas, **overrides))
        servers.append(server)
        server.start()
        server.wait_ready(len(replicas))
        return server

    yield start
    try:
        for server in servers:
            assert_router_idle(server)
    finally:
        for server in servers:
            server.stop()


# -- requests --------------------------------------------------------------------------------------
def chat(text: str, *, stream: bool = False, max_tokens: int = 8) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


@dataclass
class Answer:
    status: int
    body: str
    headers: httpx.Headers
    events: list[str] = field(default_factory=list)

    @property
    def decision(self) -> dict[str, str]:
        return parse_decision_header(self.headers.get("x-cp-decision", ""))

    @property
    def complete(self) -> bool:
        """A full answer: 200, and for a stream content events ending with `[DONE]`."""
        if self.status != 200:
            return False
        if not self.events:
            return bool(json.loads(self.body).get("choices"))
        return self.events[-1] == "data: [DONE]" and not any('"error"' in e for e in self.events)


def send(
    client: httpx.Client, router: RouterServer, body: dict[str, Any], path: str = "chat/completions"
) -> Answer:
    """One request through the router, read to its end."""
    with client.stream("POST", f"{router.url}/v1/{path}", json=body) as resp:
        if body.get("stream") and resp.status_code == 200:
            events = [line for line in resp.iter_lines() if line.startswith("data:")]
            return Answer(resp.status_code, "", resp.headers, events)
        resp.read()
        return Answer(resp.status_code, resp.text, resp.headers)


def error_of(answer: Answer) -> dict[str, Any]:
    err: dict[str, Any] = json.loads(answer.body)["error"]
    assert {"message", "type", "code"} <= err.keys()
    return err


# -- 1. Redis dies under load ---------------------------------------------------------------------
SHARED_PREFIX = (
    "You are the support assistant of a small bakery. Answer politely, briefly and only about "
    "bread, cakes, opening hours and orders. Never invent prices; say you will check instead. "
) * 4


@dataclass
class LoadResult:
    phase: str
    status: int
    reason: str
    error: str = ""


class SteadyLoad:
    """Client threads sending requests that share a long prefix until stopped, each result
    tagged with the phase the test was in when the request was sent."""

    def __init__(self, router: RouterServer, threads: int = 2) -> None:
        self.router = router
        self.phase = "before"
        self.results: list[LoadResult] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"load-{i}") for i in range(threads)
        ]

    def __enter__(self) -> SteadyLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(15.0)

    def _run(self, worker: int) -> None:
        with httpx.Client(timeout=10.0) as client:
            n = 0
            while not self._stop.is_set():
                phase = self.phase
                body = {
                    "model": MODEL,
                    "prompt": f"{SHARED_PREFIX}Question {worker}-{n}: when do you open?",
                    "max_tokens": 4,
                }
                n += 1
                try:
                    resp = client.post(f"{self.router.url}/v1/completions", json=body)
                    reason = parse_decision_header(resp.headers.get("x-cp-decision", "")).get(
                        "reason", ""
                    )
                    result = LoadResult(phase, resp.status_code, reason)
                    if resp.status_code != 200:
                        result.error = resp.text
                except httpx.HTTPError as exc:
                    result = LoadResult(phase, 0, "", repr(exc))
                with self._lock:
                    self.results.append(result)

    def seen(self, phase: str, reason: str) -> bool:
        with self._lock:
            return any(r.phase == phase and r.reason == reason for r in self.results)

    def failures(self) -> list[LoadResult]:
        with self._lock:
            return [r for r in self.results if r.status != 200]


def _ready(router: RouterServer) -> httpx.Response:
    return httpx.get(f"{router.url}/ready", timeout=2.0)


@pytest.mark.redis
@pytest.mark.timeout(60)
def test_redis_stopped_under_load(
    replicas: tuple[SimReplica, SimReplica],
    redis_server: RedisServer,
    start_router: Callable[..., RouterServer],
) -> None:
    a, b = replicas
    router = start_router(
        [replica_entry("a", a, kv_events=True), replica_entry("b", b, kv_events=True)],
        redis={"url": redis_server.url},
        telemetry=DECISIONS,
    )
    assert _ready(router).json()["index"] == "redis"
    hits = "cp_index_lookup_seconds_count"
    with SteadyLoad(router) as load:
        wait_until(lambda: load.seen("before", "prefix_hit"), 10.0, "affinity before the fault")
        fallbacks = router_metric(router, "cp_routing_fallbacks_total", reason="index_unknown")

        load.phase = "down"
        redis_server.kill()
        wait_until(
            lambda: _ready(router).json()["status"] == "degraded", 5.0, "/ready to say degraded"
        )
        ready = _ready(router)
        assert ready.status_code == 200  # still serving: routing on load alone
        assert any("redis" in reason for reason in ready.json()["reasons"]), ready.json()
        # what the RedisBreakerOpen alert reads (helm/controlplane/files/prometheus/alerts.yaml)
        assert router_metric(router, "cp_redis_breaker_open", store="prefix_index") == 1.0
        assert router_metric(router, "cp_redis_breaker_opens_total", store="prefix_index") >= 1.0
        wait_until(
            lambda: (
                router_metric(router, "cp_routing_fallbacks_total", reason="index_unknown")
                > fallbacks
            ),
            5.0,
            "index_unknown fallbacks while Redis is down",
        )
        down_requests = len(load.results)
        wait_until(lambda: len(load.results) >= down_requests + 4, 10.0, "traffic while down")

        load.phase = "restarting"
        redis_server.restart()
        hits_back = router_metric(router, hits, outcome="hit")
        load.phase = "after"
        back_at = time.monotonic()
        wait_until(lambda: load.seen("after", "prefix_hit"), 10.0, "affinity after Redis returned")
        affinity_s = time.monotonic() - back_at
        wait_until(lambda: _ready(router).json()["status"] == "ready", 5.0, "/ready to recover")
        assert router_metric(router, hits, outcome="hit") > hits_back
        assert router_metric(router, "cp_redis_breaker_open", store="prefix_index") == 0.0
        # every router has applied KV events in-process here: their freshness is exported
        assert router_metric(router, "cp_kv_events_trusted", replica="a") == 1.0

    by_phase = {
        p: sum(1 for r in load.results if r.phase == p) for p in ("before", "down", "after")
    }
    print(f"\nredis fault: requests by phase {by_phase}; affinity back {affinity_s:.1f}s after")
    assert by_phase["down"] >= 4
    assert load.failures() == []


# -- 2. a replica dies mid-stream -----------------------------------------------------------------
@pytest.mark.timeout(40)
@pytest.mark.parametrize("client_kind", ["httpx", "openai"])
def test_replica_killed_mid_stream(
    client_kind: str,
    replicas: tuple[SimReplica, SimReplica],
    doomed: SimReplica,
    start_router: Callable[..., RouterServer],
) -> None:
    _, b = replicas
    router = start_router(
        [replica_entry("a", doomed), replica_entry("b", b)],
        policy=RR,
        health=NO_PROBES,
        telemetry=DECISIONS,
    )
    doomed.set_faults(die_after_chunks=3)  # role chunk + 2 content chunks, then exit(1)
    b_before = finished_requests(b)
    retries_before = router_metric(router, "cp_retries_total")
    body = chat("tell me a long story", stream=True, max_tokens=200)
    # the read timeout bounds "the stream is closed within 2 s of the replica's death"
    timeout = httpx.Timeout(5.0, read=2.0)

    if client_kind == "httpx":
        with httpx.Client(timeout=timeout) as client:
            answer = send(client, router, body)
        assert answer.status == 200
        assert answer.decision["replica"] == "a"  # round robin: the first request goes to a
        *content, last = answer.events
        assert content and all('"error"' not in e for e in content)
        error = json.loads(last.removeprefix("data:"))["error"]
        assert error["code"] == "upstream_died"
        assert "data: [DONE]" not in answer.events
    else:
        chunks = []
        with (
            # 2 s for every phase, reads included
            openai.OpenAI(
                base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=2.0
            ) as client,
            pytest.raises(openai.APIError) as caught,
        ):
            for chunk in client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "tell me a long story"}],
                max_tokens=200,
                stream=True,
            ):
                chunks.append(chunk)
        # an error event from the router, not a broken connection or a read timeout
        assert not isinstance(caught.value, openai.APIConnectionError)
        assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "upstream_died"
        assert chunks

    assert doomed.wait_exit(5.0) != 0
    wait_until(
        lambda: router_metric(router, "cp_requests_total", status="upstream_died") == 1,
        5.0,
        "the request counted as upstream_died",
    )
    assert router.call(lambda: router.runtime.ledger.view("a").requests) == 0
    # never a retry after the first byte: b never saw the request
    assert router_metric(router, "cp_retries_total") == retries_before
    assert finished_requests(b) == b_before


# -- 3. a replica that never accepts the request ---------------------------------------------------
REFUSE_S = 4.0


@pytest.mark.timeout(40)
@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ({"refuse_s": REFUSE_S}, "connect"),  # listening socket closed, connections dropped
        ({"unavailable": True}, "503"),  # 503 before any token
    ],
    ids=["connect_refused", "503"],
)
def test_not_accepted_is_retried_once_elsewhere(
    fault: dict[str, Any],
    reason: str,
    replicas: tuple[SimReplica, SimReplica],
    start_router: Callable[..., RouterServer],
) -> None:
    a, b = replicas
    router = start_router(
        [replica_entry("a", a), replica_entry("b", b)],
        policy=RR,
        health=NO_PROBES,  # the router keeps believing a is ready: only the proxy sees the fault
        telemetry=DECISIONS,
    )
    a_before, b_before = finished_requests(a), finished_requests(b)
    a.set_faults(**fault)
    n = 6
    with httpx.Client(timeout=10.0) as client:
        answers = [send(client, router, chat(f"hello {i}", stream=i % 2 == 1)) for i in range(n)]
    assert [x.status for x in answers] == [200] * n  # 0 client errors
    assert all(x.complete for x in answers)
    assert {x.decision["replica"] for x in answers} == {"b"}
    assert router_metric(router, "cp_retries_total", reason=reason) >= 1
    # every request executed exactly once: all on b, none on a
    assert finished_requests(b) - b_before == n
    wait_until(lambda: _healthy(a), REFUSE_S + 5.0, "a to listen again")
    assert finished_requests(a) == a_before


@pytest.mark.timeout(30)
def test_retries_stop_when_the_budget_is_spent(
    replicas: tuple[SimReplica, SimReplica], start_router: Callable[..., RouterServer]
) -> None:
    """The whole fleet answers 503: the first requests are retried (3 tokens to start), then
    none, since a request with no budget left earns 0 tokens at ratio 0."""
    a, b = replicas
    router = start_router(
        [replica_entry("a", a), replica_entry("b", b)],
        policy=RR,
        health={**NO_PROBES, "consecutive_failures": 100},  # nobody is ejected
        timeouts={"retry_budget": 0.0},
    )
    a.set_faults(unavailable=True)
    b.set_faults(unavailable=True)
    n = 6
    with httpx.Client(timeout=10.0) as client:
        answers = [send(client, router, chat(f"hi {i}")) for i in range(n)]
    assert all(x.status >= 500 for x in answers)
    for x in answers:
        error_of(x)
    assert router_metric(router, "cp_retries_total", reason="503") == 3


@pytest.mark.parametrize(
    ("ratio", "requests", "retries_allowed"),
    [
        (0.0, 10, 3),  # the floor only
        (0.2, 10, 5),  # 3 + 10 x 0.2
        (0.5, 100, 10),  # at most 10 banked: deposits before any retry are capped
        (1.0, 5, 8),  # 3 + 5
    ],
)
def test_retry_budget(ratio: float, requests: int, retries_allowed: int) -> None:
    budget = RetryBudget(ratio)
    for _ in range(requests):
        budget.deposit()
    spent = 0
    while budget.spend():
        spent += 1
    assert spent == retries_allowed
    assert not budget.spend()


def test_retry_budget_refills_with_traffic() -> None:
    budget = RetryBudget(0.25, initial=0.0)
    assert not budget.spend()
    for _ in range(4):
        budget.deposit()
    assert budget.spend()
    assert not budget.spend()


# -- 4. the client goes away -----------------------------------------------------------------------
@pytest.mark.timeout(40)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "waiting"])
def test_client_disconnect_cancels_upstream(
    stream: bool,
    replicas: tuple[SimReplica, SimReplica],
    start_router: Callable[..., RouterServer],
) -> None:
    a, _ = replicas
    router = start_router([replica_entry("a", a)], health=NO_PROBES)
    a.set_faults(slow_factor=50.0)  # a long generation: seconds, not milliseconds
    tasks_before = router_tasks(router)
    aborts_before = finished_requests(a, "abort")
    disconnects_before = router_metric(router, "cp_client_disconnects_total")
    body = chat("write an essay", stream=stream, max_tokens=500)

    if stream:
        with (
            httpx.Client(timeout=10.0) as client,
            client.stream("POST", f"{router.url}/v1/chat/completions", json=body) as resp,
        ):
            assert resp.status_code == 200
            lines = resp.iter_lines()  # kept: a dropped iterator closes the connection
            first = next(line for line in lines if line.startswith("data:"))
            assert '"choices"' in first
            wait_until(lambda: running_requests(a) == 1, 5.0, "the request to run on a")
            assert ledger_size(router) == 1
            assert router_metric(router, "cp_outstanding_requests", replica="a") == 1
            next(lines)  # still streaming
        # leaving both blocks closes the response and the connection mid-stream
    else:
        # the client gives up while the router waits for the whole answer
        with httpx.Client(timeout=1.0) as client, pytest.raises(httpx.ReadTimeout):
            client.post(f"{router.url}/v1/chat/completions", json=body)
    closed_at = time.monotonic()

    deadline = closed_at + 5.0  # hard limit; the target is 100 ms
    with httpx.Client(timeout=2.0) as poll:  # keep-alive: a poll costs ~1 ms
        while metric_value(poll.get(f"{a.url}/metrics").text, ABORTS, **ABORTED) == aborts_before:
            assert time.monotonic() < deadline, "the replica never saw the cancellation"
    latency_ms = (time.monotonic() - closed_at) * 1000
    print(
        f"\nclient disconnect ({'stream' if stream else 'waiting'}) -> replica abort seen "
        f"after {latency_ms:.0f} ms (poll resolution: one /metrics scrape)"
    )

    assert finished_requests(a, "abort") == aborts_before + 1
    wait_until(lambda: running_requests(a) == 0, 5.0, "the replica to stop the request")
    wait_until(lambda: ledger_size(router) == 0, 5.0, "the reservation to be released")
    assert router_metric(router, "cp_outstanding_requests", replica="a") == 0
    assert router_metric(router, "cp_inflight_requests") == 0
    assert router_metric(router, "cp_requests_total", status="client_closed") == 1
    assert router_metric(router, "cp_client_disconnects_total") == disconnects_before + 1
    wait_until(lambda: router_tasks(router) == tasks_before, 5.0, "no leaked router tasks")


# -- 5. a hung replica that says it is healthy ----------------------------------------------------
@pytest.mark.timeout(40)
def test_hung_replica_is_ejected_while_health_lies(
    replicas: tuple[SimReplica, SimReplica], start_router: Callable[..., RouterServer]
) -> None:
    a, b = replicas
    router = start_router(
        [replica_entry("a", a), replica_entry("b", b)],
        policy=RR,
        admin_key=ADMIN_KEY,
        health={"probe_interval_s": 0.2},  # probes keep running: /health keeps saying 200
        timeouts={"ttft_s": 1.0},
        telemetry=DECISIONS,
    )
    a.set_faults(stall=True, lie_health=True)
    with httpx.Client(timeout=10.0) as client:
        hung = send(client, router, chat("are you there?"))
        assert hung.status == 504  # the TTFT deadline, not a hang
        assert error_of(hung)["type"]

        rows = httpx.get(
            f"{router.url}/admin/replicas",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=5.0,
        ).json()["replicas"]
        row = next(r for r in rows if r["id"] == "a")
        assert row["ejected"] is True and row["eject_reason"] == "ttft"
        time.sleep(0.5)  # a few probes: they pass, and do not re-admit it
        row = replica_status(router)["a"]
        assert row["ejected"] is True and row["liveness"] == "up" and row["probe_failures"] == 0

        answers = [send(client, router, chat(f"hello {i}", stream=i % 2 == 0)) for i in range(4)]
    assert all(x.complete for x in answers)
    assert {x.decision["replica"] for x in answers} == {"b"}


@pytest.mark.timeout(40)
def test_never_eject_more_than_half_the_fleet_for_slowness(
    replicas: tuple[SimReplica, SimReplica], start_router: Callable[..., RouterServer]
) -> None:
    a, b = replicas
    router = start_router(
        [replica_entry("a", a), replica_entry("b", b)],
        policy=RR,
        health={"probe_interval_s": 0.2},
        timeouts={"ttft_s": 0.8},
    )
    for sim in (a, b):
        sim.set_faults(stall=True, lie_health=True)
    with httpx.Client(timeout=10.0) as client:
        answers = [send(client, router, chat(f"anyone? {i}")) for i in range(3)]
    assert [x.status for x in answers] == [504] * 3
    snapshot = router.call(router.runtime.fleet.snapshot)
    assert sum(1 for r in snapshot.replicas if r.ejected) == 1
    assert sum(router.runtime.fleet.spared.values()) >= 1
