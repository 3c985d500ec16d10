"""Router-side tokenization: turn a request's prompt into the token ids vLLM will hash.

Prefix-aware routing needs the prompt's token ids *before* the request reaches a replica. Three
modes, one async interface (`PromptTokenizer`):

``LocalTokenizer`` (exact)
    Loads the model's ``tokenizer.json`` with the `tokenizers` library and renders its chat
    template with jinja2 the way transformers' ``apply_chat_template`` does (sandboxed, trim_blocks,
    lstrip_blocks, ``raise_exception``/``strftime_now`` globals, a ``tojson`` filter). vLLM's
    defaults apply: chat requests render with ``add_generation_prompt=True`` and are encoded with
    ``add_special_tokens=False`` (the template emits BOS itself); completion prompts are encoded
    with ``add_special_tokens=True`` (the tokenizer's post-processor prepends BOS). Message
    content given as a list of parts is joined with newlines ("string" content format).
    Drift risk: a replica started with ``--chat-template``, ``chat_template_kwargs`` the router
    does not see, or another tokenizer version may tokenize differently; send token ids, or use
    the remote mode, when exactness matters.

``ApproxTokenizer`` (estimate; fleets whose tokenizer the router does not have)
    Splits text into pieces with a GPT-2-like pattern (special markers like ``<|eot_id|>``, runs
    of letters with their leading space, runs of digits, punctuation, whitespace), then cuts each
    piece into chunks of at most 4 characters. One chunk = one pseudo token; its id is the first 4
    bytes of BLAKE2b(chunk) (a 31-bit int). The count is a reasonable estimate for English and code
    (real BPE vocabularies average 3.5-4.5 characters per token; short words cost one "token",
    long words ceil(len/4)), and because pieces are cut locally, **two prompts that share a text
    prefix share their pseudo ids up to the piece where they first differ**, which is all prefix
    hashing needs. The ids mean nothing to a replica: never send them to one.
    Chats are rendered with a fixed ChatML-like layout before the split. The count is a point
    estimate (routing); a quota reserves an upper bound instead (`controlplane.token_bound`).

``RemoteTokenizer`` (exact, one round trip)
    Calls a replica's ``POST /tokenize`` (and ``/detokenize``) with httpx; the chat form applies
    the replica's own template, which is the reference for token parity.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import httpx

from controlplane.errors import ConfigError, ControlPlaneError

Message = Mapping[str, Any]


class TokenizationError(ControlPlaneError):
    """A prompt could not be tokenized (bad template, unreachable replica, refused request)."""


@dataclass(frozen=True)
class Tokenized:
    """Token ids for one prompt. `exact` is False for the approximate text mode."""

    token_ids: tuple[int, ...]
    exact: bool
    prompt_text: str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)


@runtime_checkable
class PromptTokenizer(Protocol):
    mode: ClassVar[str]

    async def tokenize(
        self, prompt: str | Sequence[int], *, add_special_tokens: bool = True
    ) -> Tokenized: ...

    async def tokenize_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Tokenized: ...

    async def aclose(self) -> None: ...


def _as_ids(prompt: Sequence[int]) -> Tokenized:
    ids = tuple(int(t) for t in prompt)
    if any(t < 0 for t in ids):
        raise TokenizationError("token ids must be non-negative")
    return Tokenized(ids, exact=True)


def content_text(content: Any) -> str:
    """A message's content as vLLM's "string" content format sees it."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts: list[str] = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") in ("text", "input_text"):
                parts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise TokenizationError(f"content part of type {kind!r} is not supported")
        return "\n".join(parts)
    raise TokenizationError(f"message content must be a string or a list, got {content!r}")


def normalize_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        if not isinstance(m, Mapping) or "role" not in m:
            raise TokenizationError("every message needs a role")
        msg = dict(m)
        msg["content"] = content_text(m.get("content"))
        out.append(msg)
    if not out:
        raise TokenizationError("messages must not be empty")
    return out


# --------------------------------------------------------------------------------------------
# chat templates (jinja2, as transformers renders them)


