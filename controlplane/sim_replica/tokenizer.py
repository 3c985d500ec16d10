"""The replica's tokenizer: the model directory's `tokenizer.json`, or a byte-level fallback.

With `--model-dir` holding `tokenizer.json` (and `tokenizer_config.json` or `chat_template.jinja`
for the chat template), the replica tokenizes exactly as vLLM would with that tokenizer
(`controlplane.tokenization.LocalTokenizer`: the `tokenizers` library plus transformers-style
jinja2 templates).

**Byte-level fallback** (no tokenizer in the directory): a deterministic tokenizer with a
512-id vocabulary, so the replica runs with no files at all.

| ids | meaning |
|---|---|
| 0 | `<pad>` |
| 1 | `<s>` (BOS; prepended when `add_special_tokens=True`) |
| 2 | `</s>` (EOS) |
| 3 + b | the byte b of the UTF-8 text (3..258) |
| 259..511 | unused (decode to nothing) |

The special token strings are recognised inside text (as added tokens are), so a chat template
that writes `<s>` yields id 1. Chats use the model directory's template when there is one, else
`DEFAULT_CHAT_TEMPLATE` (ChatML after a BOS).

**Generated tokens.** The engine samples nothing; a request's output tokens are drawn
uniformly from `output_token_pool()`: the non-special ids whose own text is printable ASCII, so
streamed text deltas concatenate to the decoded whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from controlplane.tokenization import (
    ChatTemplate,
    LocalTokenizer,
    Message,
    TokenizationError,
    template_options,
)

BYTE_OFFSET = 3
BYTE_VOCAB_SIZE = 512
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
_BYTE_SPECIALS = {"<pad>": PAD_ID, "<s>": BOS_ID, "</s>": EOS_ID}
_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in _BYTE_SPECIALS) + ")")
# ids scanned for the output pool of a large vocabulary
_POOL_SCAN_LIMIT = 50_000

DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class ReplicaTokenizer(Protocol):
    """What the replica needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]: ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...

    def render_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str: ...


def _render(
    template: ChatTemplate,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template: str | None,
    chat_template_kwargs: Mapping[str, Any] | None,
    tools: Sequence[Mapping[str, Any]] | None,
) -> str:
    """Render with `template`, or with a request's own `chat_template` and the same specials."""
    if chat_template:
        template = ChatTemplate(chat_template, template.special_tokens)
    options = template_options(
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tools=tools,
        chat_template_kwargs=chat_template_kwargs,
    )
    return template.render(messages, **options)


class ByteTokenizer:
    """The byte-level fallback (see the module docstring)."""

    def __init__(self, chat_template: str | None = None) -> None:
        self._template = ChatTemplate(
            chat_template or DEFAULT_CHAT_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"}
        )

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        ids = [BOS_ID] if add_special_tokens else []
        for piece in _SPECIAL_SPLIT.split(text):
            special = _BYTE_SPECIALS.get(piece)
            if special is not None:
                ids.append(special)
            else:
                ids.extend(b + BYTE_OFFSET for b in piece.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        out = bytearray()
        names = {v: k for k, v in _BYTE_SPECIALS.items()}
        for t in ids:
            if BYTE_OFFSET <= t < BYTE_OFFSET + 256:
                out.extend((t - BYTE_OFFSET,))
            elif t in names and not skip_special_tokens:
                out.extend(names[t].encode())
        return out.decode("utf-8", "replace")

    def render_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        return _render(
            self._template,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )


class ModelDirTokenizer:
    """A model directory's tokenizer (`LocalTokenizer`), with the replica's chat defaults."""

    def __init__(self, local: LocalTokenizer) -> None:
        self.local = local

    @property
    def vocab_size(self) -> int:
        return self.local.vocab_size

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return self.local.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.local.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        return _render(
            self.local.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )


def load_tokenizer(model_dir: Path | None) -> ReplicaTokenizer:
    """The model directory's tokenizer when it has a `tokenizer.json`, else the byte fallback
    (with the directory's chat template, if it has one)."""
    if model_dir is not None and (model_dir / "tokenizer.json").is_file():
        local = LocalTokenizer.from_path(model_dir)
        try:
            local.chat_template  # noqa: B018 - compiles the directory's template, or raises
        except TokenizationError:
            # no (usable) template: vLLM would refuse chats; serve them with the default one
            local = LocalTokenizer.from_path(model_dir, chat_template=DEFAULT_CHAT_TEMPLATE)
        return ModelDirTokenizer(local)
    template: str | None = None
    if model_dir is not None:
        template = _dir_template(model_dir)
    return ByteTokenizer(template)


def _dir_template(model_dir: Path) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    cfg = model_dir / "tokenizer_config.json"
    if cfg.is_file():
        tpl = json.loads(cfg.read_text()).get("chat_template")
        return tpl if isinstance(tpl, str) else None
    return None


def output_token_pool(tok: ReplicaTokenizer) -> npt.NDArray[np.int64]:
    """Ids generated text is drawn from: non-special, printable ASCII on their own."""
    pool: list[int] = []
    for tid in range(min(tok.vocab_size, _POOL_SCAN_LIMIT)):
        text = tok.decode([tid], skip_special_tokens=True)
        if text and text.isascii() and text.isprintable():
            pool.append(tid)
    if not pool:
        raise ValueError("the tokenizer has no printable tokens to generate")
    return np.asarray(pool, dtype=np.int64)
