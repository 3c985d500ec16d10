"""The router's drain and grace deadline, in process (`RouterServer`, the real uvicorn server).

exit signal       /ready 503 {"status": "draining"}, /health 200, new requests served
drain_s later     new connections refused
grace deadline    a stream still running is cut: counted in cp_shutdown_cut_requests_total,
                  the router's books released (empty ledger), the server stops
"""

from __future__ import annotations

import json
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from router_fixtures import MODEL, replica_entry, router_settings, sim_args, wait_until
from router_harness import RouterServer
from sim_fleet import SimReplica

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def sim(model_dir: Path) -> Iterator[SimReplica]:
    with SimReplica(*sim_args(model_dir, speed=1.0)) as replica:
        yield replica


def _chat(i: int, *, stream: bool, max_tokens: int) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"drain test {i}"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


def _refused(url: str) -> bool:
    port = int(url.rsplit(":", 1)[1])
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_drain_then_refuse_then_cut_at_the_grace_deadline(sim: SimReplica, model_dir: Path) -> None:
    settings = router_settings(
        model_dir,
        [replica_entry("a", sim)],
        shutdown={"drain_s": 1.5, "grace_s": 1.0},
    )
    router = RouterServer(settings)
    router.start()
    try:
        router.wait_ready(1)
        before = httpx.post(
            f"{router.url}/v1/chat/completions", json=_chat(2, stream=False, max_tokens=4)
        )
        assert before.status_code == 200 and before.headers.get("connection") != "close"
        stream_end: dict[str, str] = {}
        first_bytes = threading.Event()

        def long_stream() -> None:  # ~4-5 s of tokens: outlives drain + grace
            body = _chat(0, stream=True, max_tokens=900)
            text = ""
            try:
                with (
                    httpx.Client(timeout=30.0) as client,
                    client.stream("POST", f"{router.url}/v1/chat/completions", json=body) as r,
                ):
                    for chunk in r.iter_text():
                        text += chunk
                        first_bytes.set()
                stream_end["end"] = "complete"
            except httpx.RemoteProtocolError:
                stream_end["end"] = "cut"  # the connection closed mid-body
            stream_end["text"] = text

        streamer = threading.Thread(target=long_stream)
        streamer.start()
        assert first_bytes.wait(20.0)
        router.server.handle_exit(signal.SIGTERM, None)  # what the signal handler runs

        ready = httpx.get(f"{router.url}/ready", timeout=5.0)
        assert ready.status_code == 503 and ready.json()["status"] == "draining"
        assert httpx.get(f"{router.url}/health", timeout=5.0).status_code == 200
        served = httpx.post(
            f"{router.url}/v1/chat/completions", json=_chat(1, stream=False, max_tokens=4)
        )
        assert served.status_code == 200  # during the drain window: still served
        # ... on a connection it then closes, so a keep-alive client reconnects elsewhere
        assert served.headers.get("connection") == "close"

        wait_until(lambda: _refused(router.url), 20.0, "new connections refused after drain")
        streamer.join(30.0)
        assert not streamer.is_alive()
        router.thread.join(30.0)
        assert not router.thread.is_alive()
        # cut at the deadline: the stream ends with an error event the client can read
        assert stream_end["end"] == "complete" and "[DONE]" not in stream_end["text"]
        last = stream_end["text"].strip().rsplit("\n\n", 1)[-1]
        assert json.loads(last.removeprefix("data: "))["error"]["code"] == "shutting_down"
        metrics = router.runtime.metrics
        assert metrics.shutdown_cut._value.get() == 1
        assert len(router.runtime.ledger) == 0
    finally:
        router.stop()
