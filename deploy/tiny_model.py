"""The project's tiny test model: a random-weight Llama that real vLLM (CPU build) can serve.

Nothing may be downloaded from a model hub here, so the model is made locally and
deterministically (same bytes on every run, every machine):

- **Tokenizer**: byte-level BPE trained with the `tokenizers` library on `CORPUS` (fixed text in
  this module): 256 byte symbols + 250 merges + 6 special tokens = **512** ids, specials last
  (Llama-3 style). Saved as `tokenizer.json` (its post-processor prepends `<|begin_of_text|>`
  when `add_special_tokens=True`) and `tokenizer_config.json` (`PreTrainedTokenizerFast`,
  bos/eos, a Llama-3-style Jinja chat template that starts with the BOS token).
- **Model**: `LlamaForCausalLM`, hidden 256, 4 heads of 64, 2 KV heads (GQA), 2 layers, SwiGLU
  intermediate 512, untied `lm_head`, RoPE theta 500,000, 1,024 positions: 1,443,072 parameters.
  Weights are seeded normal(0, 0.02) (norms 1.0), drawn in float32 with numpy and stored as
  **bfloat16** (round-to-nearest-even) in `model.safetensors`, 2.9 MB. bfloat16 is what vLLM's
  CPU backend runs natively on AVX-512 machines and matches the 1 KiB/token KV sizing in
  numbers.md §2; `dtype="float32"` (5.8 MB) is available for machines without bf16 support.
- **Constraints from vLLM CPU** (vllm-interfaces.md §6): head_dim must be >= 32, block size a
  multiple of 32.

Runs in the main venv (numpy, tokenizers, safetensors; no torch). CLI:
`controlplane fleet make-model --out DIR`.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from controlplane.errors import ConfigError

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, START_HEADER, END_HEADER, EOT, PAD)

#: Llama-3-style template. `bos_token` comes first, so chat requests use add_special_tokens=False.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim }}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

DEFAULT_MODEL_NAME = "tiny-llama"
SUPPORTED_DTYPES = ("bfloat16", "float16", "float32")

# A fixed corpus: enough distinct text for 250 BPE merges with min_frequency 2. Changing it
# changes every token id (and the model's bytes): don't, or bump the model name.
CORPUS = """\
A control plane for multi-replica vLLM fleets routes each request to the replica that already
holds the longest cached prefix of its prompt, balances load across replicas, keeps tenants fair,
and scales the fleet up and down as traffic changes. The router hashes prompts into blocks of
tokens, chains the block hashes, and looks them up in an index that replicas keep current by
publishing key-value cache events: a block stored, a block removed, all blocks cleared.
The system prompt is shared by many requests. The user asks a question; the assistant answers.
Prefix caching turns a repeated prompt into a cache hit: the engine skips the prefill of the
cached blocks and starts decoding sooner. Time to first token falls; throughput rises.
When the queue grows, the autoscaler starts another replica, which takes about a minute to load
its weights, compile its graphs and become healthy. When traffic falls, it drains a replica:
no new requests are routed to it, running requests finish, then the process stops.
Metrics are scraped from every replica: requests running and waiting, cache usage, prefix cache
queries and hits, prompt tokens, generation tokens, preemptions, latency histograms.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.
Once upon a time there was a small model with two layers, four heads and a tiny vocabulary.
It could not write poems, but it could generate tokens very quickly on a laptop processor,
and that was all the tests needed: real requests, real caches, real events, real metrics.
def route(request, replicas): return max(replicas, key=lambda r: r.cached_prefix(request))
for i in range(10): print(i, i * i, hex(i), "block", i // 32)
{"model": "tiny-llama", "prompt": "Hello, world!", "max_tokens": 16, "temperature": 0.0}
{"role": "system", "content": "You are a helpful assistant."}
{"role": "user", "content": "What is the capital of France?"}
{"role": "assistant", "content": "The capital of France is Paris."}
user: Summarize the following document in three sentences.
assistant: The document describes a routing policy, a simulator and an autoscaler.
user: Which replica should serve this request?
assistant: The one with the most cached blocks and the shortest queue.
0 1 2 3 4 5 6 7 8 9 10 11 12 16 20 24 32 48 64 100 128 256 320 512 1024 2048 4096 8192
Monday Tuesday Wednesday Thursday Friday Saturday Sunday. January February March April May June
July August September October November December. One two three four five six seven eight nine.
Red orange yellow green blue indigo violet. North south east west. Up down left right.
Hello! Hello, world. Good morning, good evening, good night. Thank you. Please. Sorry.
The the the and and and of of to to in in is is that that it it for for on on with with as as.
"""


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Dimensions of the tiny Llama; defaults are the project's test model (numbers.md §2)."""

    vocab_size: int = 512
    hidden_size: int = 256
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_hidden_layers: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 1024
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    dtype: str = "bfloat16"
    seed: int = 0
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def validate(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ConfigError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim < 32:
            raise ConfigError(f"vLLM's CPU attention needs head_dim >= 32, got {self.head_dim}")
        if self.vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
            raise ConfigError("vocab_size must leave room for 256 bytes and the special tokens")

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """HF Llama parameter names and shapes, in generation order."""
        d, hd, i_ = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        shapes: list[tuple[str, tuple[int, ...]]] = [
            ("model.embed_tokens.weight", (self.vocab_size, d))
        ]
        for layer in range(self.num_hidden_layers):
            p = f"model.layers.{layer}"
            shapes += [
                (f"{p}.input_layernorm.weight", (d,)),
                (f"{p}.self_attn.q_proj.weight", (q, d)),
                (f"{p}.self_attn.k_proj.weight", (kv, d)),
                (f"{p}.self_attn.v_proj.weight", (kv, d)),
                (f"{p}.self_attn.o_proj.weight", (d, q)),
                (f"{p}.post_attention_layernorm.weight", (d,)),
                (f"{p}.mlp.gate_proj.weight", (i_, d)),
                (f"{p}.mlp.up_proj.weight", (i_, d)),
                (f"{p}.mlp.down_proj.weight", (d, i_)),
            ]
        shapes += [("model.norm.weight", (d,)), ("lm_head.weight", (self.vocab_size, d))]
        return shapes

    def num_parameters(self) -> int:
        return sum(int(np.prod(shape)) for _, shape in self.param_shapes())


# --------------------------------------------------------------------------------------------
# tokenizer


def _special_ids(spec: TinyLlamaSpec) -> dict[str, int]:
    base = spec.vocab_size - len(SPECIAL_TOKENS)
    return {tok: base + i for i, tok in enumerate(SPECIAL_TOKENS)}


def build_tokenizer_json(spec: TinyLlamaSpec) -> str:
    """Train the byte-level BPE on CORPUS; return tokenizer.json text (deterministic)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    n_special = len(SPECIAL_TOKENS)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=spec.vocab_size - n_special,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    if tok.get_vocab_size() != spec.vocab_size - n_special:
        raise ConfigError(
            f"the built-in corpus yields {tok.get_vocab_size()} BPE ids, "
            f"need {spec.vocab_size - n_special}: lower vocab_size"
        )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    ids = _special_ids(spec)
    for t, i in ids.items():
        if tok.token_to_id(t) != i:
            raise AssertionError(f"special token {t} got id {tok.token_to_id(t)}, expected {i}")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS}:0 $A:0",
                pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
                special_tokens=[(BOS, ids[BOS])],
            ),
        ]
    )
    data = json.loads(tok.to_str())
    return json.dumps(data, indent=2, ensure_ascii=False, sort_keys=False) + "\n"


def tokenizer_config(spec: TinyLlamaSpec) -> dict[str, object]:
    ids = _special_ids(spec)
    return {
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t, i in ids.items()
        },
        "bos_token": BOS,
        "eos_token": EOT,
        "pad_token": PAD,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": spec.max_position_embeddings,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


# --------------------------------------------------------------------------------------------
# config and weights


def model_config(spec: TinyLlamaSpec) -> dict[str, object]:
    ids = _special_ids(spec)
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids[BOS],
        "eos_token_id": [ids[EOS], ids[EOT]],
        "pad_token_id": ids[PAD],
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": spec.init_std,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": spec.num_attention_heads,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_key_value_heads": spec.num_key_value_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": False,
        "torch_dtype": spec.dtype,
        "use_cache": True,
        "vocab_size": spec.vocab_size,
    }


def generation_config(spec: TinyLlamaSpec) -> dict[str, object]:
    ids = _special_ids(spec)
    return {
        "bos_token_id": ids[BOS],
        "eos_token_id": [ids[EOS], ids[EOT]],
        "pad_token_id": ids[PAD],
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 1.0,
    }


def _to_bf16_bytes(x: np.ndarray) -> bytes:
    """float32 → bfloat16 (round to nearest even), little-endian bytes."""
    bits = np.ascontiguousarray(x, dtype="<f4").view("<u4")
    one, half = np.uint32(1), np.uint32(0x7FFF)
    rounded = (bits + half + ((bits >> np.uint32(16)) & one)) >> np.uint32(16)
    return rounded.astype("<u2").tobytes()


def iter_weights(spec: TinyLlamaSpec) -> Iterator[tuple[str, np.ndarray]]:
    """Seeded float32 weights: norms 1.0, everything else normal(0, init_std)."""
    rng = np.random.Generator(np.random.PCG64(spec.seed))
    for name, shape in spec.param_shapes():
        if name.endswith("norm.weight"):
            yield name, np.ones(shape, dtype=np.float32)
        else:
            yield name, rng.normal(0.0, spec.init_std, size=shape).astype(np.float32)


_ST_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def encode_safetensors(
    tensors: dict[str, tuple[str, tuple[int, ...], bytes]], metadata: dict[str, str]
) -> bytes:
    """The safetensors format, written directly (stable across `safetensors` versions).

    Layout: u64 little-endian header length, a JSON header (padded with spaces to a multiple of
    8 bytes) mapping each name to {dtype, shape, data_offsets}, then the tensors back to back in
    name order.
    """
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    raw += b" " * (-len(raw) % 8)
    body = b"".join(tensors[name][2] for name in sorted(tensors))
    return len(raw).to_bytes(8, "little") + raw + body


def build_safetensors(spec: TinyLlamaSpec) -> bytes:
    tensors: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for name, arr in iter_weights(spec):
        if spec.dtype == "bfloat16":
            data = _to_bf16_bytes(arr)
        else:
            data = arr.astype("<f2" if spec.dtype == "float16" else "<f4").tobytes()
        tensors[name] = (spec.dtype, tuple(arr.shape), data)
    return encode_safetensors(tensors, {"format": "pt"})


# --------------------------------------------------------------------------------------------
# the directory


def _json(obj: object) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def build_files(spec: TinyLlamaSpec | None = None) -> dict[str, bytes]:
    """Every file of the model directory, by name (nothing touches the disk)."""
    spec = spec or TinyLlamaSpec()
    spec.validate()
    return {
        "config.json": _json(model_config(spec)),
        "generation_config.json": _json(generation_config(spec)),
        "tokenizer.json": build_tokenizer_json(spec).encode(),
        "tokenizer_config.json": _json(tokenizer_config(spec)),
        "special_tokens_map.json": _json({"bos_token": BOS, "eos_token": EOT, "pad_token": PAD}),
        "model.safetensors": build_safetensors(spec),
    }


def default_model_dir() -> Path:
    """`.cache/tiny-llama` at the repository root (gitignored)."""
    return Path(__file__).resolve().parent.parent / ".cache" / DEFAULT_MODEL_NAME


@dataclass(frozen=True)
class ModelDirResult:
    path: Path
    written: tuple[str, ...]
    unchanged: tuple[str, ...]
    digest: str  # sha256 over (name, sha256(content)) of every file, sorted by name
    num_parameters: int


def dir_digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return h.hexdigest()


def make_tiny_model(out: Path | None = None, spec: TinyLlamaSpec | None = None) -> ModelDirResult:
    """Write the tiny model to `out` (idempotent: files already identical are left alone)."""
    spec = spec or TinyLlamaSpec()
    out = out or default_model_dir()
    files = build_files(spec)
    out.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    unchanged: list[str] = []
    for name, content in sorted(files.items()):
        path = out / name
        if path.is_file() and path.read_bytes() == content:
            unchanged.append(name)
            continue
        fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(content)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        written.append(name)
    return ModelDirResult(
        path=out,
        written=tuple(written),
        unchanged=tuple(unchanged),
        digest=dir_digest(files),
        num_parameters=spec.num_parameters(),
    )


def ensure_tiny_model(out: Path | None = None) -> Path:
    """The default tiny model directory, made if missing or stale; returns its path."""
    return make_tiny_model(out).path
