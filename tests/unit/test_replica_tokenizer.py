"""The replica's tokenizers: the byte-level fallback and a model directory's tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controlplane.sim_replica.tokenizer import (
    BOS_ID,
    BYTE_OFFSET,
    ByteTokenizer,
    ModelDirTokenizer,
    load_tokenizer,
    output_token_pool,
)

BOS = "<|bos|>"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def write_model_dir(path: Path, *, template: str | None = TEMPLATE) -> Path:
    """A small byte-level BPE tokenizer whose post-processor prepends BOS (like Llama 3's)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=300,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello world, the quick brown fox"] * 10, trainer=trainer)
    tok.add_special_tokens([AddedToken(BOS, special=True, normalized=False)])
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", special_tokens=[(BOS, bos_id)]
    )
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tok.to_str())
    config: dict[str, object] = {"bos_token": BOS, "eos_token": BOS}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_byte_fallback_round_trip_and_specials() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("hé", add_special_tokens=True)
    assert ids == [BOS_ID, ord("h") + BYTE_OFFSET, 0xC3 + BYTE_OFFSET, 0xA9 + BYTE_OFFSET]
    assert tok.decode(ids) == "hé"
    assert tok.decode(ids, skip_special_tokens=False) == "<s>hé"
    assert tok.encode("a<s>b", add_special_tokens=False) == [100, BOS_ID, 101]
    assert tok.vocab_size == 512


def test_byte_fallback_chat_template() -> None:
    tok = ByteTokenizer()
    text = tok.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<s><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    own = tok.render_chat(
        [{"role": "user", "content": "x"}], chat_template="{{ messages[0].content }}"
    )
    assert own == "x"


def test_model_dir_tokenizer(tmp_path: Path) -> None:
    tok = load_tokenizer(write_model_dir(tmp_path / "m"))
    assert isinstance(tok, ModelDirTokenizer)
    ids = tok.encode("hello world", add_special_tokens=True)
    bos = tok.encode(BOS, add_special_tokens=False)
    assert len(bos) == 1 and ids[0] == bos[0]
    assert tok.decode(ids) == "hello world"
    text = tok.render_chat([{"role": "user", "content": "hello"}])
    assert text == f"{BOS}[user]hello\n[assistant]"
    assert tok.encode(text, add_special_tokens=False)[0] == bos[0]


def test_model_dir_without_template_uses_the_default(tmp_path: Path) -> None:
    tok = load_tokenizer(write_model_dir(tmp_path / "m", template=None))
    assert "<|im_start|>assistant" in tok.render_chat([{"role": "user", "content": "x"}])


def test_template_only_dir_keeps_the_byte_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "T{{ 1 }}"}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, ByteTokenizer)
    assert tok.render_chat([{"role": "user", "content": "x"}]) == "T1"


@pytest.mark.parametrize("make_dir", [False, True])
def test_output_pool_is_printable(tmp_path: Path, make_dir: bool) -> None:
    tok = load_tokenizer(write_model_dir(tmp_path / "m") if make_dir else None)
    pool = output_token_pool(tok)
    assert len(pool) > 50
    text = tok.decode([int(t) for t in pool])
    assert text.isascii() and text.isprintable()
    assert all(tok.decode([int(t)]) for t in pool)


def test_project_tiny_model_if_present(tmp_path: Path) -> None:
    tiny = pytest.importorskip("deploy.tiny_model")
    (tmp_path / "tokenizer.json").write_text(tiny.build_tokenizer_json(tiny.TinyLlamaSpec()))
    config = tiny.tokenizer_config(tiny.TinyLlamaSpec())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    ids = tok.encode(tok.render_chat([{"role": "user", "content": "hi"}]), add_special_tokens=False)
    assert ids[0] == tok.encode("", add_special_tokens=True)[0], "the template writes BOS"
    assert tok.vocab_size == 512
