"""Bad input never yields a 5xx, never hangs and never reaches a replica.

The corpus (`bad_input_corpus.py`) goes through a live router (uvicorn, real sockets) in front of
two simulated replicas: each case must get its 4xx with an OpenAI error body, and no request may
reach a replica. "Reached" is counted twice: every request the router sends to a replica other
than its health probes and metrics scrapes (a hook on the proxy's upstream client, and an httpx
event hook on the client of probes, scrapes and remote tokenization), and the
replicas' own counters (`vllm:request_success_total`, `vllm:prompt_tokens_total`, the end-to-end
latency count). Odd but valid requests are forwarded, which shows both counters do count.

Raw-socket cases cover what an HTTP client library will not send: a declared `Content-Length`
over the limit (413 before any byte of the body is read), a chunked body that passes the limit
and would go on forever (413 while the client is still sending), a `Content-Length` larger than
the body (408 after `limits.body_timeout_s`, not a hang) or smaller than it.

Then schemathesis generates 10,000 requests from the router's own OpenAPI schema, in process
(ASGI, no network), against a router whose replicas are a fake transport that records every
upstream call: negative (schema-invalid) bodies as generated, negative and positive ones with
`model` pinned to the served model (so that they get past the model check, into tokenization and
hashing). Each response must be below 500; a request the schema calls invalid must be refused
with a 4xx OpenAI error and never forwarded; any refusal is an OpenAI error and forwards nothing;
a 200 forwarded exactly one call. About 3 minutes on 2 busy cores; `CP_BAD_INPUT_CASES=1000`
runs fewer.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema  # type: ignore[import-untyped]
import pytest
import schemathesis
from bad_input_corpus import (
    BAD_INPUTS,
    CHAT,
    COMPLETIONS,
    LIMITS,
    MODEL,
    ODD_BUT_VALID,
    BadInput,
    OddButValid,
    chat,
    completion,
)
from hypothesis import HealthCheck, Phase, given, settings
from router_fixtures import (
    assert_router_idle,
    metric_value,
    replica_entry,
    router_settings,
    scrape,
    sim_args,
    wait_until,
)
from router_harness import RouterServer
from schemathesis.generation import GenerationMode
from schemathesis.python import asgi as schemathesis_asgi
from sim_fleet import SimReplica

from router.config import RouterSettings, load_settings
from router.http.service import create_app
from router.runtime import RouterRuntime

ERROR_KEYS = {"message", "type", "param", "code"}
REPLICA_COUNTERS = (
    "vllm:request_success_total",
    "vllm:prompt_tokens_total",
    "vllm:e2e_request_latency_seconds_count",
)
PROBES = frozenset({"/health", "/metrics"})


def assert_openai_error(status: int, body: bytes, content_type: str | None) -> dict[str, Any]:
    assert content_type is not None and content_type.startswith("application/json"), content_type
    data = json.loads(body)
    assert set(data) == {"error"}, data
    err = data["error"]
    assert set(err) == ERROR_KEYS, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["type"] == ("invalid_request_error" if status != 404 else "not_found_error"), err
    result: dict[str, Any] = err
    return result


# -- the live router over two sim replicas ---------------------------------------------------------
class UpstreamLog:
    """Every request the router sends to a replica, probes and scrapes aside."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.lock = threading.Lock()

    async def hook(self, request: httpx.Request) -> None:
        if request.url.path not in PROBES:
            with self.lock:
                self.sent.append(f"{request.method} {request.url}")

    def sent_by_proxy(self, method: bytes, path: str) -> None:
        with self.lock:
            self.sent.append(f"{method.decode()} {path}")

    def count(self) -> int:
        with self.lock:
            return len(self.sent)


class LiveRouter:
    def __init__(self, server: RouterServer, sims: list[SimReplica], log: UpstreamLog) -> None:
        self.server = server
        self.sims = sims
        self.log = log

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def port(self) -> int:
        return int(self.server.url.rsplit(":", 1)[1])

    def replica_counters(self) -> list[float]:
        out = []
        for sim in self.sims:
            text = scrape(sim.url)
            out += [metric_value(text, name) for name in REPLICA_COUNTERS]
        return out


