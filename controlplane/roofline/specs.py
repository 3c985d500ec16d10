"""Hardware and model specifications for the roofline model.

GPU figures are per device, dense (no sparsity), from the vendors' datasheets; the usable memory is
what vLLM sees on the device. Efficiency factors (`eta_bw`, `eta_compute`) are the fraction of the
datasheet peak a well-tuned kernel reaches; they are calibrated against vidur's per-operator
profiles (see `controlplane.roofline.calibration`). Model shapes are the Hugging Face configs.

Parameter counts are derived from the shapes, never typed in:

    per layer = q (d * H * hd) + k, v (d * KV * hd each) + o (H * hd * d)
              + MLP (3 * d * I, SwiGLU) + 2 norms (d) [+ q/k norms (hd each) for Qwen3]
    total     = L * per layer + input embedding (V * d)
              + lm_head (V * d, unless tied) + final norm (d)

MoE layers replace the MLP with E experts of width I_e, a shared expert of width I_s and a
router (d * E); a token uses k of the E (active parameters, FLOPs). MLA (DeepSeek) replaces
q, k, v with low-rank projections and caches (kv_lora_rank + qk_rope_head_dim) per layer.
`controlplane.roofline.hf_config` builds a spec from a Hugging Face config.json.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from controlplane.errors import ConfigError

GIB = 1024**3


@dataclass(frozen=True, slots=True)
class AllReduceModel:
    """All-reduce time as `latency + bytes / bandwidth`, per tensor-parallel degree.

    Bandwidths are fitted to the 64 MB medians of vidur's H100 DGX all-reduce profile (NCCL). The
    latency floor is vLLM's custom all-reduce for small messages (one-shot over NVLink, ~6-10 us),
    not NCCL's 30-40 us floor in that profile: decode steps all-reduce a few hundred KB, which is
    exactly where vLLM bypasses NCCL.
    """

    latency_s: dict[int, float]
    bandwidth_bps: dict[int, float]

    def time_s(self, tp: int, nbytes: float) -> float:
        if tp <= 1:
            return 0.0
        key = tp if tp in self.latency_s else max(self.latency_s)
        return self.latency_s[key] + nbytes / self.bandwidth_bps[key]


NVLINK_H100 = AllReduceModel(
    latency_s={2: 6e-6, 4: 8e-6, 8: 10e-6},
    bandwidth_bps={2: 337e9, 4: 293e9, 8: 249e9},
)
# PCIe-only cards (L40S): no NVLink; all-reduce goes over PCIe Gen4 through the host.
PCIE_GEN4 = AllReduceModel(
    latency_s={2: 30e-6, 4: 60e-6, 8: 90e-6},
    bandwidth_bps={2: 20e9, 4: 14e9, 8: 10e9},
)
NO_INTERCONNECT = AllReduceModel(latency_s={1: 0.0}, bandwidth_bps={1: 1.0})


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One accelerator (or the CPU profile used by the local test fleet)."""

    name: str
    # memory vLLM can see, in bytes
    memory_bytes: float
    # datasheet HBM bandwidth, bytes/s
    bandwidth_bps: float
    # dense BF16 tensor throughput, FLOP/s
    flops_bf16: float
    # achieved fraction of peak bandwidth / compute on large kernels
    eta_bw: float
    eta_compute: float
    # per-step CPU overhead (scheduling, launch, sampling) when no (model, TP) calibration exists
    step_overhead_s: float
    all_reduce: AllReduceModel = field(default=NO_INTERCONNECT)
    # vLLM's batch defaults split at 70 GiB of device memory, A100 excluded (EngineArgs)
    large_memory_class: bool = True

    @property
    def ridge_flop_per_byte(self) -> float:
        """Arithmetic intensity at which the device turns compute-bound (datasheet peaks)."""
        return self.flops_bf16 / self.bandwidth_bps


GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec(
        name="H100-SXM5-80GB",
        memory_bytes=79.19 * GIB,
        bandwidth_bps=3.35e12,
        flops_bf16=989e12,
        eta_bw=0.78,
        eta_compute=0.77,
        step_overhead_s=1.9e-3,
        all_reduce=NVLINK_H100,
    ),
    "h200": GpuSpec(
        name="H200-SXM-141GB",
        memory_bytes=140.4 * GIB,
        bandwidth_bps=4.8e12,
        flops_bf16=989e12,
        eta_bw=0.78,
        eta_compute=0.77,
        step_overhead_s=1.9e-3,
        all_reduce=NVLINK_H100,
    ),
    "a100": GpuSpec(
        name="A100-SXM4-80GB",
        memory_bytes=79.0 * GIB,
        bandwidth_bps=2.039e12,
        flops_bf16=312e12,
        eta_bw=0.76,
        eta_compute=0.73,
        step_overhead_s=2.0e-3,
        all_reduce=NVLINK_H100,
        large_memory_class=False,
    ),
    "l40s": GpuSpec(
        name="L40S-48GB",
        memory_bytes=44.4 * GIB,
        bandwidth_bps=864e9,
        flops_bf16=362e12,
        eta_bw=0.75,
        eta_compute=0.70,
        step_overhead_s=2.0e-3,
        all_reduce=PCIE_GEN4,
        large_memory_class=False,
    ),
    # The local test fleet: vLLM's CPU backend on two cores. Memory is the KV space given with
    # VLLM_CPU_KVCACHE_SPACE plus the weights; the step overhead dominates for the tiny model.
    "cpu": GpuSpec(
        name="CPU-2core",
        memory_bytes=2.0 * GIB,
        bandwidth_bps=20e9,
        flops_bf16=100e9,
        eta_bw=0.5,
        eta_compute=0.5,
        step_overhead_s=4.0e-3,
        large_memory_class=False,
    ),
}


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """Routed experts in place of the dense MLP (Mixtral, Qwen-MoE, DeepSeek-V2/V3)."""

    experts: int  # routed experts per MoE layer
    experts_per_token: int  # top-k: routed experts each token goes through
    expert_intermediate: int  # SwiGLU width of one routed expert
    shared_intermediate: int = 0  # SwiGLU width of the always-on shared expert(s), summed
    dense_layers: int = 0  # layers that keep the dense MLP (`ModelSpec.intermediate` wide)


