"""The simulated replica behind vLLM's HTTP surface (Starlette).

| endpoint | behaviour |
|---|---|
| `POST /v1/completions`, `POST /v1/chat/completions` | generation, JSON or SSE (`protocol`) |
| `GET /v1/models` | vLLM's model card (`root`, `max_model_len`) |
| `POST /tokenize`, `POST /detokenize` | prompt or messages form, as vLLM |
| `GET /health` | 200 (empty) while the engine loop runs, 503 when it is stalled or dead |
| `GET /metrics` | vLLM's Prometheus metrics (`metrics`) |
| `GET /kv_event_sources` | the resolved KV-events endpoints (`{}` when events are off) |
| `GET /load`, `GET /version`, `GET /ping` | as vLLM |
| `GET/POST /_faults` | the fault knobs (`faults`); needs `Authorization: Bearer <admin token>` |

Every response carries `X-Request-Id`: the request's header, else a minted uuid4 hex (vLLM's
`--enable-request-id-headers`). The engine request id (and the response id `cmpl-<id>` /
`chatcmpl-<id>`) is that header, else the body's `request_id`, else the minted id. A client that
disconnects aborts its engine requests (their blocks are freed) and counts as
`vllm:request_success_total{finished_reason="abort"}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.errors import CapacityError, ConfigError
from controlplane.roofline.profile import VLLM_REFERENCE_VERSION
from controlplane.sim.engine import SimEngine
from controlplane.sim_replica import protocol as p
from controlplane.sim_replica.blocks import BlockHashTable
from controlplane.sim_replica.config import ReplicaConfig
from controlplane.sim_replica.engine_loop import EngineLoop, LiveRequest
from controlplane.sim_replica.faults import Faults
from controlplane.sim_replica.kv_publisher import KVEventPublisher
from controlplane.sim_replica.metrics import ReplicaMetrics, cache_config_labels
from controlplane.sim_replica.tokenizer import load_tokenizer, output_token_pool

log = logging.getLogger(__name__)

# dense block ids stay below this; the engine numbers never-shared blocks from here up
UNIQUE_ID_FLOOR = 1 << 26
# exit status of the die_after_chunks fault
DIE_STATUS = 1


class Replica:
    """One simulated replica: tokenizer, engine loop, block hashes, metrics, KV publisher."""

    def __init__(self, config: ReplicaConfig) -> None:
        self.config = config
        self.profile = config.build_profile()
        self.max_model_len = self.profile.resolved_max_model_len
        self.tokenizer = load_tokenizer(config.model_dir)
        self.output_pool = output_token_pool(self.tokenizer)
        self.faults = dataclasses.replace(config.faults)
        self.engine = SimEngine(
            self.profile,
            events_enabled=True,
            priority_policy=config.scheduling_policy == "priority",
            fast_forward=False,
            exact_events=True,
            unique_id_floor=UNIQUE_ID_FLOOR,
        )
        self.table = BlockHashTable(
            self.profile.resolved_block_size,
            algo=config.hash_algo,
            seed=config.resolved_hash_seed,
            id_limit=UNIQUE_ID_FLOOR,
        )
        self.metrics = ReplicaMetrics(
            model_name=config.model_name,
            max_model_len=self.max_model_len,
            cache_info=cache_config_labels(
                self.profile,
                hash_algo=config.hash_algo,
                num_gpu_blocks=self.profile.num_gpu_blocks,
            ),
            read_engine=lambda: self.loop.gauges(),
        )
        self.publisher = KVEventPublisher(config.kv_events) if config.kv_events.enabled else None
        self.loop = EngineLoop(
            self.engine,
            self.table,
            self.metrics,
            self.faults,
            speed=config.speed,
            publish=self.publisher.publish if self.publisher is not None else None,
        )
        self.created = p.now_s()
        # set by the server: start refusing connections for that many seconds (a fault)
        self.refuse: Callable[[float], Awaitable[None]] | None = None
        # requests in flight on the generation routes (GET /load)
        self.server_load = 0

    async def startup(self) -> None:
        if self.publisher is not None:
            self.publisher.open()
        self.loop.start()

    async def shutdown(self) -> None:
        await self.loop.stop()
        if self.publisher is not None:
            await self.publisher.close()

    @property
    def healthy(self) -> bool:
        return self.loop.alive or self.faults.lie_health

    # -- generation ------------------------------------------------------------------------------
    def submit(self, spec: p.GenerationSpec, rid: str, wake: asyncio.Event) -> list[LiveRequest]:
        lives: list[LiveRequest] = []
        try:
            for i, prompt in enumerate(spec.prompts):
                n = spec.output_tokens[i]
                out = p.output_ids(prompt, n, spec.seed, self.output_pool)
                lives.append(
                    self.loop.submit(
                        prompt,
                        out,
                        request_id=rid if len(spec.prompts) == 1 else f"{rid}-{i}",
                        notify=wake.set,
                        max_tokens=spec.max_tokens[i],
                        finish_reason="length" if n == spec.max_tokens[i] else "stop",
                        priority=spec.priority,
                        cache_salt=spec.cache_salt,
                    )
                )
        except CapacityError as exc:
            for live in lives:
                self.loop.abort(live)
            raise p.ApiError(503, str(exc)) from exc
        return lives

    def text(self, live: LiveRequest) -> str:
        return self.tokenizer.decode(live.output_ids[: live.produced])


# -- middleware ----------------------------------------------------------------------------------


class RequestIdMiddleware:
    """vLLM's `XRequestIdMiddleware`: echo `X-Request-Id`, or mint a uuid4 hex."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = ""
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                rid = value.decode("latin-1")
                break
        rid = rid or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", rid.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


