"""The prompt-token bound a quota reserves in approx mode is never below what a real tokenizer
counts: the tiny model's byte-level BPE and Llama-3-style template (what the simulated replica
reports), for any text, any chat (Hypothesis), and the router's own estimate is below it too."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.token_bound import chat_bound, prompt_bound, text_bound
from controlplane.tokenization import ApproxTokenizer, LocalTokenizer
from deploy.tiny_model import make_tiny_model

OVERHEAD = 64  # quota.approx_template_tokens' default

# text with what tokenizers split hardest: non-ASCII, digits, punctuation, whitespace runs
TEXT = st.text(
    alphabet=st.characters(exclude_categories=["Cs"], max_codepoint=0x2FFFF), max_size=300
)
ROLE = st.sampled_from(["system", "user", "assistant", "tool"])
MESSAGE = st.fixed_dictionaries({"role": ROLE, "content": TEXT})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LocalTokenizer:
    path: Path = make_tiny_model(tmp_path_factory.mktemp("tiny")).path
    return LocalTokenizer.from_path(path)


@pytest.mark.parametrize(
    ("prompt", "bound"),
    [
        ("", 2),
        ("abc", 5),
        ("é", 4),  # two UTF-8 bytes
        ("日本", 8),
        ([1, 2, 3], 3),  # token ids: counted exactly
    ],
)
def test_prompt_bound_table(prompt: Any, bound: int) -> None:
    assert prompt_bound(prompt) == bound


def test_chat_bound_counts_tools_and_template_arguments() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    plain = chat_bound(msgs, overhead=OVERHEAD)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert chat_bound(msgs, overhead=OVERHEAD, tools=tools) > plain
    assert chat_bound(msgs, overhead=OVERHEAD, chat_template_kwargs={"documents": "x"}) > plain
    assert chat_bound(msgs, overhead=0) == plain - OVERHEAD


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=TEXT)
def test_text_bound_is_above_the_real_count(tiny: LocalTokenizer, text: str) -> None:
    assert text_bound(text) >= len(tiny.encode(text, add_special_tokens=True))


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(messages=st.lists(MESSAGE, min_size=1, max_size=6), generation=st.booleans())
def test_chat_bound_is_above_the_real_count(
    tiny: LocalTokenizer, messages: list[dict[str, Any]], generation: bool
) -> None:
    real = asyncio.run(tiny.tokenize_chat(messages, add_generation_prompt=generation))
    estimate = asyncio.run(ApproxTokenizer().tokenize_chat(messages))
    bound = chat_bound(messages, overhead=OVERHEAD)
    assert bound >= len(real.token_ids)
    assert bound >= len(estimate.token_ids)
