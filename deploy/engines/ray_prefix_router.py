"""Ray's own `PrefixCacheAffinityRouter` in front of our engine deployments (a baseline).

Algorithm: Ray's, unchanged (ray/llm/_internal/serve/routing_policies/prefix_aware, in the ray
wheel; it imports without `ray[llm]`). Per request: power of two choices first; then, while the
candidates' queue lengths differ by at most `imbalanced_threshold` (infinite by default), the
replicas whose prompts in a shared character prefix tree (a detached actor) match the longest
prefix of this request's text; below `match_rate_threshold` (10% of the text matched), the
replicas with the fewest characters in the tree. After routing, the request's text is inserted
under the chosen replica.

Ray's router finds the text in an argument that has a `.prompt` or `.messages` attribute (Ray
Serve LLM's request objects). Our engine replicas are called as `handle(method, path, headers,
body)` with the OpenAI request body as bytes, so the only thing this adapter changes is where the
text comes from: `call_text` reads `prompt` (completions) or `messages` (chat) from that body
and normalises them with Ray's own `_normalize_prompt_to_string`, exactly as Ray would for the
same request sent as an object. Calls without such a body (or an empty text, which Ray's match
rate would divide by) give None: Ray's router then keeps its power-of-two choice.

    stats_config(request_router_class=RAY_PREFIX_ROUTER)     # deploy/engines/deployment.py
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)
from ray.serve.request_router import PendingRequest

RAY_PREFIX_ROUTER = "deploy.engines.ray_prefix_router:RayPrefixCacheAffinityRouter"


def call_body(args: Sequence[Any]) -> dict[str, Any] | None:
    """The JSON object body of an engine `handle(method, path, headers, body)` call, if any."""
    if len(args) < 4 or not isinstance(args[3], bytes | bytearray):
        return None
    try:
        doc = json.loads(args[3])
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


class RayPrefixCacheAffinityRouter(PrefixCacheAffinityRouter):
    """Ray's router, reading the prompt from our engine calls' bodies (module docstring)."""

    def call_text(self, args: Sequence[Any]) -> str | None:
        doc = call_body(args)
        if doc is None:
            return None
        for key in ("messages", "prompt"):  # Ray looks for messages first, then prompt
            if key in doc:
                text = self._normalize_prompt_to_string(doc[key])
                return text if isinstance(text, str) and text else None
        return None

    # None (no text) is what Ray's callers test for before matching or inserting
    def _extract_text_from_request(self, pending_request: PendingRequest) -> str | None:  # type: ignore[override]
        return self.call_text(pending_request.args)

    def on_request_routed(self, pending_request: PendingRequest, *rest: Any) -> None:
        if self.call_text(pending_request.args or []) is None:
            return  # nothing to insert (Ray's would raise on a call without a prompt)
        super().on_request_routed(pending_request, *rest)


__all__ = ["RAY_PREFIX_ROUTER", "RayPrefixCacheAffinityRouter", "call_body"]