# -- helpers -------------------------------------------------------------------------------------


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(p.error_body(status, message, param), status_code=status)


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise p.ApiError(400, f"Invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise p.ApiError(400, "the request body must be a JSON object")
    return body


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client has gone away (the body must have been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _die(reason: str) -> None:
    sys.stderr.write(f"sim-replica: fault {reason}: exiting now\n")
    sys.stderr.flush()
    os._exit(DIE_STATUS)


async def _hang() -> None:
    """Never return (until cancelled by a client disconnect or shutdown)."""
    await asyncio.Event().wait()


class _Stream:
    """The SSE events of one streamed generation, with the chunk-counting fault knobs."""

    def __init__(
        self,
        replica: Replica,
        spec: p.GenerationSpec,
        rid: str,
        lives: list[LiveRequest],
        wake: asyncio.Event,
    ) -> None:
        self.replica = replica
        self.spec = spec
        self.rid = rid
        self.lives = lives
        self.wake = wake
        self.created = p.now_s()
        self.sent = 0

    async def events(self) -> AsyncIterator[bytes]:
        replica, spec, lives = self.replica, self.spec, self.lives
        faults = replica.faults
        try:
            texts = [""] * len(lives)
            sent_tokens = [0] * len(lives)
            closed = [False] * len(lives)
            if spec.kind == "chat":
                first = p.delta_choice(spec, 0, "", None, role=True)
                if spec.return_token_ids:
                    first["token_ids"] = []
                obj = p.chunk(spec, self.rid, self.created, [first])
                if spec.return_token_ids:
                    obj["prompt_token_ids"] = lives[0].prompt_ids
                async for event in self._emit(obj, faults):
                    yield event
            while not all(closed):
                await self.wake.wait()
                self.wake.clear()
                for i, live in enumerate(lives):
                    produced = live.produced
                    if closed[i] or (produced == sent_tokens[i] and not live.done):
                        continue
                    text = replica.text(live)
                    delta = text[len(texts[i]) :] if text.startswith(texts[i]) else text
                    ids = live.output_ids[sent_tokens[i] : produced]
                    finish = p.finish_reason(live)
                    texts[i], sent_tokens[i] = text, produced
                    closed[i] = live.done
                    if not ids and finish is None:
                        continue
                    choice = p.delta_choice(
                        spec, i, delta, finish, ids if spec.return_token_ids else None
                    )
                    use = p.usage(lives) if spec.continuous_usage else None
                    async for event in self._emit(
                        p.chunk(spec, self.rid, self.created, [choice], use), faults
                    ):
                        yield event
            if spec.include_usage:
                obj = p.chunk(spec, self.rid, self.created, [], p.usage(lives))
                async for event in self._emit(obj, faults):
                    yield event
            async for event in self._emit(None, faults):
                yield event
        finally:
            for live in lives:
                replica.loop.abort(live)

    async def _emit(self, obj: dict[str, Any] | None, faults: Faults) -> AsyncIterator[bytes]:
        """One SSE event (None: `[DONE]`), behind the hang and die knobs."""
        if 0 <= faults.hang_after_chunks <= self.sent:
            await _hang()
        yield p.SSE_DONE if obj is None else p.sse(obj)
        self.sent += 1
        if 0 <= faults.die_after_chunks <= self.sent:
            _die(f"die_after_chunks={faults.die_after_chunks}")


# -- routes --------------------------------------------------------------------------------------


def build_app(replica: Replica) -> Starlette:
    config = replica.config

    async def generate(request: Request, kind: p.Kind) -> Response:
        faults = replica.faults
        if faults.die_after_chunks == 0:
            _die("die_after_chunks=0")
        if faults.unavailable:
            raise p.ApiError(503, "The replica is unavailable (fault injected)")
        body = await _json_body(request)
        if faults.hang_before_headers or (faults.hang_after_chunks >= 0 and not body.get("stream")):
            await wait_for_disconnect(request)
            return Response(status_code=499)
        spec = p.parse_generation(
            kind,
            body,
            replica.tokenizer,
            served_model=config.model_name,
            max_model_len=replica.max_model_len,
            default_max_tokens=config.default_max_tokens,
            priority_enabled=config.scheduling_policy == "priority",
        )
        base = request.headers.get("x-request-id") or spec.request_id
        base = base or request.state.request_id
        rid = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{base}"
        wake = asyncio.Event()
        lives = replica.submit(spec, base, wake)
        replica.server_load += 1
        if spec.stream:
            stream = _Stream(replica, spec, rid, lives, wake)
            return StreamingResponse(
                stream.events(),
                media_type="text/event-stream",
                background=BackgroundTask(_unload),
            )
        try:
            finished = await _until_done(request, lives, wake)
        finally:
            replica.server_load -= 1
            if not all(live.done for live in lives):
                for live in lives:
                    replica.loop.abort(live)
        if not finished:
            return Response(status_code=499)
        created = p.now_s()
        if kind == "completion":
            texts = [replica.text(live) for live in lives]
            return JSONResponse(p.completion_body(spec, rid, created, texts, lives))
        return JSONResponse(p.chat_body(spec, rid, created, replica.text(lives[0]), lives[0]))

    async def _unload() -> None:
        replica.server_load -= 1

    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    async def chat(request: Request) -> Response:
        return await generate(request, "chat")

    async def models(request: Request) -> Response:
        card = p.model_card(config.model_name, config.root, replica.max_model_len, replica.created)
        return JSONResponse({"object": "list", "data": [card]})

    async def tokenize(request: Request) -> Response:
        body = await _json_body(request)
        p.check_model(body, config.model_name)
        tok = replica.tokenizer
        if "messages" in body:
            ids = p.chat_prompt(body, tok, default_gen=True)
        elif isinstance(body.get("prompt"), str):
            add = body.get("add_special_tokens", True)
            ids = tok.encode(body["prompt"], add_special_tokens=bool(add))
        else:
            raise p.ApiError(400, "either prompt (a string) or messages is required")
        strs = None
        if body.get("return_token_strs"):
            strs = [tok.decode([t], skip_special_tokens=False) for t in ids]
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": replica.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(request: Request) -> Response:
        body = await _json_body(request)
        p.check_model(body, config.model_name)
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise p.ApiError(400, "tokens must be a list of token ids", param="tokens")
        ids = p.completion_prompts(tokens, replica.tokenizer, add_special_tokens=False)[0]
        return JSONResponse({"prompt": replica.tokenizer.decode(ids, skip_special_tokens=False)})

    async def health(request: Request) -> Response:
        return Response(status_code=200 if replica.healthy else 503)

    async def ping(request: Request) -> Response:
        return Response(status_code=200 if replica.healthy else 503)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": VLLM_REFERENCE_VERSION})

    async def load(request: Request) -> Response:
        return JSONResponse({"server_load": replica.server_load})

    async def metrics(request: Request) -> Response:
        return Response(
            replica.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    async def kv_event_sources(request: Request) -> Response:
        pub = replica.publisher
        return JSONResponse(pub.sources() if pub is not None else {})

    async def reset_prefix_cache(request: Request) -> Response:
        # vLLM serves this only in dev mode (VLLM_SERVER_DEV_MODE=1); so does the simulator
        if os.environ.get("VLLM_SERVER_DEV_MODE") != "1":
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return JSONResponse({"success": replica.loop.reset_prefix_cache()})

    async def faults_route(request: Request) -> Response:
        token = config.admin_token
        if not token:
            raise p.ApiError(404, "Not Found")
        auth = request.headers.get("authorization", "")
        if auth != f"Bearer {token}":
            raise p.ApiError(401, "Unauthorized")
        faults = replica.faults
        task: BackgroundTask | None = None
        if request.method == "POST":
            body = await _json_body(request)
            try:
                faults.update(body)
            except ConfigError as exc:
                raise p.ApiError(400, str(exc)) from exc
            seconds, faults.refuse_s = faults.refuse_s, 0.0
            if seconds > 0:
                if replica.refuse is None:
                    raise p.ApiError(501, "refusing connections needs the uvicorn server")
                task = BackgroundTask(replica.refuse, seconds)
        return JSONResponse({"faults": faults.to_json()}, background=task)

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, p.ApiError)
        return JSONResponse(exc.body(), status_code=exc.status)

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error", exc_info=exc)
        return error_response(500, f"{type(exc).__name__}: {exc}")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await replica.startup()
        try:
            yield
        finally:
            await replica.shutdown()

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/ping", ping, methods=["GET", "POST"]),
        Route("/version", version, methods=["GET"]),
        Route("/load", load, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/kv_event_sources", kv_event_sources, methods=["GET"]),
        Route("/_faults", faults_route, methods=["GET", "POST"]),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={p.ApiError: api_error, Exception: internal_error},
        lifespan=lifespan,
    )
    app.add_middleware(RequestIdMiddleware)
    return app


async def _until_done(request: Request, lives: list[LiveRequest], wake: asyncio.Event) -> bool:
    """Wait for every request to finish; False if the client disconnected first."""
    gone = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        while not all(live.done for live in lives):
            woke = asyncio.ensure_future(wake.wait())
            done, _ = await asyncio.wait({woke, gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone in done:
                woke.cancel()
                return False
            wake.clear()
        return True
    finally:
        gone.cancel()


__all__ = ["Replica", "RequestIdMiddleware", "build_app"]
