"""Router-side tokenization: the tiny model's tokenizer and template; approx and remote modes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.errors import ConfigError
from controlplane.tokenization import (
    ApproxTokenizer,
    ChatTemplate,
    LocalTokenizer,
    PromptTokenizer,
    RemoteTokenizer,
    TokenizationError,
    approx_chunks,
    approx_token_ids,
    estimate_tokens,
    open_tokenizer,
)
from deploy.tiny_model import make_tiny_model

BOS_ID, START_ID, END_ID, EOT_ID = 506, 508, 509, 510
CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
# the tiny model's template on CHAT, add_generation_prompt=True: pinned so drift is noticed
CHAT_RENDERED = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
    "You are a helpful assistant.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\n"
    "What is the capital of France?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)
TEXTS = [
    "Hello, world!",
    "The router hashes prompts into blocks of 32 tokens.",
    "  leading and trailing spaces  ",
    "naïve café — 東京 🚀",
    'def f(x):\n    return {"a": [x, 2]}\n',
    "",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny")).path


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> LocalTokenizer:
    return LocalTokenizer.from_path(model_dir)


# -- local ----------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: LocalTokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert all(0 <= i < 512 for i in ids)
    assert tok.decode(ids) == text


def test_completion_prompts_get_bos_chat_does_not_double_it(tok: LocalTokenizer) -> None:
    ids = tok.encode("Hello, world!")
    assert ids[0] == BOS_ID and ids[1:] == tok.encode("Hello, world!", add_special_tokens=False)
    chat = tok.encode_chat(CHAT)
    assert chat.token_ids.count(BOS_ID) == 1 and chat.token_ids[0] == BOS_ID
    assert tok.decode(list(chat.token_ids)) == CHAT_RENDERED


def test_chat_template_output_is_stable(tok: LocalTokenizer) -> None:
    assert tok.render_chat(CHAT) == CHAT_RENDERED
    first = tok.encode_chat(CHAT)
    assert first == tok.encode_chat(CHAT)
    assert first.exact and first.prompt_text == CHAT_RENDERED
    # special markers are single tokens
    ids = first.token_ids
    assert ids[:2] == (BOS_ID, START_ID) and ids.count(EOT_ID) == 2
    assert ids[-5:] == (START_ID, tok.token_to_id("assistant"), END_ID, 198, 198)


def test_generation_prompt_and_continue_final_message(tok: LocalTokenizer) -> None:
    no_gen = tok.render_chat(CHAT, add_generation_prompt=False)
    assert no_gen == CHAT_RENDERED.removesuffix("<|start_header_id|>assistant<|end_header_id|>\n\n")
    partial = [*CHAT, {"role": "assistant", "content": "The capital is"}]
    cont = tok.render_chat(partial, add_generation_prompt=False, continue_final_message=True)
    assert cont.endswith("<|start_header_id|>assistant<|end_header_id|>\n\nThe capital is")
    with pytest.raises(TokenizationError):
        tok.render_chat(partial, add_generation_prompt=True, continue_final_message=True)


def test_content_parts_are_joined_with_newlines(tok: LocalTokenizer) -> None:
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    assert "a\nb<|eot_id|>" in tok.render_chat(parts)
    with pytest.raises(TokenizationError, match="image_url"):
        tok.render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


async def test_async_interface(tok: LocalTokenizer) -> None:
    assert isinstance(tok, PromptTokenizer)
    t = await tok.tokenize("Hello")
    assert t.exact and t.token_ids == tuple(tok.encode("Hello"))
    assert (await tok.tokenize([1, 2, 3])).token_ids == (1, 2, 3)
    chat = await tok.tokenize_chat(CHAT)
    assert chat.token_ids == tok.encode_chat(CHAT).token_ids
    with pytest.raises(TokenizationError):
        await tok.tokenize([1, -2])


def test_template_features_transformers_provides() -> None:
    tpl = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no ' + m.role) }}"
        "{% endif %}{{ m | tojson }}{% endfor %}{{ bos_token }}",
        {"bos_token": "<s>"},
    )
    out = tpl.render([{"role": "user", "content": "é"}], add_generation_prompt=False)
    assert out == '{"role": "user", "content": "é"}<s>'
    with pytest.raises(TokenizationError, match="no bad"):
        tpl.render([{"role": "bad", "content": ""}])
    with pytest.raises(TokenizationError, match="compile"):
        ChatTemplate("{% for %}")


def test_from_tokenizer_json_and_missing_template(model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    bare = LocalTokenizer.from_path(tmp_path / "tokenizer.json")
    assert bare.encode("hi") == LocalTokenizer.from_path(model_dir).encode("hi")
    with pytest.raises(TokenizationError, match="no chat template"):
        bare.render_chat(CHAT)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert LocalTokenizer.from_path(tmp_path).render_chat(CHAT) == CHAT[0]["content"]
    with pytest.raises(ConfigError):
        LocalTokenizer.from_path(tmp_path / "nowhere")


# -- approximate ----------------------------------------------------------------------------


def test_approx_shared_prefix_gives_shared_leading_ids() -> None:
    prefix = "You are a helpful assistant. Answer briefly and cite sources. " * 5
    a = approx_token_ids(prefix + "What is the capital of France?")
    b = approx_token_ids(prefix + "Summarize this article about routers.")
    # the prefix's last piece (its trailing space) merges with what follows; the rest is shared
    common = approx_token_ids(prefix)[:-1]
    assert len(common) > 60
    assert a[: len(common)] == b[: len(common)] == common
    assert a[len(common)] != b[len(common)]


def test_approx_counts_and_pieces() -> None:
    assert approx_chunks("Hello, world! 12345 <|eot_id|>") == [
        "Hell", "o", ",", " wor", "ld", "!", " 123", "45", " <|eot_id|>",
    ]  # fmt: skip
    assert estimate_tokens("") == 0
    english = "The quick brown fox jumps over the lazy dog. " * 20
    # real BPE vocabularies give ~4 characters per token on English
    assert 0.15 < estimate_tokens(english) / len(english) < 0.4
    ids = approx_token_ids(english)
    assert all(0 <= i < 2**31 for i in ids) and ids == approx_token_ids(english)


async def test_approx_tokenizer_marks_estimates() -> None:
    t = ApproxTokenizer()
    res = await t.tokenize("Hello there")
    assert not res.exact and len(res) == estimate_tokens("Hello there")
    chat = await t.tokenize_chat(CHAT)
    assert not chat.exact and chat.prompt_text is not None
    assert chat.prompt_text.endswith("<|assistant|>\n")
    longer = await t.tokenize_chat([*CHAT, {"role": "assistant", "content": "Paris."}])
    n = len(chat) - 1  # the generation prompt differs; the conversation so far is shared
    assert longer.token_ids[:n] == chat.token_ids[:n]


# -- remote ---------------------------------------------------------------------------------


async def test_remote_tokenizer_speaks_vllm_tokenize(tok: LocalTokenizer) -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append({"path": request.url.path, **body})
        if request.url.path == "/detokenize":
            return httpx.Response(200, json={"prompt": tok.decode(body["tokens"])})
        if "messages" in body:
            ids = list(tok.encode_chat(body["messages"]).token_ids)
        else:
            ids = tok.encode(body["prompt"], add_special_tokens=body["add_special_tokens"])
        return httpx.Response(200, json={"count": len(ids), "max_model_len": 1024, "tokens": ids})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        remote = RemoteTokenizer("http://replica:8000/", model="tiny-llama", client=client)
        assert (await remote.tokenize("Hello")).token_ids == tuple(tok.encode("Hello"))
        chat = await remote.tokenize_chat(CHAT)
        assert chat.token_ids == tok.encode_chat(CHAT).token_ids
        assert await remote.detokenize(tok.encode("hi", add_special_tokens=False)) == "hi"
        await remote.aclose()  # does not close a client it does not own
        assert not client.is_closed
    assert seen[0] == {
        "path": "/tokenize", "model": "tiny-llama", "prompt": "Hello", "add_special_tokens": True,
    }  # fmt: skip
    assert seen[1]["add_generation_prompt"] is True and seen[1]["add_special_tokens"] is False


async def test_remote_errors_are_tokenization_errors() -> None:
    transport = httpx.MockTransport(lambda r: httpx.Response(400, json={"error": "bad"}))
    async with httpx.AsyncClient(transport=transport) as client:
        remote = RemoteTokenizer("http://replica:8000", client=client)
        with pytest.raises(TokenizationError, match="400"):
            await remote.tokenize("x")

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async with httpx.AsyncClient(transport=httpx.MockTransport(refuse)) as client:
        with pytest.raises(TokenizationError, match="failed"):
            await RemoteTokenizer("http://replica:8000", client=client).tokenize("x")


async def test_open_tokenizer_dispatch(model_dir: Path) -> None:
    assert isinstance(open_tokenizer(None), ApproxTokenizer)
    assert isinstance(open_tokenizer("approx"), ApproxTokenizer)
    assert isinstance(open_tokenizer(model_dir), LocalTokenizer)
    remote = open_tokenizer("http://127.0.0.1:1")
    assert isinstance(remote, RemoteTokenizer)
    await remote.aclose()