@pytest.fixture(scope="module")
def live(model_dir: Path) -> Iterator[LiveRouter]:
    with (
        SimReplica(*sim_args(model_dir, speed=20.0)) as a,
        SimReplica(*sim_args(model_dir, speed=20.0)) as b,
    ):
        entries = [replica_entry("a", a), replica_entry("b", b)]
        settings = router_settings(model_dir, entries, limits=LIMITS)
        with RouterServer(settings) as server:
            server.wait_ready(2)
            log = UpstreamLog()

            def install() -> None:
                for rep in server.runtime.fleet.replicas():
                    # the proxy's client (probes and scrapes use `rep.client`)
                    rep.upstream.on_send.append(log.sent_by_proxy)
                    hooks = rep.client.event_hooks
                    rep.client.event_hooks = {
                        "request": [*hooks["request"], log.hook],
                        "response": hooks["response"],
                    }

            server.call(install)
            yield LiveRouter(server, [a, b], log)
            assert_router_idle(server)


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c.id for c in BAD_INPUTS])
def test_bad_input_is_refused_before_any_replica(live: LiveRouter, case: BadInput) -> None:
    counters, sent = live.replica_counters(), live.log.count()
    headers = {} if case.content_type is None else {"content-type": case.content_type}
    with httpx.Client(base_url=live.url, timeout=10.0) as client:
        resp = client.request(case.method, case.path, content=case.body, headers=headers)
    assert resp.status_code == case.status, resp.text
    err = assert_openai_error(resp.status_code, resp.content, resp.headers.get("content-type"))
    if case.param is not None:
        assert err["param"] == case.param, err
    assert live.log.count() == sent, live.log.sent[sent:]
    assert live.replica_counters() == counters


@pytest.mark.parametrize("case", ODD_BUT_VALID, ids=[c.id for c in ODD_BUT_VALID])
def test_odd_but_valid_input_is_forwarded(live: LiveRouter, case: OddButValid) -> None:
    """The control group: these reach a replica, and both counters see it."""
    counters, sent = live.replica_counters(), live.log.count()
    resp = httpx.post(
        live.url + case.path,
        content=case.body,
        headers={"content-type": "application/json"},
        timeout=10.0,
    )
    assert resp.status_code == 200, resp.text
    assert live.log.count() == sent + 1, live.log.sent[sent:]
    wait_until(lambda: live.replica_counters() != counters, 5.0, "the replica to count it")


# -- raw sockets: bodies that lie about their size, or never end -----------------------------------
def _head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length body (the socket's timeout bounds it)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        assert data, f"the connection closed before a response: {buf!r}"
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.split()[1])
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers["content-length"])
    while len(rest) < length:
        data = sock.recv(65536)
        assert data, "the connection closed mid-body"
        rest += data
    return status, headers, rest[:length]


def _connect(live: LiveRouter) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=10.0)
    sock.settimeout(10.0)
    return sock


def _unreached(live: LiveRouter, counters: list[float], sent: int) -> None:
    assert live.log.count() == sent, live.log.sent[sent:]
    assert live.replica_counters() == counters


def test_declared_oversize_body_is_refused_unread(live: LiveRouter) -> None:
    """A Content-Length over the limit: 413 at once, without one byte of the body sent."""
    counters, sent = live.replica_counters(), live.log.count()
    declared = 100 * LIMITS["max_body_bytes"]
    with _connect(live) as sock:
        head = {"content-type": "application/json", "content-length": str(declared)}
        sock.sendall(_head(CHAT, head))
        status, headers, body = _read_response(sock)
    assert status == 413
    assert headers.get("connection") == "close"
    assert assert_openai_error(status, body, headers.get("content-type"))["code"] == (
        "body_too_large"
    )
    _unreached(live, counters, sent)


class EndlessBody:
    """A chunked upload that sends `limit + 4 KiB` in 4 KiB pieces, then would go on forever: it
    blocks until released, and yields until stopped."""

    PIECE = 4096

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.sent = 0
        self.passed_limit = threading.Event()
        self.release = threading.Event()
        self.stop = threading.Event()
        self.exhausted = False

    def __iter__(self) -> Iterator[bytes]:
        while self.sent <= self.limit:
            yield b"x" * self.PIECE
            self.sent += self.PIECE
        self.passed_limit.set()
        self.release.wait(30.0)
        while not self.stop.is_set():
            yield b"x" * self.PIECE
            self.sent += self.PIECE
        self.exhausted = True