@dataclass(frozen=True, slots=True)
class MlaSpec:
    """Multi-head latent attention (DeepSeek-V2/V3): the KV cache holds one compressed latent
    (`kv_lora_rank`) plus the shared rotary key (`qk_rope_head_dim`) per token and layer."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # 0: a full-rank q projection (DeepSeek-V2-Lite)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A decoder-only transformer: grouped-query (or latent) attention, SwiGLU MLP or experts.

    `dtype_bytes` is the activation dtype (embeddings, norms, routers, all-reduces); the
    attention and MLP projections are stored at `weight_dtype_bytes` (1 for FP8 checkpoints)
    and the KV cache at `kv_dtype_bytes` (1 with `--kv-cache-dtype fp8`); 0 means `dtype_bytes`.
    MLA models have one KV "head" (the latent), which vLLM replicates on every TP rank.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_context: int
    tied_embeddings: bool = False
    qk_norm: bool = False
    dtype_bytes: int = 2
    weight_dtype_bytes: int = 0
    kv_dtype_bytes: int = 0
    moe: MoeSpec | None = None
    mla: MlaSpec | None = None

    @property
    def attn_width(self) -> int:
        """Width of the attention projections (heads * head_dim); may differ from `hidden`."""
        return self.heads * self.head_dim

    @property
    def linear_dtype_bytes(self) -> int:
        return self.weight_dtype_bytes or self.dtype_bytes

    @property
    def kv_cache_dtype_bytes(self) -> int:
        return self.kv_dtype_bytes or self.dtype_bytes

    @property
    def attn_params_per_layer(self) -> int:
        d, h, mla = self.hidden, self.heads, self.mla
        if mla is None:
            return d * self.attn_width * 2 + d * self.kv_heads * self.head_dim * 2
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        rank = mla.q_lora_rank
        q = d * rank + rank * h * qk if rank else d * h * qk
        kv = d * (mla.kv_lora_rank + mla.qk_rope_head_dim)
        kv += mla.kv_lora_rank * h * (mla.qk_nope_head_dim + mla.v_head_dim)
        return q + kv + h * mla.v_head_dim * d

    @property
    def norm_params_per_layer(self) -> int:
        extra = 2 * self.head_dim if self.qk_norm else 0
        if self.mla is not None:  # the q and kv latent norms
            extra = self.mla.q_lora_rank + self.mla.kv_lora_rank
        return 2 * self.hidden + extra

    @property
    def moe_layers(self) -> int:
        return 0 if self.moe is None else self.layers - self.moe.dense_layers

    def _body_params(self, *, active: bool, linear_only: bool) -> int:
        """Transformer-layer parameters: every expert, or a token's top-k (`active`); with
        `linear_only`, only the projections (what `weight_dtype_bytes` applies to)."""
        d, moe = self.hidden, self.moe
        total = self.layers * self.attn_params_per_layer
        total += (self.layers - self.moe_layers) * 3 * d * self.intermediate
        if moe is not None:
            routed = moe.experts_per_token if active else moe.experts
            width = routed * moe.expert_intermediate + moe.shared_intermediate
            total += self.moe_layers * 3 * d * width
        if not linear_only:  # norms and routers
            routers = self.moe_layers * d * moe.experts if moe is not None else 0
            total += self.layers * self.norm_params_per_layer + routers
        return total

    @property
    def body_params(self) -> int:
        """Transformer layers (every expert), without embeddings, lm_head and the final norm."""
        return self._body_params(active=False, linear_only=False)

    @property
    def active_body_params(self) -> int:
        """The body one token goes through: the top-k routed experts of each MoE layer."""
        return self._body_params(active=True, linear_only=False)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    @property
    def params(self) -> int:
        return self.body_params + self.embedding_params + self.lm_head_params + self.hidden

    @property
    def active_params(self) -> int:
        """Parameters a token uses, embeddings included (equals `params` for a dense model)."""
        return self.active_body_params + self.embedding_params + self.lm_head_params + self.hidden

    @property
    def weight_bytes(self) -> int:
        """Projections at `linear_dtype_bytes`; embeddings, lm_head, norms, routers: dtype_bytes."""
        linear = self._body_params(active=False, linear_only=True)
        return linear * self.linear_dtype_bytes + (self.params - linear) * self.dtype_bytes

    @property
    def weight_bytes_read_per_step(self) -> int:
        """Every weight is read once per step except the input embedding (a gather); for MoE,
        every expert (one sits out a batch of B tokens with probability (1 - k/E)^B)."""
        embedding = 0 if self.tied_embeddings else self.embedding_params
        return self.weight_bytes - embedding * self.dtype_bytes

    @property
    def body_flops_per_token(self) -> int:
        """Linear-layer FLOPs per token through the transformer body (no lm_head)."""
        return 2 * self.active_body_params

    @property
    def lm_head_flops_per_sample(self) -> int:
        """FLOPs of the logits for one sampled position."""
        return 2 * self.vocab * self.hidden

    @property
    def attn_flops_per_pair(self) -> int:
        """Attention FLOPs per (query token, context token) pair: QK and AV, all layers.

        MLA counts the expanded heads (qk_nope + qk_rope for QK, v_head_dim for AV), as vLLM
        runs prefill; its absorbed decode kernel does more per pair, but decode is memory-bound.
        """
        if self.mla is None:
            return 4 * self.layers * self.attn_width
        qk = self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim
        return 2 * self.layers * self.heads * (qk + self.mla.v_head_dim)

    @property
    def kv_bytes_per_token(self) -> int:
        if self.mla is not None:
            per_layer = self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        else:
            per_layer = 2 * self.kv_heads * self.head_dim
        return self.layers * per_layer * self.kv_cache_dtype_bytes


MODELS: dict[str, ModelSpec] = {
    "llama-3.1-8b": ModelSpec(
        name="meta-llama/Llama-3.1-8B-Instruct",
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        head_dim=128,
        intermediate=14336,
        vocab=128256,
        max_context=131072,
    ),
    "llama-3.1-70b": ModelSpec(
        name="meta-llama/Llama-3.1-70B-Instruct",
        layers=80,
        hidden=8192,
        heads=64,
        kv_heads=8,
        head_dim=128,
        intermediate=28672,
        vocab=128256,
        max_context=131072,
    ),
    "qwen3-32b": ModelSpec(
        name="Qwen/Qwen3-32B",
        layers=64,
        hidden=5120,
        heads=64,
        kv_heads=8,
        head_dim=128,
        intermediate=25600,
        vocab=151936,
        max_context=40960,
        qk_norm=True,
    ),
    # vidur's profiled shapes, used only to validate the efficiency factors
    "llama-2-7b": ModelSpec(
        name="meta-llama/Llama-2-7b-hf",
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=32,
        head_dim=128,
        intermediate=11008,
        vocab=32000,
        max_context=4096,
    ),
    "llama-2-70b": ModelSpec(
        name="meta-llama/Llama-2-70b-hf",
        layers=80,
        hidden=8192,
        heads=64,
        kv_heads=8,
        head_dim=128,
        intermediate=28672,
        vocab=32000,
        max_context=4096,
    ),
    "llama-3-8b": ModelSpec(
        name="meta-llama/Meta-Llama-3-8B",
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        head_dim=128,
        intermediate=14336,
        vocab=128256,
        max_context=8192,
    ),
    # The project's own random-weight Llama for the CPU test fleet (made locally, never downloaded)
    "tiny-llama": ModelSpec(
        name="controlplane/tiny-llama",
        layers=2,
        hidden=256,
        heads=4,
        kv_heads=2,
        head_dim=64,
        intermediate=512,
        vocab=512,
        max_context=1024,
    ),
}


def gpu(name: str) -> GpuSpec:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown GPU {name!r}; known: {', '.join(sorted(GPUS))}") from None


def model(name: str) -> ModelSpec:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None


def register_model(key: str, spec: ModelSpec) -> str:
    """Make `spec` known as `key` (lower-cased, returned), for profiles built from a model's
    config.json; registering the same spec again is a no-op, a different one under a taken key
    is a ConfigError."""
    k = key.lower()
    known = MODELS.get(k)
    if known is not None and known != spec:
        raise ConfigError(f"model key {key!r} is already registered with another spec")
    MODELS[k] = spec
    return k
