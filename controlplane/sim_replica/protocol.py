"""vLLM's OpenAI-compatible request and response shapes, as the simulated replica speaks them.

Parsing turns a `/v1/completions` or `/v1/chat/completions` body into a `GenerationSpec` (token
ids per prompt, output length, streaming options); builders make the JSON bodies and SSE chunks
vLLM 0.33 sends (reference §4). Errors are vLLM's `ErrorInfo`:
`{"error": {"message", "type", "param", "code": <int status>}}`.

**Output length.** The replica samples nothing: every request emits exactly `max_tokens` tokens
(as with `ignore_eos=True`), finish reason `length`. Defaults as vLLM's: 16 for completions;
for chat, `max_completion_tokens`, else `max_tokens`, else the server's `--default-max-tokens`,
else what is left of the context (`max_model_len - prompt`). A simulated stop: `vllm_xargs:
{"sim_output_tokens": n}` ends the request after `min(n, max_tokens)` tokens, with finish reason
`stop` when that is fewer than `max_tokens` (an EOS). `min_tokens` is only validated.

**Generated tokens** are drawn uniformly from the tokenizer's printable ids by a generator
seeded with SHA-256 of (the request's `seed`, default 0; the prompt's token ids): the same
prompt and seed always yield the same completion, as greedy decoding would.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from controlplane.sim_replica.engine_loop import LiveRequest
from controlplane.sim_replica.tokenizer import ReplicaTokenizer
from controlplane.tokenization import TokenizationError

Kind = Literal["completion", "chat"]
COMPLETION_DEFAULT_MAX_TOKENS = 16

ERROR_TYPES = {
    400: "BadRequestError",
    401: "UnauthorizedError",
    404: "NotFoundError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


class ApiError(Exception):
    """An error answered in vLLM's ErrorInfo shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


@dataclass(slots=True)
class GenerationSpec:
    """A parsed generation request."""

    kind: Kind
    model: str
    # token ids of each prompt (several only for a completions batch)
    prompts: list[list[int]]
    # per prompt
    max_tokens: list[int]
    output_tokens: list[int]
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    return_token_ids: bool = False
    seed: int = 0
    priority: int = 0
    request_id: str | None = None
    # vLLM's cache_salt: hashed into block 0, so only requests with the same salt share blocks
    cache_salt: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# -- parsing -------------------------------------------------------------------------------------