def test_chunked_oversize_body_is_refused_before_it_ends(live: LiveRouter) -> None:
    counters, sent = live.replica_counters(), live.log.count()
    body = EndlessBody(LIMITS["max_body_bytes"])
    with _connect(live) as sock:
        sock.sendall(
            _head(CHAT, {"content-type": "application/json", "transfer-encoding": "chunked"})
        )

        def upload() -> None:
            try:
                for piece in body:
                    sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            except OSError:
                body.stop.set()  # the router closed the connection: as it should, eventually

        sender = threading.Thread(target=upload, daemon=True)
        sender.start()
        try:
            assert body.passed_limit.wait(10.0), "the upload did not pass the limit"
            # the client is still sending (blocked, not finished): the router answers anyway
            status, headers, data = _read_response(sock)
            assert not body.exhausted
            assert not body.release.is_set()
        finally:
            body.stop.set()
            body.release.set()
            sender.join(10.0)
    assert not sender.is_alive()
    assert status == 413
    assert headers.get("connection") == "close"
    assert_openai_error(status, data, headers.get("content-type"))
    _unreached(live, counters, sent)


def test_content_length_larger_than_body_is_not_a_hang(live: LiveRouter) -> None:
    """The client declares more than it sends and waits: 408 after the body timeout."""
    counters, sent = live.replica_counters(), live.log.count()
    payload = chat()
    with _connect(live) as sock:
        head = {"content-type": "application/json", "content-length": str(len(payload) + 100)}
        sock.sendall(_head(CHAT, head) + payload)
        status, headers, data = _read_response(sock)  # bounded by the socket's 10 s timeout
    assert status == 408
    err = assert_openai_error(status, data, headers.get("content-type"))
    assert err["code"] == "body_timeout"
    _unreached(live, counters, sent)


def test_content_length_smaller_than_body(live: LiveRouter) -> None:
    """The router reads what was declared: a truncated JSON body, refused as such; the bytes past
    it are no HTTP request, which the server refuses too (uvicorn's own 400, which may come
    first when both arrive in one read); then the connection closes."""
    counters, sent = live.replica_counters(), live.log.count()
    payload = completion()
    responses = []
    with _connect(live) as sock:
        head = {"content-type": "application/json", "content-length": str(len(payload) - 10)}
        sock.sendall(_head(COMPLETIONS, head) + payload)
        while True:
            try:
                responses.append(_read_response(sock))
            except (AssertionError, ConnectionResetError):
                break  # closed
    assert responses
    for status, headers, data in responses:
        assert status == 400, data
        ctype = headers.get("content-type", "")
        if ctype.startswith("application/json"):
            err = assert_openai_error(status, data, ctype)
            assert "not valid JSON" in err["message"], err
    _unreached(live, counters, sent)


# -- schemathesis over the router's OpenAPI --------------------------------------------------------
EXPOSITION = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 0.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="4096"} 1.0
"""


class _Bytes(httpx.AsyncByteStream):
    def __init__(self, *parts: bytes) -> None:
        self.parts = parts

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for part in self.parts:
            yield part


class FakeReplicas:
    """Replicas behind an httpx.MockTransport: healthy, scraped, and answering every generation
    request with a minimal completion; every upstream call is recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes]] = []
        self.lock = threading.Lock()

    def count(self) -> int:
        with self.lock:
            return len(self.calls)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/metrics":
            return httpx.Response(200, text=EXPOSITION)
        if request.method == "GET":  # /v1/models, /version: it does not describe itself
            return httpx.Response(404)
        body = await request.aread()
        with self.lock:
            self.calls.append((path, body))
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        if json.loads(body).get("stream"):
            chunk = {"id": "x", "object": "chunk", "choices": [{"index": 0, "text": "a"}]}
            final = {"id": "x", "object": "chunk", "choices": [], "usage": usage}
            events = [f"data: {json.dumps(c)}\n\n".encode() for c in (chunk, final)]
            stream = _Bytes(*events, b"data: [DONE]\n\n")
            return httpx.Response(200, stream=stream, headers={"content-type": "text/event-stream"})
        data = {"id": "x", "object": "text_completion", "choices": [], "usage": usage}
        return httpx.Response(
            200,
            stream=_Bytes(json.dumps(data).encode()),
            headers={"content-type": "application/json"},
        )


