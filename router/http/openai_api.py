"""The OpenAI request shapes the router reads, and OpenAI's error shape for everything it refuses.

The router validates only what it needs to route and to protect the fleet (model, prompt or
messages, max_tokens, stream, stream_options, user/session); every other field (sampling
parameters, vLLM extensions such as `cache_salt`, `priority`, `chat_template_kwargs`) passes
through to the replica untouched, which validates it as it always does. The models are
FastAPI's request bodies, so they are the router's OpenAPI schema too.

What the router reads is typed strictly, as OpenAI does (`"stream": "true"` or `max_tokens: 5.0`
are refused, not coerced); token ids are u32 (a local tokenizer also checks its vocabulary);
empty prompts are refused. Whatever the router could not forward as valid JSON is refused
whichever field holds it: lone UTF-16 surrogates, NaN and Infinity, nesting deeper than
pydantic serializes.

Errors: `{"error": {"message", "type", "param", "code"}}` with the status of the
`ControlPlaneError` subclass (`controlplane/errors.py`); FastAPI's validation errors become 400
`invalid_request_error` naming the first bad field, as OpenAI answers (415 for a body that is not
JSON by its content type). Error texts are made UTF-8 safe (a lone surrogate in a bad value is
escaped, never a 500 while rendering the refusal).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import pydantic_core
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from controlplane.errors import ControlPlaneError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


# Token ids are u32 (what the block hash packs them into); a local tokenizer also checks them
# against its vocabulary. Strict: no floats, strings or booleans taken for ids.
TokenId = Annotated[int, Field(strict=True, ge=0, lt=2**32)]
LONE_SURROGATE = (
    "the request contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
    "which is not valid Unicode"
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = Field(default=None, strict=True)
    continuous_usage_stats: bool | None = Field(default=None, strict=True)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1, max_length=64)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class _Common(BaseModel):
    """Types are strict where OpenAI's are (a string is no boolean, 5.0 no max_tokens)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=512, description="The served model's name.")
    max_tokens: int | None = Field(default=None, ge=1, strict=True, description="Output token cap.")
    # null is "not streaming", as OpenAI and vLLM read it (clients send it for "unset")
    stream: bool | None = Field(default=False, strict=True)
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=512, description="End-user id.")
    n: int = Field(default=1, ge=1, le=16, strict=True)

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(
        cls, v: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if v is not None and not info.data.get("stream", False):
            raise ValueError("stream_options can only be set when stream is true")
        return v

    @model_validator(mode="after")
    def _forwardable(self) -> _Common:
        # What the router cannot serialize it cannot forward: refuse it here, whichever field (or
        # extra) holds it. json.loads keeps an unpaired "\ud800" escape as a lone surrogate,
        # which neither a tokenizer nor a UTF-8 encoder takes; and pydantic serializes nesting
        # only so deep.
        try:
            plain = self.model_dump()
            data = pydantic_core.to_json(plain, inf_nan_mode="constants")
            # NaN and +-Infinity (which json.loads takes, as the literals or as 1e400) are no
            # JSON numbers: such floats serialize differently in the two modes, strings do not
            if (b"NaN" in data or b"Infinity" in data) and data != pydantic_core.to_json(
                plain, inf_nan_mode="strings"
            ):
                raise ValueError("NaN and Infinity are not valid JSON numbers")
        except pydantic_core.PydanticSerializationError as exc:
            if "surrogate" in str(exc):
                raise ValueError(LONE_SURROGATE) from None
            if "depth" in str(exc):
                raise ValueError("the request is nested too deeply") from None
            raise ValueError(f"the request cannot be forwarded: {exc}") from None
        return self


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1, strict=True)
    add_generation_prompt: bool = Field(default=True, strict=True)
    continue_final_message: bool = Field(default=False, strict=True)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @property
    def output_cap(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] = Field(
        description="A prompt (text or token ids) or a batch of them."
    )
    echo: bool = Field(default=False, strict=True)

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt(cls, v: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            p = handler(v)
        except ValidationError:
            raise ValueError(
                "prompt must be a string, a list of strings, a list of token ids "
                "(integers from 0 to 2^32-1) or a list of such lists"
            ) from None
        if isinstance(p, list) and (not p or any(isinstance(x, list) and not x for x in p)):
            raise ValueError("the prompt cannot be empty")
        return p

    @property
    def output_cap(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return [[]]
        if isinstance(p[0], int):
            return [[int(t) for t in p]]
        return list(p)


Endpoint = Literal["chat", "completions"]


def _utf8(text: str) -> str:
    """`text` with any lone surrogate escaped, so that the error body always encodes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": _utf8(message),
            "type": ERROR_TYPES.get(
                status, "server_error" if status >= 500 else "invalid_request_error"
            ),
            "param": None if param is None else _utf8(param),
            "code": code if code is not None else status,
        }
    }


def error_of(exc: ControlPlaneError) -> tuple[int, dict[str, Any]]:
    status = int(getattr(exc, "status_code", 500))
    code = getattr(exc, "openai_code", None) or type(exc).__name__
    param = getattr(exc, "param", None)
    return status, error_body(status, str(exc) or type(exc).__name__, param=param, code=code)


def sse_error_event(status: int, message: str, code: str) -> bytes:
    """An SSE event carrying an OpenAI error (what the SDK raises as APIError mid-stream)."""
    return b"data: " + json.dumps(error_body(status, message, code=code)).encode() + b"\n\n"


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """The first pydantic/FastAPI validation error as (message, param)."""
    if not errors:
        return "invalid request", None
    err = errors[0]
    if err.get("type") == "json_invalid":
        ctx = err.get("ctx") or {}
        pos = [p for p in err.get("loc", ()) if p != "body"]
        where = f" at position {pos[0]}" if pos else ""
        return (
            f"the request body is not valid JSON: {ctx.get('error', 'decode error')}{where}",
            None,
        )
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if err.get("type") == "string_unicode":  # a lone surrogate in a string (or a key)
        msg = LONE_SURROGATE
    if not loc:  # the body as a whole: empty or not an object, or a check across fields
        if err.get("type") in ("missing", "model_attributes_type", "model_type", "dict_type"):
            return "the request body must be a JSON object", None
        return msg, None
    param = ".".join(loc)
    return f"{param}: {msg}", param
