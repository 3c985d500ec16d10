"""Upper bounds of the tokens a replica will count for a prompt the router could only estimate.

The approximate tokenizer (`tokenization.ApproxTokenizer`) gives a point estimate, good enough to
route on, but a hard quota reserves `prompt + sequences x max_tokens` and later charges what the
replica reports: if the replica counts more prompt tokens than were reserved, the window
overshoots. For the reservation the router therefore uses a bound the replica's count never
exceeds, whatever its tokenizer and chat template:

- **Text**: its UTF-8 byte count. Every token of a byte-level BPE (GPT-2, Llama 3, Qwen, the
  tiny test model) covers at least one byte of the text, as does every token of a SentencePiece
  model with byte fallback (Llama 2, Mistral) except the one dummy-prefix token it may add;
  special tokens cover many bytes each.
- **A chat message**: the UTF-8 bytes of its JSON form (role, content, name, tool calls, every
  field a template may render). The JSON's own keys and quotes (`{"role":"","content":""}`,
  24 bytes) exceed the tokens a template wraps a message in (Llama 3: 4 plus the role; ChatML
  and Gemma: about 5; Mistral: about 4).
- **A chat**: its messages, plus the tools and `chat_template_kwargs` as JSON (templates render
  them), plus `overhead` tokens for what the template writes once per conversation: BOS, the
  generation prompt, a default system preamble (Llama 3.1's knowledge-cutoff lines are about 30
  tokens). `quota.approx_template_tokens` sets it; a template that injects more than that
  (a long default system prompt) needs a larger value.
- **A completion prompt**: text: its bytes + 2 (BOS and a dummy prefix); token ids: their count.

The bound is loose (English text is about 4 bytes a token), so a quota in approx mode admits
less at once than the tokens it will finally charge; the settlement charges what the replica
reported, so nothing is lost but concurrency near the limit. Exact tokenizers (a local
tokenizer.json, or the replicas' /tokenize) need no bound.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

# BOS and a SentencePiece dummy prefix: tokens a tokenizer may add to a text prompt
TEXT_PROMPT_EXTRA = 2


def _json_bytes(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass"))


def text_bound(text: str) -> int:
    """Tokens a text prompt can be at most (UTF-8 bytes, plus BOS and a dummy prefix)."""
    return len(text.encode("utf-8", "surrogatepass")) + TEXT_PROMPT_EXTRA


def prompt_bound(prompt: str | Sequence[int]) -> int:
    """One completion prompt: text -> `text_bound`; token ids are counted exactly."""
    return text_bound(prompt) if isinstance(prompt, str) else len(prompt)


def chat_bound(
    messages: Sequence[Mapping[str, Any]],
    *,
    overhead: int,
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> int:
    """Tokens a rendered chat can be at most (see the module docstring)."""
    total = overhead + sum(_json_bytes(dict(m)) for m in messages)
    if tools:
        total += _json_bytes([dict(t) for t in tools])
    if chat_template_kwargs:
        total += _json_bytes(dict(chat_template_kwargs))
    return total


__all__ = ["TEXT_PROMPT_EXTRA", "chat_bound", "prompt_bound", "text_bound"]
