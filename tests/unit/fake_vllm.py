"""In-process fake vLLM replicas behind one `httpx.MockTransport`, speaking vLLM's protocol
(`/health`, `/metrics` with `cache_config_info`, `/v1/chat/completions`, `/v1/completions`,
SSE with a final usage chunk), for fast router tests that need no subprocess.

    fakes = FakeVllmFleet(["a", "b"])
    runtime = RouterRuntime(settings, transport=fakes.transport, resolve=fakes.resolve)
    fakes.calls            # every generation request received: (replica, path, headers, body)
    fakes.hold = asyncio.Event()   # generation requests wait for it before answering
    await fakes.held.wait()        # one is waiting (it reached its replica)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

BLOCK = 32


def metrics_text(model: str, block_size: int, blocks: int) -> str:
    return "\n".join(
        [
            "# TYPE vllm:num_requests_running gauge",
            f'vllm:num_requests_running{{engine="0",model_name="{model}"}} 0.0',
            "# TYPE vllm:num_requests_waiting gauge",
            f'vllm:num_requests_waiting{{engine="0",model_name="{model}"}} 0.0',
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="{model}"}} 0.0',
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{block_size}",enable_prefix_caching="True",'
            f'engine="0",num_gpu_blocks="{blocks}"}} 1.0',
            "",
        ]
    )


@dataclass
class Call:
    replica: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class FakeVllmFleet:
    replicas: Sequence[str]
    model: str = "tiny-llama"
    tokens: int = 4
    calls: list[Call] = field(default_factory=list)
    hold: asyncio.Event | None = None
    held: asyncio.Event = field(default_factory=asyncio.Event)

    def url(self, replica: str) -> str:
        return f"http://{replica}.fake:8000"

    def resolve(self, host: str) -> list[str]:
        """The replica guard's resolver (router/fleet/urls.py): the made-up names are private."""
        if host.endswith(".fake"):
            return ["10.0.0.1"]
        raise OSError(f"no fake replica at {host!r}")

    def replica_configs(self) -> list[dict[str, Any]]:
        return [
            {"id": r, "url": self.url(r), "gpu": "cpu", "model": "tiny-llama"}
            for r in self.replicas
        ]

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        replica = request.url.host.split(".")[0]
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/metrics":
            return httpx.Response(200, text=metrics_text(self.model, BLOCK, 1000))
        if path in ("/v1/chat/completions", "/v1/completions"):
            body = json.loads(request.content)
            self.calls.append(Call(replica, path, dict(request.headers), body))
            if self.hold is not None:
                self.held.set()
                await self.hold.wait()
            chat = path.endswith("chat/completions")
            if body.get("stream"):
                return httpx.Response(
                    200,
                    headers={"content-type": "text/event-stream"},
                    content=self._stream(chat, body),
                )
            whole = json.dumps(self._whole(chat, body)).encode()
            return httpx.Response(
                200, headers={"content-type": "application/json"}, content=_once(whole)
            )
        return httpx.Response(404, json={"error": {"message": "not found"}})

    def _usage(self, body: dict[str, Any]) -> dict[str, Any]:
        n = min(self.tokens, int(body.get("max_tokens") or self.tokens))
        return {
            "prompt_tokens": 10,
            "completion_tokens": n,
            "total_tokens": 10 + n,
            "prompt_tokens_details": {"cached_tokens": 0},
        }

    def _whole(self, chat: bool, body: dict[str, Any]) -> dict[str, Any]:
        usage = self._usage(body)
        text = "x" * usage["completion_tokens"]
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}}
            if chat
            else {"index": 0, "text": text}
        )
        choice["finish_reason"] = "length"
        return {
            "id": "fake-1",
            "object": "chat.completion" if chat else "text_completion",
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        }

    async def _stream(self, chat: bool, body: dict[str, Any]) -> AsyncIterator[bytes]:
        usage = self._usage(body)
        for _ in range(usage["completion_tokens"]):
            delta = {"index": 0, "delta": {"content": "x"}} if chat else {"index": 0, "text": "x"}
            yield b"data: " + json.dumps({"id": "fake-1", "choices": [delta]}).encode() + b"\n\n"
        opts = body.get("stream_options") or {}
        if opts.get("include_usage"):
            chunk = {"id": "fake-1", "choices": [], "usage": usage}
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"


async def _once(data: bytes) -> AsyncIterator[bytes]:
    """A body that arrives as a stream, as it does from a socket (a bytes body would count as
    already read, and a streaming reader could not read it)."""
    yield data
