"""Two real vLLM CPU engines as one Ray Serve deployment, routed by our RequestRouter.

One local Ray cluster (2 CPUs) runs two replicas of `deploy/engines/vllm.py`: each runs
`AsyncLLM` and vLLM's own OpenAI app in process on the project's tiny model, on the layered
`.venv-vllm-ray` interpreter (`runtime_env.py_executable`), and follows its engine's KV events
into a private Redis. The driver's handle routes with `PolicyRequestRouter` (prefix affinity)
over that index. vLLM's own KV events confirm every full block of a prompt under the hashes the
router computes for it (the router's tokenization and chat template agree with vLLM's), and
prompts sharing a prefix land on the replica that holds it, for the policy's reasons
(`miss_least_loaded`, then `prefix_hit`, from the `x-cp-decision` header the replica returns),
and vLLM's own prefix-cache counters (`vllm:prefix_cache_hits`, in the replica's routing stats)
count at least the predicted hit tokens. Responses are vLLM's: SSE with usage, error JSON.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from redis_server import RedisServer, available
from serve_engines import call, chat, check_prefix_affinity, local_serve, replica_stats
from vllm_fleet import MODEL_NAME, vllm_missing_reason

from deploy.vllm_ray_env import read_ray_stamp


def _missing() -> str | None:
    reason = vllm_missing_reason()
    if reason is None and read_ray_stamp() is None:
        reason = "no vLLM+Ray env (.venv-vllm-ray): run `make vllm-ray-env`"
    return reason


_MISSING = _missing()
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.redis,
    pytest.mark.timeout(900),
    pytest.mark.skipif(_MISSING is not None, reason=_MISSING or ""),
]

KEY_PREFIX = "t:vllm-engines"


@dataclass
class Stack:
    handle: Any
    redis: redis.Redis


@pytest.fixture(scope="module")
def stack(model_dir: Path) -> Iterator[Stack]:
    if not available():
        pytest.skip("redis-server is not installed")
    from deploy.engines.deployment import policy_router_config
    from deploy.engines.vllm import DEPLOYMENT, VllmEngineArgs, vllm_engine_app

    env = read_ray_stamp()
    assert env is not None
    with RedisServer() as server:
        args = VllmEngineArgs(model_dir=str(model_dir), redis_url=server.url, key_prefix=KEY_PREFIX)
        router = policy_router_config(
            policy="prefix_affinity",
            model=MODEL_NAME,
            tokenizer=str(model_dir),
            redis_url=server.url,
            key_prefix=KEY_PREFIX,
            # a loaded test machine must not turn a lookup into "unknown" (routed by load)
            lookup_budget_ms=2000.0,
        )
        app = vllm_engine_app(args, python=env.python, num_replicas=2, request_router=router)
        admin = redis.Redis.from_url(server.url, socket_timeout=5)
        try:
            with local_serve(app, DEPLOYMENT) as handle:
                yield Stack(handle, admin)
        finally:
            admin.close()


def test_replicas_are_vllm_and_report_their_load(stack: Stack) -> None:
    stats = replica_stats(stack.handle)
    for s in stats.values():
        assert (s.engine, s.model, s.block_size) == ("vllm", MODEL_NAME, 32)
        assert s.num_gpu_blocks > 0  # vllm:cache_config_info, read from vLLM's /metrics
        assert s.kv_events is not None and s.kv_follower
        assert s.ready_at > s.started_at and s.load_s == s.ready_at - s.started_at
    body = chat(
        MODEL_NAME, "hello", max_tokens=3, stream=True, stream_options={"include_usage": True}
    )
    answer = call(stack.handle, "POST", "/v1/chat/completions", body, "vllm-stream")
    assert answer.status == 200
    assert answer.headers["content-type"].startswith("text/event-stream")
    events = b"".join(answer.chunks).decode().strip().split("\n\n")
    assert events[-1] == "data: [DONE]"
    usage = json.loads(events[-2].removeprefix("data: "))["usage"]
    assert usage["completion_tokens"] == 3
    # vLLM's own error JSON for a model it does not serve
    bad = call(stack.handle, "POST", "/v1/completions",
               json.dumps({"model": "nope", "prompt": "x"}).encode(), "vllm-404")  # fmt: skip
    assert bad.status == 404
    assert json.loads(b"".join(bad.chunks))["error"]["code"] == 404


def test_shared_prefix_lands_on_the_replica_holding_it(stack: Stack, model_dir: Path) -> None:
    predicted = check_prefix_affinity(
        stack.handle,
        stack.redis,
        KEY_PREFIX,
        MODEL_NAME,
        str(model_dir),
        prefixes=2,
        followups=3,
    )
    assert predicted
