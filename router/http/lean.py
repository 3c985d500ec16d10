"""The hot endpoints' request: the body parsed once, only the fields routing reads checked.

    parse(body, endpoint) -> OpenAIRequest | None      None: not plainly valid; the full pydantic
                                                        validation (`openai_api.py`) decides, and
                                                        words the refusal
    from_model(model, body, endpoint) -> OpenAIRequest  what the full validation accepted

Algorithm ("fast accept, slow reject"): the body is decoded once with msgspec (strict JSON: it
refuses invalid UTF-8, lone surrogates, NaN/Infinity and numbers that overflow to infinity, as
the full validation does, and keeps big integers exact). The fields the router reads are then
checked against exactly the constraints of `ChatCompletionRequest` / `CompletionRequest`
(strict types, bounds, prompt shapes, stream_options only with stream); every other field is
left as it is. A body that passes every check is one the full validation accepts with the same
values, so it is served at once; anything else (a missing or mistyped field, nesting deeper than
`MAX_FAST_DEPTH`, JSON msgspec refuses) goes to the full validation, which either accepts it after
all or refuses it with the same status, message and param as before. So the fast path changes
no answer, only what an accepted request costs.

The body stays bytes: it goes to the replica as it came, with the router's few rewrites spliced in
(`router/http/splice.py`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from router.http.openai_api import ChatCompletionRequest, CompletionRequest

Endpoint = Literal["chat", "completions"]
# nesting the fast path takes; the full validation refuses past what pydantic serializes (255)
MAX_FAST_DEPTH = 64
# a body with this many brackets or more has its depth measured; deeper than this many levels
# (or than MAX_FAST_DEPTH) it goes to the full validation
_PEELS = 16
_TOKEN_LIMIT = 2**32
_decoder = msgspec.json.Decoder()
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_INNERMOST = re.compile(rb"\[\]|\{\}")


@dataclass(slots=True)
class OpenAIRequest:
    """What the router reads of one chat or completion request, and the body as received."""

    endpoint: Endpoint
    body: bytes
    data: dict[str, Any]
    model: str
    output_cap: int | None
    stream: bool
    include_usage: bool  # the client asked for the usage chunk
    user: str | None
    sequences_per_prompt: int  # max(n, best_of)
    client_salt: Any
    # chat
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    # completions: the prompt or the batch's prompts
    prompts: list[str | list[int]] | None = None


def _depth_ok(body: bytes) -> bool:
    """The body nests at most MAX_FAST_DEPTH levels (False: unknown or deeper)."""
    if body.count(b"[") + body.count(b"{") <= MAX_FAST_DEPTH:
        return True
    brackets = _STRINGS.sub(b"", body).translate(None, _NOT_BRACKETS)
    for _ in range(min(_PEELS, MAX_FAST_DEPTH)):
        if not brackets:
            return True
        brackets = _INNERMOST.sub(b"", brackets)
    return not brackets


def _opt_int(v: Any) -> bool:
    """None, or an int >= 1 (strict: no bool, no float)."""
    return v is None or (type(v) is int and v >= 1)


def _opt_bool(v: Any) -> bool:
    return v is None or type(v) is bool


def _token_ids(v: Any) -> bool:
    return type(v) is list and bool(v) and all(type(t) is int and 0 <= t < _TOKEN_LIMIT for t in v)


def _prompts(p: Any) -> list[str | list[int]] | None:
    """The prompts of a plainly valid `prompt` (None: let the full validation decide)."""
    if type(p) is str:
        return [p]
    if type(p) is not list or not p:
        return None
    first = p[0]
    if type(first) is int:
        return [p] if _token_ids(p) else None
    if type(first) is str:
        return list(p) if all(type(x) is str for x in p) else None
    if type(first) is list:
        return list(p) if all(_token_ids(x) for x in p) else None
    return None


def _messages(msgs: Any) -> list[dict[str, Any]] | None:
    if type(msgs) is not list or not 1 <= len(msgs) <= 4096:
        return None
    out = []
    for m in msgs:
        if type(m) is not dict:
            return None
        role = m.get("role")
        if type(role) is not str or not 1 <= len(role) <= 64:
            return None
        content = m.get("content")
        if not (
            content is None
            or type(content) is str
            or (type(content) is list and all(type(part) is dict for part in content))
        ):
            return None
        name = m.get("name")
        if name is not None and type(name) is not str:
            return None
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def parse(body: bytes, endpoint: Endpoint) -> OpenAIRequest | None:
    """The request, when the body is plainly valid (see the module docstring); else None."""
    try:
        data = _decoder.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    if type(data) is not dict or not _depth_ok(body):
        return None
    get = data.get
    model = get("model")
    max_tokens = get("max_tokens")
    stream = get("stream", False)
    opts = get("stream_options")
    user = get("user")
    n = get("n", 1)
    if not (
        type(model) is str
        and 1 <= len(model) <= 512
        and _opt_int(max_tokens)
        and _opt_bool(stream)
        and (user is None or (type(user) is str and len(user) <= 512))
        and type(n) is int
        and 1 <= n <= 16
    ):
        return None
    if opts is not None and not (
        type(opts) is dict
        and stream is True
        and _opt_bool(opts.get("include_usage"))
        and _opt_bool(opts.get("continuous_usage_stats"))
    ):
        return None
    best_of = get("best_of")
    req = OpenAIRequest(
        endpoint=endpoint,
        body=body,
        data=data,
        model=model,
        output_cap=max_tokens,
        stream=bool(stream),
        include_usage=bool(opts and opts.get("include_usage")),
        user=user,
        sequences_per_prompt=max(n, best_of if isinstance(best_of, int) else 1),
        client_salt=get("cache_salt"),
    )
    if endpoint == "chat":
        messages = _messages(get("messages"))
        mct = get("max_completion_tokens")
        agp = get("add_generation_prompt", True)
        cfm = get("continue_final_message", False)
        ctk = get("chat_template_kwargs")
        tools = get("tools")
        if not (
            messages is not None
            and _opt_int(mct)
            and type(agp) is bool
            and type(cfm) is bool
            and (ctk is None or type(ctk) is dict)
            and (tools is None or (type(tools) is list and all(type(t) is dict for t in tools)))
        ):
            return None
        req.messages = messages
        req.output_cap = mct or max_tokens
        req.add_generation_prompt = agp
        req.continue_final_message = cfm
        req.chat_template_kwargs = ctk
        req.tools = tools
        return req
    prompts = _prompts(get("prompt"))
    if prompts is None or type(get("echo", False)) is not bool:
        return None
    req.prompts = prompts
    return req


def from_model(
    model: ChatCompletionRequest | CompletionRequest, body: bytes, data: dict[str, Any]
) -> OpenAIRequest:
    """The request the full validation accepted (`data`: the body decoded)."""
    extra = model.model_extra or {}
    best_of = extra.get("best_of")
    opts = model.stream_options
    req = OpenAIRequest(
        endpoint="chat" if isinstance(model, ChatCompletionRequest) else "completions",
        body=body,
        data=data,
        model=model.model,
        output_cap=model.output_cap,
        stream=bool(model.stream),
        include_usage=bool(opts and opts.include_usage),
        user=model.user,
        sequences_per_prompt=max(model.n, best_of if isinstance(best_of, int) else 1),
        client_salt=extra.get("cache_salt"),
    )
    if isinstance(model, ChatCompletionRequest):
        req.messages = [m.model_dump(exclude_none=True) for m in model.messages]
        req.add_generation_prompt = model.add_generation_prompt
        req.continue_final_message = model.continue_final_message
        req.chat_template_kwargs = model.chat_template_kwargs
        req.tools = model.tools
    else:
        req.prompts = model.prompts()
    return req


__all__ = ["MAX_FAST_DEPTH", "Endpoint", "OpenAIRequest", "from_model", "parse"]
