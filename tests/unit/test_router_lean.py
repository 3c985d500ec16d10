"""The hot endpoints' fast parse (router/http/lean.py) agrees with the full validation, and the
body rewrites (router/http/splice.py) equal re-serialising the decoded body.

Fast accept, slow reject: whatever `parse` accepts, the pydantic models accept with the same
values; what it declines goes to them. Checked on the bad-input corpus (every refused case is
declined), its odd-but-valid cases, and generated bodies with random values for every field the
router reads.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from router.http.lean import from_model, parse
from router.http.openai_api import ChatCompletionRequest, CompletionRequest
from router.http.splice import set_members, set_nested

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from bad_input_corpus import BAD_INPUTS, COMPLETIONS, ODD_BUT_VALID

MODELS: dict[str, type[ChatCompletionRequest] | type[CompletionRequest]] = {
    "chat": ChatCompletionRequest,
    "completions": CompletionRequest,
}
FIELDS = (
    "endpoint", "model", "output_cap", "stream", "include_usage", "user",
    "sequences_per_prompt", "client_salt", "messages", "add_generation_prompt",
    "continue_final_message", "chat_template_kwargs", "tools", "prompts",
)  # fmt: skip


def full(body: bytes, endpoint: str) -> Any:
    """What the full validation makes of `body` (None: refused)."""
    try:
        data = json.loads(body)
        return from_model(MODELS[endpoint].model_validate(data), body, data)
    except (ValueError, ValidationError, RecursionError):
        return None


def agree(body: bytes, endpoint: str) -> None:
    fast = parse(body, endpoint)  # type: ignore[arg-type]
    if fast is None:
        return
    slow = full(body, endpoint)
    assert slow is not None, body[:200]
    for name in FIELDS:
        assert getattr(fast, name) == getattr(slow, name), (name, body[:200])


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c.id for c in BAD_INPUTS])
def test_refused_bodies_never_take_the_fast_lane_unless_valid(case: Any) -> None:
    if case.body is None or case.method != "POST":
        return
    endpoint = "completions" if case.path == COMPLETIONS else "chat"
    agree(case.body, endpoint)
    if full(case.body, endpoint) is None:  # the schema refuses it: so must the fast lane
        assert parse(case.body, endpoint) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("case", ODD_BUT_VALID, ids=[c.id for c in ODD_BUT_VALID])
def test_odd_but_valid_bodies_agree(case: Any) -> None:
    endpoint = "completions" if case.path == COMPLETIONS else "chat"
    agree(case.body, endpoint)


def test_a_plain_chat_takes_the_fast_lane() -> None:
    body = b'{"model":"m","messages":[{"role":"user","content":"hi","name":null}],"stream":true}'
    req = parse(body, "chat")
    assert req is not None and req.messages == [{"role": "user", "content": "hi"}]
    assert req.stream and not req.include_usage and req.output_cap is None


ANY = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 2**33), st.floats(allow_nan=False, width=32),
    st.text(max_size=4), st.lists(st.integers(0, 5), max_size=3), st.just({}),
    st.just({"include_usage": True}), st.just([[1, 2], [3]]), st.just(["a", "b"]),
    st.just([{"role": "user", "content": "x"}]), st.just([{"type": "function"}]),
)  # fmt: skip
KEYS = (
    "model", "max_tokens", "stream", "stream_options", "user", "n", "best_of", "cache_salt",
    "messages", "max_completion_tokens", "add_generation_prompt", "continue_final_message",
    "chat_template_kwargs", "tools", "prompt", "echo",
)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(KEYS), ANY), st.sampled_from(["chat", "completions"]))
def test_generated_bodies_agree(fields: dict[str, Any], endpoint: str) -> None:
    base: dict[str, Any] = {"model": "m"}
    base |= {"messages": [{"role": "user", "content": "a"}]} if endpoint == "chat" else {}
    base |= {"prompt": "a"} if endpoint == "completions" else {}
    agree(json.dumps({**base, **fields}).encode(), endpoint)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.sampled_from(["a", "cache_salt", "stream_options", "x y"]), JSON),
    st.dictionaries(st.sampled_from(["cache_salt", "max_tokens", "b"]), JSON, min_size=1),
    st.booleans(),
)
def test_splicing_equals_reserialising(
    data: dict[str, Any], updates: dict[str, Any], spaced: bool
) -> None:
    body = json.dumps(data, indent=1 if spaced else None).encode()
    encoded = {k: json.dumps(v).encode() for k, v in updates.items()}
    out = set_members(body, data, encoded)
    assert json.loads(out) == {**data, **updates}
    nested = set_nested(body, data, "stream_options", {"include_usage": b"true"}, encoded)
    opts = data.get("stream_options")
    want = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
    assert json.loads(nested) == {**data, **updates, "stream_options": want}
