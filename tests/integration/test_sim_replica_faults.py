"""Each fault knob of the simulated replica, as a router would meet it over the network."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sim_fleet import SimReplica, sim_replica

from deploy.processes import group_alive

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def replica() -> Iterator[SimReplica]:
    with sim_replica("--speed", "20") as r:
        yield r


@pytest.fixture(autouse=True)
def _reset(replica: SimReplica) -> Iterator[None]:
    yield
    if replica.child is not None and replica.child.poll() is None:
        replica.set_faults(reset=True)


def _complete(url: str, timeout: float = 5.0, **body: object) -> httpx.Response:
    payload = {"model": MODEL, "prompt": "fault test", "max_tokens": 4, **body}
    return httpx.post(f"{url}/v1/completions", json=payload, timeout=timeout)


def _sse_events(url: str, n_max: int, read_timeout: float, max_tokens: int = 50) -> list[str]:
    """`data:` lines of a streamed completion until the stream ends or stalls."""
    events: list[str] = []
    body = {"model": MODEL, "prompt": "stream", "max_tokens": max_tokens, "stream": True}
    timeout = httpx.Timeout(5.0, read=read_timeout)
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data:"):
                    events.append(line)
                    if len(events) >= n_max:
                        break
    except httpx.ReadTimeout:
        pass
    return events


def test_admin_endpoint_needs_the_token(replica: SimReplica) -> None:
    resp = httpx.post(f"{replica.url}/_faults", json={"stall": True})
    assert resp.status_code == 401 and resp.json()["error"]["code"] == 401
    bad = httpx.post(
        f"{replica.url}/_faults",
        json={"stall": "maybe"},
        headers={"Authorization": f"Bearer {replica.admin_token}"},
    )
    assert bad.status_code == 400
    assert replica.set_faults(slow_factor=2)["slow_factor"] == 2.0


def test_unavailable_answers_503(replica: SimReplica) -> None:
    replica.set_faults(unavailable=True)
    resp = _complete(replica.url)
    assert resp.status_code == 503
    assert resp.json()["error"]["type"] == "ServiceUnavailableError"
    assert resp.json()["error"]["code"] == 503
    assert httpx.get(f"{replica.url}/health").status_code == 200
    replica.set_faults(unavailable=False)
    assert _complete(replica.url).status_code == 200


def test_hang_before_headers(replica: SimReplica) -> None:
    replica.set_faults(hang_before_headers=True)
    with pytest.raises(httpx.ReadTimeout):
        _complete(replica.url, timeout=0.3)
    replica.set_faults(reset=True)
    assert _complete(replica.url).status_code == 200
    assert httpx.get(f"{replica.url}/load").json() == {"server_load": 0}


def test_hang_after_chunks(replica: SimReplica) -> None:
    replica.set_faults(hang_after_chunks=3)
    events = _sse_events(replica.url, n_max=100, read_timeout=0.4)
    assert len(events) == 3
    replica.set_faults(reset=True)
    events = _sse_events(replica.url, n_max=100, read_timeout=2.0, max_tokens=5)
    assert len(events) == 6 and events[-1] == "data: [DONE]"


def test_slow_steps(replica: SimReplica) -> None:
    def e2e() -> float:
        """The replica's own end-to-end latency of one request (no HTTP overhead)."""

        def total() -> float:
            text = httpx.get(f"{replica.url}/metrics").text
            for family in text_string_to_metric_families(text):
                if family.name == "vllm:e2e_request_latency_seconds":
                    return sum(s.value for s in family.samples if s.name.endswith("_sum"))
            raise AssertionError("no e2e histogram")

        before = total()
        assert _complete(replica.url, max_tokens=40).status_code == 200
        return total() - before

    fast = e2e()
    replica.set_faults(slow_factor=10)
    slow = e2e()
    assert 5 * fast < slow < 20 * fast


def test_stall_and_lie_on_health(replica: SimReplica) -> None:
    replica.set_faults(stall=True)
    assert httpx.get(f"{replica.url}/health").status_code == 503
    with pytest.raises(httpx.ReadTimeout):
        _complete(replica.url, timeout=0.3)
    replica.set_faults(lie_health=True)
    assert httpx.get(f"{replica.url}/health").status_code == 200
    replica.set_faults(stall=False)
    assert _complete(replica.url).status_code == 200


def test_refuse_connections_then_recover(replica: SimReplica) -> None:
    replica.set_faults(refuse_s=0.6)
    time.sleep(0.1)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{replica.url}/health", timeout=1.0)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{replica.url}/health", timeout=1.0).status_code == 200:
                break
        except httpx.ConnectError:
            time.sleep(0.05)
    assert _complete(replica.url).status_code == 200


def test_die_after_chunks_from_the_command_line() -> None:
    with sim_replica("--speed", "20", "--fault", "die-after-chunks=2") as r:
        assert _complete(r.url).status_code == 200  # non-streaming answers are not chunks
        events: list[str] = []
        with pytest.raises(httpx.RemoteProtocolError):
            body = {"model": MODEL, "prompt": "x", "max_tokens": 50, "stream": True}
            with httpx.stream("POST", f"{r.url}/v1/completions", json=body, timeout=5.0) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data:"):
                        events.append(line)
        assert len(events) == 2
        assert r.wait_exit() == 1
        assert not group_alive(r.pid)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{r.url}/health", timeout=1.0)


def test_sigterm_exits_cleanly() -> None:
    r = SimReplica("--speed", "20").start()
    assert r.stop() == 0
    assert not group_alive(r.pid)