def _int_field(body: Mapping[str, Any], name: str, *, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer, got {value!r}", param=name)
    if minimum is not None and value < minimum:
        raise ApiError(400, f"{name} must be at least {minimum}, got {value}", param=name)
    return value


def _bool_field(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be a boolean, got {value!r}", param=name)
    return value


def _token_list(value: Sequence[Any], vocab_size: int) -> list[int]:
    ids: list[int] = []
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int):
            raise ApiError(400, f"token ids must be integers, got {t!r}", param="prompt")
        if not 0 <= t < vocab_size:
            raise ApiError(400, f"Token id {t} is out of vocabulary", param="prompt")
        ids.append(t)
    return ids


def completion_prompts(
    prompt: Any, tok: ReplicaTokenizer, *, add_special_tokens: bool
) -> list[list[int]]:
    """`prompt` as vLLM accepts it: str, list[str], list[int] or list[list[int]]."""
    if isinstance(prompt, str):
        return [tok.encode(prompt, add_special_tokens=add_special_tokens)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [tok.encode(p, add_special_tokens=add_special_tokens) for p in prompt]
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [_token_list(prompt, tok.vocab_size)]
        if all(isinstance(p, list) for p in prompt):
            return [_token_list(p, tok.vocab_size) for p in prompt]
    raise ApiError(
        400, "prompt must be a string, a list of strings or a list of token ids", param="prompt"
    )


def chat_prompt(body: Mapping[str, Any], tok: ReplicaTokenizer, *, default_gen: bool) -> list[int]:
    """The token ids of a chat (`messages`) body, rendered with the tokenizer's template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ApiError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
    template = body.get("chat_template")
    try:
        text = tok.render_chat(
            messages,
            add_generation_prompt=_bool_field(body, "add_generation_prompt", default_gen),
            continue_final_message=_bool_field(body, "continue_final_message", False),
            chat_template=template if isinstance(template, str) else None,
            chat_template_kwargs=kwargs,
            tools=body.get("tools") or None,
        )
    except TokenizationError as exc:
        raise ApiError(400, str(exc)) from exc
    return tok.encode(text, add_special_tokens=_bool_field(body, "add_special_tokens", False))


def parse_generation(
    kind: Kind,
    body: Mapping[str, Any],
    tok: ReplicaTokenizer,
    *,
    served_model: str,
    max_model_len: int,
    default_max_tokens: int = 0,
    priority_enabled: bool = False,
) -> GenerationSpec:
    """Validate a generation body as vLLM does (400 on what it refuses)."""
    model = check_model(body, served_model)
    if (_int_field(body, "n", minimum=1) or 1) > 1:
        raise ApiError(400, "the simulated replica does not support n > 1", param="n")
    if kind == "completion":
        if body.get("echo"):
            raise ApiError(400, "the simulated replica does not support echo", param="echo")
        if "prompt" not in body:
            raise ApiError(400, "prompt is required", param="prompt")
        prompts = completion_prompts(
            body["prompt"], tok, add_special_tokens=_bool_field(body, "add_special_tokens", True)
        )
        asked = _int_field(body, "max_tokens", minimum=1)
    else:
        prompts = [chat_prompt(body, tok, default_gen=True)]
        asked = _int_field(body, "max_completion_tokens", minimum=1)
        if asked is None:
            asked = _int_field(body, "max_tokens", minimum=1)
    min_tokens = _int_field(body, "min_tokens", minimum=0) or 0
    xargs = body.get("vllm_xargs") or {}
    if not isinstance(xargs, dict):
        raise ApiError(400, "vllm_xargs must be an object", param="vllm_xargs")
    sim_out = _int_field(xargs, "sim_output_tokens", minimum=1)
    max_tokens: list[int] = []
    output: list[int] = []
    for ids in prompts:
        if not ids:
            raise ApiError(400, "The prompt cannot be empty", param="prompt")
        n = len(ids)
        if n >= max_model_len:
            raise ApiError(
                400,
                f"The decoder prompt (length {n}) is longer than the maximum model length of "
                f"{max_model_len}. Make sure that `max_model_len` is no smaller than the number "
                "of text tokens.",
                param="prompt",
            )
        if asked is not None:
            limit = asked
        elif kind == "completion":
            limit = COMPLETION_DEFAULT_MAX_TOKENS
        else:
            limit = min(default_max_tokens or max_model_len, max_model_len - n)
        if n + limit > max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {n + limit} tokens ({n} in the messages, {limit} in the completion). "
                "Please reduce the length of the messages or completion.",
                param="max_tokens",
            )
        if min_tokens > limit:
            raise ApiError(400, "min_tokens must be less than or equal to max_tokens")
        max_tokens.append(limit)
        output.append(min(limit, max(sim_out or limit, min_tokens)))
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    stream = _bool_field(body, "stream", False)
    if options and not stream:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.")
    priority = _int_field(body, "priority") or 0
    if priority and not priority_enabled:
        raise ApiError(
            400,
            "Priority scheduling is not enabled (--scheduling-policy priority)",
            param="priority",
        )
    seed = _int_field(body, "seed")
    rid = body.get("request_id")
    salt = body.get("cache_salt")
    if salt is not None and not (
        isinstance(salt, str) and 0 < len(salt) <= 128 and not set(salt) & set("@/\\\0")
    ):
        raise ApiError(
            400,
            "Parameter 'cache_salt' must be a non-empty string of at most 128 characters "
            "without '@', '/', '\\' or NUL.",
            param="cache_salt",
        )
    return GenerationSpec(
        kind=kind,
        model=model,
        prompts=prompts,
        max_tokens=max_tokens,
        output_tokens=output,
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        continuous_usage=bool(options.get("include_usage"))
        and bool(options.get("continuous_usage_stats")),
        return_token_ids=_bool_field(body, "return_token_ids", False),
        seed=seed or 0,
        priority=priority,
        request_id=rid if isinstance(rid, str) and rid else None,
        cache_salt=salt,
    )


def check_model(body: Mapping[str, Any], served_model: str) -> str:
    model = body.get("model")
    if model is None or model == "":
        return served_model
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model")
    return served_model


def output_ids(prompt: Sequence[int], n: int, seed: int, pool: npt.NDArray[np.int64]) -> list[int]:
    """The `n` tokens a request emits (see the module docstring)."""
    h = hashlib.sha256(seed.to_bytes(16, "big", signed=True))
    h.update(np.asarray(prompt, dtype="<u4").tobytes())
    rng = np.random.Generator(np.random.PCG64(int.from_bytes(h.digest()[:16], "big")))
    return [int(t) for t in pool[rng.integers(0, len(pool), size=n)]]


# -- responses -----------------------------------------------------------------------------------


def sse(obj: Mapping[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


SSE_DONE = sse("[DONE]")


def usage(lives: Sequence[LiveRequest]) -> dict[str, Any]:
    prompt = sum(len(live.prompt_ids) for live in lives)
    completion = sum(live.produced for live in lives)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": sum(live.cached_tokens for live in lives)},
    }


def finish_reason(live: LiveRequest) -> str | None:
    return live.finish_reason if live.completed else None


def completion_body(
    spec: GenerationSpec, rid: str, created: int, texts: Sequence[str], lives: Sequence[LiveRequest]
) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    for i, (text, live) in enumerate(zip(texts, lives, strict=True)):
        choice: dict[str, Any] = {
            "index": i,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason(live),
            "stop_reason": None,
            "prompt_logprobs": None,
        }
        if spec.return_token_ids:
            choice["prompt_token_ids"] = live.prompt_ids
            choice["token_ids"] = live.output_ids[: live.produced]
        choices.append(choice)
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": spec.model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage(lives),
        "kv_transfer_params": None,
    }


def chat_body(
    spec: GenerationSpec, rid: str, created: int, text: str, live: LiveRequest
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "message": {
            "role": "assistant",
            "content": text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": [],
            "reasoning_content": None,
        },
        "logprobs": None,
        "finish_reason": finish_reason(live),
        "stop_reason": None,
    }
    if spec.return_token_ids:
        choice["token_ids"] = live.output_ids[: live.produced]
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": spec.model,
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage([live]),
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }
    if spec.return_token_ids:
        body["prompt_token_ids"] = live.prompt_ids
    return body


def chunk(
    spec: GenerationSpec,
    rid: str,
    created: int,
    choices: list[dict[str, Any]],
    usage_: dict[str, Any] | None = None,
) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "id": rid,
        "object": "text_completion" if spec.kind == "completion" else "chat.completion.chunk",
        "created": created,
        "model": spec.model,
        "choices": choices,
    }
    if usage_ is not None:
        obj["usage"] = usage_
    return obj


def delta_choice(
    spec: GenerationSpec,
    index: int,
    text: str,
    finish: str | None,
    token_ids: list[int] | None = None,
    *,
    role: bool = False,
) -> dict[str, Any]:
    if spec.kind == "completion":
        choice: dict[str, Any] = {
            "index": index,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
        }
    else:
        delta: dict[str, Any] = {"content": text}
        if role:
            delta = {"role": "assistant", **delta}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = None
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def model_card(model: str, root: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": root,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [
            {
                "id": f"modelperm-{hashlib.sha256(model.encode()).hexdigest()[:32]}",
                "object": "model_permission",
                "created": created,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }


def now_s() -> int:
    return int(time.time())