class InProcess:
    def __init__(self, schema: Any, fake: FakeReplicas, openapi: dict[str, Any]) -> None:
        self.schema = schema
        self.fake = fake
        self.openapi = openapi
        self.validators: dict[str, jsonschema.protocols.Validator] = {}
        for path in (CHAT, COMPLETIONS):
            ref = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]
            root = {"components": openapi["components"], **ref["schema"]}
            cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft202012Validator)
            self.validators[path] = cls(root)

    def schema_valid(self, path: str, body: Any) -> bool:
        """Whether the router's own OpenAPI schema calls `body` a valid request body (no body,
        or one that is no JSON value, is not)."""
        if not isinstance(body, dict | list | str | int | float | bool | None):
            return False
        return bool(self.validators[path].is_valid(body))


@pytest.fixture
def in_process(model_dir: Path) -> Iterator[InProcess]:
    """A fresh app and runtime per test: schemathesis' pytest plugin ends every ASGI lifespan
    at each test's teardown, and a closed runtime does not start again."""
    fake = FakeReplicas()
    settings: RouterSettings = load_settings(
        replicas=[{"id": "r1", "url": "http://r1:8000", "gpu": "cpu", "model": MODEL}],
        tokenizer=str(model_dir),
        served_model=MODEL,
        limits=LIMITS,
    )
    # the made-up replica name resolves to a private address for the replica guard
    transport = httpx.MockTransport(fake.handle)
    runtime = RouterRuntime(settings, transport=transport, resolve=lambda _host: ["10.0.0.1"])
    app: Any = create_app(settings, runtime=runtime)
    try:
        # loading the schema starts the app's lifespan in schemathesis' event-loop thread
        schema = schemathesis.openapi.from_asgi("/openapi.json", app)
        with schemathesis_asgi.get_client(app) as client:
            wait_until(
                lambda: client.get("/ready").json().get("ready_replicas") == 1,
                10.0,
                "the fake replica to be ready",
            )
        yield InProcess(schema, fake, app.openapi())
    finally:
        schemathesis_asgi.shutdown_lifespans()


def _pin_model(case: Any) -> Any:
    if isinstance(case.body, dict):
        case.body["model"] = MODEL
    return case


def _check(env: InProcess, path: str, case: Any, seen: Counter[int]) -> None:
    before = env.fake.count()
    resp = case.call()
    status = resp.status_code
    forwarded = env.fake.count() - before
    seen[status] += 1
    valid = env.schema_valid(path, case.body)
    assert status < 500, (status, resp.content[:500], case.body)
    if status >= 400:
        assert_openai_error(status, resp.content, resp.headers.get("content-type", [None])[0])
        assert forwarded == 0, (status, case.body)
    else:
        assert valid, ("a request the schema calls invalid was accepted", status, case.body)
        assert forwarded == 1, case.body
    if not valid:
        assert 400 <= status < 500, (status, case.body)


# (path, generation mode, model pinned to the served one, share of the cases); 10,000 cases in
# all unless CP_BAD_INPUT_CASES says otherwise (a quicker local run)
CASES = int(os.environ.get("CP_BAD_INPUT_CASES", "10000"))
RUNS = [
    (path, mode, pinned, CASES * share // 20)
    for path, mode, pinned, share in [
        (CHAT, GenerationMode.NEGATIVE, False, 3),
        (CHAT, GenerationMode.NEGATIVE, True, 3),
        (CHAT, GenerationMode.POSITIVE, True, 3),
        (COMPLETIONS, GenerationMode.NEGATIVE, False, 3),
        (COMPLETIONS, GenerationMode.NEGATIVE, True, 4),
        (COMPLETIONS, GenerationMode.POSITIVE, True, 4),
    ]
]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("path", "mode", "pinned", "examples"),
    RUNS,
    ids=[f"{p.split('/')[2]}-{m.value}-{'pinned' if pin else 'any'}" for p, m, pin, _ in RUNS],
)
def test_schemathesis_never_5xx_never_forwards_invalid(
    in_process: InProcess, path: str, mode: GenerationMode, pinned: bool, examples: int
) -> None:
    strategy = in_process.schema[path]["POST"].as_strategy(mode)
    if pinned:
        strategy = strategy.map(_pin_model)

    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def run(case: Any) -> None:
        _check(in_process, path, case, seen)

    seen: Counter[int] = Counter()
    run()
    print(f"{path} {mode.value} pinned={pinned}: {examples} cases, statuses {dict(seen)}")
    if mode is GenerationMode.POSITIVE:
        assert seen[200] > 0, seen  # the valid ones went all the way through to a replica
