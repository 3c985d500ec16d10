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
class ModelSpec:
    """A decoder-only transformer with grouped-query attention and a SwiGLU MLP."""

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

    @property
    def attn_width(self) -> int:
        """Width of the attention projections (heads * head_dim); may differ from `hidden`."""
        return self.heads * self.head_dim

    @property
    def params_per_layer(self) -> int:
        d, hd = self.hidden, self.head_dim
        attn = d * self.attn_width * 2 + d * self.kv_heads * hd * 2
        mlp = 3 * d * self.intermediate
        norms = 2 * d + (2 * hd if self.qk_norm else 0)
        return attn + mlp + norms

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    @property
    def params(self) -> int:
        return (
            self.layers * self.params_per_layer
            + self.embedding_params
            + self.lm_head_params
            + self.hidden
        )

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def weight_bytes_read_per_step(self) -> int:
        """Every weight is read once per step except the input embedding (a gather)."""
        read = self.params - (0 if self.tied_embeddings else self.embedding_params)
        return read * self.dtype_bytes

    @property
    def body_flops_per_token(self) -> int:
        """Linear-layer FLOPs per token through the transformer body (no lm_head)."""
        return 2 * self.layers * self.params_per_layer

    @property
    def lm_head_flops_per_sample(self) -> int:
        """FLOPs of the logits for one sampled position."""
        return 2 * self.vocab * self.hidden

    @property
    def attn_flops_per_pair(self) -> int:
        """Attention FLOPs per (query token, context token) pair: QK and AV, all layers."""
        return 4 * self.layers * self.attn_width

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


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