def _raise_exception(message: str) -> None:
    raise TokenizationError(f"chat template error: {message}")


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template; `render` mirrors transformers' `apply_chat_template` (text)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str | None] | None = None):
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise TokenizationError(f"cannot compile the chat template: {exc}") from exc
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        from jinja2 import TemplateError

        if add_generation_prompt and continue_final_message:
            raise TokenizationError(
                "add_generation_prompt and continue_final_message cannot both be true"
            )
        msgs = normalize_messages(messages)
        context: dict[str, Any] = {**self.special_tokens, **kwargs}
        try:
            rendered = self._template.render(
                messages=msgs,
                tools=_items(tools, "tools"),
                documents=_items(documents, "documents"),
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except TokenizationError:
            raise
        except (TemplateError, TypeError, ValueError, KeyError) as exc:
            raise TokenizationError(f"cannot render the chat template: {exc}") from exc
        if continue_final_message:
            final = str(msgs[-1]["content"])
            try:
                loc = rendered.rindex(final.strip())
            except ValueError:
                raise TokenizationError(
                    "continue_final_message: the final message is not in the rendered chat"
                ) from None
            if rendered[loc : loc + len(final.lstrip())] == final:
                rendered = rendered[: loc + len(final.lstrip())]
            else:
                rendered = rendered[: loc + len(final.strip())]
        return rendered


def _items(value: Any, name: str) -> list[Any] | None:
    if not value:
        return None
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise TokenizationError(f"{name} must be a list")
    return list(value)


def template_options(
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: Sequence[Mapping[str, Any]] | None,
    chat_template_kwargs: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The keyword arguments of `ChatTemplate.render` for one request: as vLLM merges them, the
    request's `chat_template_kwargs` win over its add_generation_prompt, continue_final_message
    and tools; they cannot replace the messages."""
    options: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "tools": tools,
    }
    options.update(chat_template_kwargs or {})
    if "messages" in options:
        raise TokenizationError("chat_template_kwargs cannot set messages")
    return options


def _token_content(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _template_from_config(config: Mapping[str, Any], model_dir: Path | None) -> str | None:
    if model_dir is not None:
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text()
        json_file = model_dir / "chat_template.json"
        if json_file.is_file():
            data = json.loads(json_file.read_text())
            tpl = data.get("chat_template") if isinstance(data, Mapping) else None
            if isinstance(tpl, str):
                return tpl
    tpl = config.get("chat_template")
    if isinstance(tpl, str):
        return tpl
    if isinstance(tpl, list):  # named templates: [{"name": "default", "template": "..."}]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, Mapping)}
        chosen = named.get("default")
        return chosen if isinstance(chosen, str) else None
    return None


# --------------------------------------------------------------------------------------------
# local (exact)


class LocalTokenizer:
    """A HF `tokenizer.json` (+ `tokenizer_config.json`) loaded with the `tokenizers` library."""

    mode: ClassVar[str] = "local"

    def __init__(
        self,
        tokenizer_json: str,
        config: Mapping[str, Any] | None = None,
        *,
        chat_template: str | None = None,
        model_dir: Path | None = None,
    ) -> None:
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_str(tokenizer_json)
        except Exception as exc:  # the Rust side raises a plain Exception
            raise TokenizationError(f"cannot load tokenizer.json: {exc}") from exc
        self._tok.no_truncation()
        self._tok.no_padding()
        self.config: dict[str, Any] = dict(config or {})
        self.bos_token = _token_content(self.config.get("bos_token"))
        self.eos_token = _token_content(self.config.get("eos_token"))
        self.pad_token = _token_content(self.config.get("pad_token"))
        self.unk_token = _token_content(self.config.get("unk_token"))
        self._template_source = chat_template or _template_from_config(self.config, model_dir)

    @classmethod
    def from_path(cls, path: str | Path, *, chat_template: str | None = None) -> LocalTokenizer:
        """A model directory (tokenizer.json + tokenizer_config.json) or a tokenizer.json file."""
        path = Path(path)
        model_dir = path if path.is_dir() else path.parent
        tj = path / "tokenizer.json" if path.is_dir() else path
        if not tj.is_file():
            raise ConfigError(f"no tokenizer.json at {tj}")
        cfg_path = model_dir / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        return cls(tj.read_text(), config, chat_template=chat_template, model_dir=model_dir)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        tid = self._tok.token_to_id(token)
        return None if tid is None else int(tid)

    @cached_property
    def chat_template(self) -> ChatTemplate:
        if not self._template_source:
            raise TokenizationError("this tokenizer has no chat template")
        specials = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
        }
        return ChatTemplate(self._template_source, specials)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def render_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        options = template_options(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
        )
        return self.chat_template.render(messages, **options)

    def encode_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Tokenized:
        text = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )
        ids = self.encode(text, add_special_tokens=False)
        return Tokenized(tuple(ids), exact=True, prompt_text=text)

    def tokenize_sync(
        self, prompt: str | Sequence[int], *, add_special_tokens: bool = True
    ) -> Tokenized:
        """`tokenize` without the event loop (a worker thread may call it)."""
        if not isinstance(prompt, str):
            tok = _as_ids(prompt)
            if tok.token_ids and max(tok.token_ids) >= self.vocab_size:
                raise TokenizationError(
                    f"token id {max(tok.token_ids)} is out of vocabulary ({self.vocab_size} ids)"
                )
            return tok
        ids = self.encode(prompt, add_special_tokens=add_special_tokens)
        return Tokenized(tuple(ids), exact=True, prompt_text=prompt)

    async def tokenize(
        self, prompt: str | Sequence[int], *, add_special_tokens: bool = True
    ) -> Tokenized:
        return self.tokenize_sync(prompt, add_special_tokens=add_special_tokens)

    async def tokenize_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Tokenized:
        return self.encode_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )

    async def aclose(self) -> None:
        return None


# --------------------------------------------------------------------------------------------
# approximate (no tokenizer)

CHARS_PER_CHUNK = 4
_PIECES = re.compile(
    r" ?<\|[A-Za-z0-9_]{1,64}\|>"  # special markers (and a leading space) as one token
    r"| ?[^\W\d_]+"  # letters, with one leading space
    r"| ?\d{1,3}"  # up to 3 digits (as Llama-3 / GPT-4 pre-tokenizers do)
    r"| ?[^\s\w]+"  # punctuation runs
    r"|\s+(?!\S)|\s+",  # whitespace
    re.UNICODE,
)
APPROX_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _chunk_id(chunk: str) -> int:
    digest = hashlib.blake2b(chunk.encode("utf-8", "surrogatepass"), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


def approx_chunks(text: str) -> list[str]:
    """Text cut into pseudo tokens (see the module docstring)."""
    chunks: list[str] = []
    for m in _PIECES.finditer(text):
        piece = m.group(0)
        if piece.endswith("|>") and piece.lstrip(" ").startswith("<|"):
            chunks.append(piece)
            continue
        chunks.extend(piece[i : i + CHARS_PER_CHUNK] for i in range(0, len(piece), CHARS_PER_CHUNK))
    return chunks


def approx_token_ids(text: str) -> list[int]:
    """Pseudo token ids: equal text prefixes give equal leading ids."""
    return [_chunk_id(c) for c in approx_chunks(text)]


def estimate_tokens(text: str) -> int:
    """Approximate token count of `text` (what `approx_token_ids` returns, without hashing)."""
    return len(approx_chunks(text))


class ApproxTokenizer:
    """Token estimates and prefix-stable pseudo ids from text alone (no model tokenizer)."""

    mode: ClassVar[str] = "approx"

    def __init__(self, chat_template: str = APPROX_CHAT_TEMPLATE) -> None:
        self._chat = ChatTemplate(chat_template)

    def render_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        return self._chat.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            **dict(chat_template_kwargs or {}),
        )

    async def tokenize(
        self, prompt: str | Sequence[int], *, add_special_tokens: bool = True
    ) -> Tokenized:
        if not isinstance(prompt, str):
            return _as_ids(prompt)
        return Tokenized(tuple(approx_token_ids(prompt)), exact=False, prompt_text=prompt)

    async def tokenize_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Tokenized:
        text = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )
        return Tokenized(tuple(approx_token_ids(text)), exact=False, prompt_text=text)

    async def aclose(self) -> None:
        return None


# --------------------------------------------------------------------------------------------
# remote (a replica's /tokenize)


class RemoteTokenizer:
    """Tokenize through a vLLM replica's `POST /tokenize` (its template, its tokenizer)."""

    mode: ClassVar[str] = "remote"

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        client: httpx.AsyncClient | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._own_client = client is None
        self._client = client or httpx.AsyncClient(timeout=timeout_s)

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.model is not None:
            body = {"model": self.model, **body}
        url = f"{self.base_url}{path}"
        try:
            resp = await self._client.post(url, json=body)
        except httpx.HTTPError as exc:
            raise TokenizationError(f"POST {url} failed: {exc!r}") from exc
        if resp.status_code != 200:
            raise TokenizationError(f"POST {url} -> {resp.status_code}: {resp.text[:500]}")
        data = resp.json()
        if not isinstance(data, dict):
            raise TokenizationError(f"POST {url}: unexpected body {data!r}")
        return data

    async def tokenize(
        self, prompt: str | Sequence[int], *, add_special_tokens: bool = True
    ) -> Tokenized:
        if not isinstance(prompt, str):
            return _as_ids(prompt)
        data = await self._post(
            "/tokenize", {"prompt": prompt, "add_special_tokens": add_special_tokens}
        )
        return Tokenized(tuple(int(t) for t in data["tokens"]), exact=True, prompt_text=prompt)

    async def tokenize_chat(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Tokenized:
        body: dict[str, Any] = {
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "add_special_tokens": False,
        }
        if chat_template_kwargs:
            body["chat_template_kwargs"] = dict(chat_template_kwargs)
        if tools:
            body["tools"] = [dict(t) for t in tools]
        data = await self._post("/tokenize", body)
        return Tokenized(tuple(int(t) for t in data["tokens"]), exact=True)

    async def detokenize(self, ids: Sequence[int]) -> str:
        data = await self._post("/detokenize", {"tokens": [int(t) for t in ids]})
        return str(data["prompt"])

    async def aclose(self) -> None:
        if self._own_client:
            await self._client.aclose()


def open_tokenizer(source: str | Path | None, *, model: str | None = None) -> PromptTokenizer:
    """`None`/"approx" → ApproxTokenizer; "http(s)://replica" → RemoteTokenizer; else a path."""
    if source is None or str(source) in ("", "approx"):
        return ApproxTokenizer()
    text = str(source)
    if text.startswith(("http://", "https://")):
        return RemoteTokenizer(text, model=model)
    return LocalTokenizer.from_path(text)


__all__ = [
    "APPROX_CHAT_TEMPLATE",
    "ApproxTokenizer",
    "ChatTemplate",
    "LocalTokenizer",
    "PromptTokenizer",
    "RemoteTokenizer",
    "TokenizationError",
    "Tokenized",
    "approx_chunks",
    "approx_token_ids",
    "content_text",
    "estimate_tokens",
    "open_tokenizer",
]
