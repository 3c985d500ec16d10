"""Ray's `PrefixCacheAffinityRouter` behind our adapter: it sees the text Ray would see.

The adapter (deploy/engines/ray_prefix_router.py) only moves where the prompt comes from: the
OpenAI body of our `handle(method, path, headers, body)` calls instead of a request object with
`.messages` / `.prompt`. For every body of the table, the adapter's text equals what Ray's own
`_extract_text_from_request` returns for the same request sent as an object (Ray Serve LLM's
way); calls without a prompt give None (Ray's router then keeps its power-of-two choice) and
are not inserted into the prefix tree.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

CHAT_PARTS = [{"role": "user", "content": [{"type": "text", "text": "part one "}, {"text": "two"}]}]
WITH_PROMPT: list[tuple[str, dict[str, Any]]] = [
    (
        "chat",
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hello there"},
            ]
        },
    ),
    ("chat content parts", {"messages": CHAT_PARTS}),
    ("completion text", {"prompt": "once upon a time"}),
    ("completion list", {"prompt": ["a b ", "c d"]}),
    ("both: messages win", {"messages": [{"role": "user", "content": "m"}], "prompt": "p"}),
]
WITHOUT: list[tuple[str, list[Any]]] = [
    ("not json", ["POST", "/v1/completions", [], b"{nope"]),
    ("json array", ["POST", "/v1/completions", [], b"[1, 2]"]),
    ("no prompt", ["POST", "/v1/completions", [], b'{"model": "m"}']),
    ("empty prompt", ["POST", "/v1/completions", [], b'{"prompt": ""}']),
    ("GET without body", ["GET", "/v1/models", []]),
    ("body not bytes", ["POST", "/v1/completions", [], "text"]),
]


def pending(args: list[Any]) -> Any:
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    return PendingRequest(args=args, kwargs={}, metadata=RequestMetadata("r", "r"))


@pytest.fixture
async def router() -> Any:
    """Built inside a running event loop, as Serve builds its routers."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from deploy.engines.ray_prefix_router import RayPrefixCacheAffinityRouter

    dep = DeploymentID(name="engine", app_name="app")
    return RayPrefixCacheAffinityRouter(
        deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN
    )


@pytest.mark.parametrize(("name", "doc"), WITH_PROMPT, ids=[n for n, _ in WITH_PROMPT])
async def test_text_is_what_ray_reads_from_the_same_request_object(
    router: Any, name: str, doc: dict[str, Any]
) -> None:
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter,
    )

    ours = pending(["POST", "/v1/chat/completions", [], json.dumps(doc).encode()])
    as_ray_gets_it = pending([SimpleNamespace(**doc)])
    expected = PrefixCacheAffinityRouter._extract_text_from_request(router, as_ray_gets_it)
    assert expected
    assert router._extract_text_from_request(ours) == expected


@pytest.mark.parametrize(("name", "args"), WITHOUT, ids=[n for n, _ in WITHOUT])
async def test_calls_without_a_prompt_have_no_text_and_are_not_inserted(
    router: Any, name: str, args: list[Any]
) -> None:
    from ray.serve._private.common import DeploymentID, ReplicaID

    request = pending(args)
    assert router._extract_text_from_request(request) is None
    # no prefix tree actor exists here: a call with a text would need it
    router.on_request_routed(request, ReplicaID("a", DeploymentID(name="engine")), None)
