"""The bad-input corpus of the router: requests it must refuse itself, each with its 4xx.

Every `BadInput` is one raw HTTP request (method, path, content type, body bytes sent as they
are) and the status the router must answer with an OpenAI error body, never forwarding it to a
replica. `ODD_BUT_VALID` are requests that look strange but are valid, which the router forwards
(and which therefore prove that the "nothing reached a replica" counters do count).

The router under test runs with `LIMITS`; the cases over a limit are built from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MODEL = "tiny-llama"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
JSON = "application/json"

LIMITS: dict[str, Any] = {
    "max_body_bytes": 64 * 1024,
    "max_prompt_tokens": 200,
    "max_tokens": 64,
    "body_timeout_s": 1.0,
}
VOCAB_SIZE = 512  # the tiny model's tokenizer (deploy/tiny_model.py)
BLOCK = 32  # more token ids than one KV block, so that the prompt gets hashed

DROP = object()  # a field value meaning "leave the field out"


@dataclass(frozen=True)
class BadInput:
    id: str
    status: int
    body: bytes | None
    path: str = CHAT
    method: str = "POST"
    content_type: str | None = JSON
    param: str | None = None  # the `error.param` the router must name, when it names one


def _body(base: dict[str, Any], fields: dict[str, Any]) -> bytes:
    data = {**base, **fields}
    return json.dumps({k: v for k, v in data.items() if v is not DROP}).encode()


def chat(**fields: Any) -> bytes:
    """A valid chat body with `fields` replaced (DROP removes one)."""
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    return _body(base, fields)


def completion(**fields: Any) -> bytes:
    """A valid completion body with `fields` replaced (DROP removes one)."""
    return _body({"model": MODEL, "prompt": "hello", "max_tokens": 4}, fields)


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _chat_raw(messages_json: bytes, extra: bytes = b"") -> bytes:
    return (
        b'{"model":"'
        + MODEL.encode()
        + b'","max_tokens":4,"messages":'
        + messages_json
        + extra
        + b"}"
    )


_USER_HI = b'[{"role":"user","content":"hi"}]'

BAD_INPUTS: list[BadInput] = [
    # -- the body is no JSON object ----------------------------------------------------------------
    BadInput("invalid-json", 400, b"{bad"),
    BadInput("truncated-json", 400, chat()[:-7]),
    BadInput("trailing-garbage", 400, chat() + b" trailing"),
    BadInput("empty-body", 400, b""),
    BadInput("body-is-array", 400, b"[1, 2, 3]"),
    BadInput("body-is-string", 400, b'"hello"'),
    BadInput("body-is-number", 400, b"42"),
    BadInput("body-is-null", 400, b"null"),
    BadInput("invalid-utf8", 400, _chat_raw(b'[{"role":"user","content":"\xff\xfe"}]')),
    BadInput("deep-nesting-10000", 400, _chat_raw(_nested(10_000))),
    BadInput("deep-array-20000", 400, _nested(20_000), path=COMPLETIONS),
    # parses, but nests deeper than the router serializes to forward it
    BadInput("deep-extra-600", 400, _chat_raw(_USER_HI, b',"extra":' + _nested(600))),
    BadInput("nan-literal", 400, completion()[:-1] + b',"temperature":NaN}', path=COMPLETIONS),
    BadInput("infinity-literal", 400, completion()[:-1] + b',"top_p":-Infinity}', COMPLETIONS),
    BadInput("number-overflows-to-inf", 400, completion()[:-1] + b',"top_p":1e400}', COMPLETIONS),
    # -- content types -----------------------------------------------------------------------------
    BadInput("content-type-text", 415, chat(), content_type="text/plain"),
    BadInput("content-type-form", 415, chat(), content_type="application/x-www-form-urlencoded"),
    BadInput("content-type-xml", 415, chat(), content_type="application/xml"),
    BadInput("content-type-missing", 415, chat(), content_type=None),
    # -- model -------------------------------------------------------------------------------------
    BadInput("model-missing", 400, chat(model=DROP), param="model"),
    BadInput("model-empty", 400, chat(model=""), param="model"),
    BadInput("model-number", 400, chat(model=5), param="model"),
    BadInput("model-null", 400, chat(model=None), param="model"),
    BadInput("model-list", 400, chat(model=[MODEL]), param="model"),
    BadInput("model-too-long", 400, chat(model="m" * 600), param="model"),
    BadInput("model-unknown", 404, chat(model="gpt-4o")),
    BadInput("model-unknown-completions", 404, completion(model="other"), COMPLETIONS),
    BadInput("model-with-nul", 404, chat(model=MODEL + "\u0000")),
    BadInput("model-case", 404, chat(model=MODEL.upper())),
    # -- messages ----------------------------------------------------------------------------------
    BadInput("messages-missing", 400, chat(messages=DROP), param="messages"),
    BadInput("messages-empty", 400, chat(messages=[]), param="messages"),
    BadInput("messages-string", 400, chat(messages="hello"), param="messages"),
    BadInput("messages-object", 400, chat(messages={"role": "user"}), param="messages"),
    BadInput("messages-null", 400, chat(messages=None), param="messages"),
    BadInput("message-string", 400, chat(messages=["hello"]), param="messages.0"),
    BadInput("message-null", 400, chat(messages=[None]), param="messages.0"),
    BadInput("message-no-role", 400, chat(messages=[{"content": "a"}]), param="messages.0.role"),
    BadInput(
        "role-empty", 400, chat(messages=[{"role": "", "content": "a"}]), param="messages.0.role"
    ),
    BadInput(
        "role-number", 400, chat(messages=[{"role": 1, "content": "a"}]), param="messages.0.role"
    ),
    BadInput(
        "role-null", 400, chat(messages=[{"role": None, "content": "a"}]), param="messages.0.role"
    ),
    BadInput("role-too-long", 400, chat(messages=[{"role": "r" * 100}]), param="messages.0.role"),
    BadInput("content-number", 400, chat(messages=[{"role": "user", "content": 5}])),
    BadInput("content-object", 400, chat(messages=[{"role": "user", "content": {"text": "a"}}])),
    BadInput("content-part-number", 400, chat(messages=[{"role": "user", "content": [1]}])),
    BadInput(
        "content-part-image",
        400,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
    ),
    BadInput("message-name-number", 400, chat(messages=[{"role": "user", "name": 5}])),
    BadInput("messages-too-many", 400, chat(messages=[{"role": "u"}] * 4097), param="messages"),
    BadInput("template-kwargs-string", 400, chat(chat_template_kwargs="x")),
    BadInput("template-kwargs-messages", 400, chat(chat_template_kwargs={"messages": []})),
    BadInput("template-kwargs-tools-number", 400, chat(chat_template_kwargs={"tools": 5})),
    BadInput("template-kwargs-documents-number", 400, chat(chat_template_kwargs={"documents": 5})),
    BadInput("tools-object", 400, chat(tools={"type": "function"}), param="tools"),
    BadInput("tools-of-strings", 400, chat(tools=["f"]), param="tools.0"),
    BadInput(
        "generation-and-continue",
        400,
        chat(add_generation_prompt=True, continue_final_message=True),
    ),
    BadInput("add-generation-prompt-string", 400, chat(add_generation_prompt="yes")),
    # -- prompt (completions) ----------------------------------------------------------------------
    BadInput("prompt-missing", 400, completion(prompt=DROP), COMPLETIONS, param="prompt"),
    BadInput("prompt-null", 400, completion(prompt=None), COMPLETIONS, param="prompt"),
    BadInput("prompt-number", 400, completion(prompt=5), COMPLETIONS, param="prompt"),
    BadInput("prompt-object", 400, completion(prompt={"text": "a"}), COMPLETIONS, param="prompt"),
    BadInput("prompt-nested-3", 400, completion(prompt=[[["a"]]]), COMPLETIONS, param="prompt"),
    BadInput("prompt-mixed", 400, completion(prompt=[1, "a"]), COMPLETIONS, param="prompt"),
    BadInput("prompt-floats", 400, completion(prompt=[1.5, 2.0]), COMPLETIONS, param="prompt"),
    BadInput("prompt-booleans", 400, completion(prompt=[True, False]), COMPLETIONS, param="prompt"),
    BadInput("prompt-list-of-objects", 400, completion(prompt=[{}]), COMPLETIONS, param="prompt"),
    BadInput("token-negative", 400, completion(prompt=[1, -1]), COMPLETIONS, param="prompt"),
    BadInput("token-2^32", 400, completion(prompt=[2**32] * BLOCK), COMPLETIONS, param="prompt"),
    BadInput(
        "token-2^64", 400, completion(prompt=[2**64 + 1] * BLOCK), COMPLETIONS, param="prompt"
    ),
    BadInput("token-huge", 400, completion(prompt=[10**30] * BLOCK), COMPLETIONS, param="prompt"),
    BadInput("token-in-batch-huge", 400, completion(prompt=[[1], [2**63] * BLOCK]), COMPLETIONS),
    BadInput("token-out-of-vocab", 400, completion(prompt=[VOCAB_SIZE] * BLOCK), COMPLETIONS),
    BadInput("token-out-of-vocab-short", 400, completion(prompt=[1, VOCAB_SIZE + 7]), COMPLETIONS),
    BadInput("tokens-empty", 400, completion(prompt=[]), COMPLETIONS, param="prompt"),
    BadInput("tokens-batch-empty", 400, completion(prompt=[[1, 2], []]), COMPLETIONS),
    BadInput(
        "prompt-too-long-text",
        400,
        completion(prompt="hello world " * LIMITS["max_prompt_tokens"]),
        COMPLETIONS,
    ),
    BadInput(
        "prompt-too-long-ids",
        400,
        completion(prompt=[1] * (LIMITS["max_prompt_tokens"] + 1)),
        COMPLETIONS,
    ),
    BadInput(
        "chat-too-long",
        400,
        chat(messages=[{"role": "user", "content": "hello world " * LIMITS["max_prompt_tokens"]}]),
    ),
    BadInput("echo-string", 400, completion(echo="yes"), COMPLETIONS, param="echo"),
    # -- max_tokens, n, stream, stream_options, user -----------------------------------------------
    BadInput("max-tokens-zero", 400, chat(max_tokens=0), param="max_tokens"),
    BadInput("max-tokens-negative", 400, chat(max_tokens=-5), param="max_tokens"),
    BadInput("max-tokens-string", 400, chat(max_tokens="5"), param="max_tokens"),
    BadInput("max-tokens-float", 400, chat(max_tokens=5.5), param="max_tokens"),
    BadInput("max-tokens-integral-float", 400, chat(max_tokens=5.0), param="max_tokens"),
    BadInput("max-tokens-bool", 400, chat(max_tokens=True), param="max_tokens"),
    BadInput("max-tokens-over-limit", 400, chat(max_tokens=LIMITS["max_tokens"] + 1)),
    BadInput("max-tokens-2^70", 400, completion(max_tokens=2**70), COMPLETIONS),
    BadInput("max-completion-tokens-over-limit", 400, chat(max_completion_tokens=10**6)),
    BadInput("max-completion-tokens-zero", 400, chat(max_completion_tokens=0)),
    BadInput("n-zero", 400, chat(n=0), param="n"),
    BadInput("n-negative", 400, chat(n=-1), param="n"),
    BadInput("n-too-large", 400, chat(n=17), param="n"),
    BadInput("n-string", 400, chat(n="2"), param="n"),
    BadInput("n-float", 400, completion(n=1.5), COMPLETIONS, param="n"),
    BadInput("stream-string", 400, chat(stream="true"), param="stream"),
    BadInput("stream-number", 400, chat(stream=1), param="stream"),
    BadInput("stream-options-string", 400, chat(stream=True, stream_options="yes")),
    BadInput("stream-options-list", 400, chat(stream=True, stream_options=[True])),
    BadInput(
        "stream-options-usage-string",
        400,
        chat(stream=True, stream_options={"include_usage": "yes"}),
        param="stream_options.include_usage",
    ),
    BadInput(
        "stream-options-without-stream",
        400,
        chat(stream_options={"include_usage": True}),
        param="stream_options",
    ),
    BadInput("user-huge", 400, chat(user="u" * 10_000), param="user"),
    BadInput("user-number", 400, chat(user=42), param="user"),
    # -- unicode -----------------------------------------------------------------------------------
    BadInput("surrogate-in-content", 400, _chat_raw(b'[{"role":"user","content":"a\\ud800b"}]')),
    BadInput("surrogate-low-in-content", 400, _chat_raw(b'[{"role":"user","content":"\\udc00"}]')),
    BadInput(
        "surrogate-in-content-part",
        400,
        _chat_raw(b'[{"role":"user","content":[{"type":"text","text":"\\udfff"}]}]'),
    ),
    BadInput("surrogate-in-role", 400, _chat_raw(b'[{"role":"\\ud800","content":"a"}]')),
    BadInput("surrogate-in-prompt", 400, b'{"model":"tiny-llama","prompt":"\\ud800"}', COMPLETIONS),
    BadInput(
        "surrogate-in-prompt-batch",
        400,
        b'{"model":"tiny-llama","prompt":["ok","x\\udbff"]}',
        COMPLETIONS,
    ),
    BadInput("surrogate-in-extra", 400, _chat_raw(_USER_HI, b',"stop":"\\ud800"')),
    BadInput("surrogate-in-key", 400, _chat_raw(_USER_HI, b',"\\ud800":1')),
    BadInput("surrogate-in-model", 400, b'{"model":"\\ud800","messages":' + _USER_HI + b"}"),
    BadInput("surrogate-in-user", 400, _chat_raw(_USER_HI, b',"user":"\\udc00"')),
    # -- methods and paths -------------------------------------------------------------------------
    BadInput("get-chat", 405, None, method="GET", content_type=None),
    BadInput("put-chat", 405, chat(), method="PUT"),
    BadInput("delete-completions", 405, None, COMPLETIONS, method="DELETE", content_type=None),
    BadInput("patch-completions", 405, completion(), COMPLETIONS, method="PATCH"),
    BadInput("post-models", 405, chat(), "/v1/models"),
    BadInput("unknown-path", 404, chat(), "/v1/chat/completion"),
    BadInput("unknown-endpoint", 404, chat(), "/v1/embeddings"),
    BadInput("unknown-root", 404, None, "/nothing/here", method="GET", content_type=None),
]


@dataclass(frozen=True)
class OddButValid:
    id: str
    body: bytes
    path: str = CHAT


ODD_BUT_VALID: list[OddButValid] = [
    OddButValid("nul-in-content", chat(messages=[{"role": "user", "content": "a\u0000b"}])),
    OddButValid("paired-surrogates", _chat_raw(b'[{"role":"user","content":"\\ud83d\\ude00"}]')),
    OddButValid("noncharacter", chat(messages=[{"role": "user", "content": "\uffff\ufffe"}])),
    # vLLM takes any role string; the tiny model's template renders it
    OddButValid("stream-null", completion(stream=None), COMPLETIONS),
    OddButValid("unknown-role", chat(messages=[{"role": "narrator", "content": "once"}])),
    OddButValid("empty-text-prompt", completion(prompt=""), COMPLETIONS),
    OddButValid("last-token-id", completion(prompt=[VOCAB_SIZE - 1] * BLOCK), COMPLETIONS),
    OddButValid("deep-extra-100", _chat_raw(_USER_HI, b',"extra":' + _nested(100))),
]
