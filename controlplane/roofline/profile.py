"""An engine profile: one vLLM replica (GPU class, model, tensor parallel degree, vLLM knobs).

Defaults follow what vLLM (reference 0.33.0, `EngineArgs.get_batch_defaults`) sets for the
OpenAI server when the user passes nothing:

| device class                      | max_num_seqs | max_num_batched_tokens | block_size |
|-----------------------------------|-------------:|-----------------------:|-----------:|
| >= 70 GiB and not A100 (H100/H200)|        1,024 |                  8,192 |         16 |
| otherwise (A100, L40S)            |          256 |                  2,048 |         16 |
| CPU backend                       |          256 |                  2,048 |  32 (x32)  |

KV capacity (vLLM's memory profiling, per GPU, KV heads sharded across TP):

    free      = memory * gpu_memory_utilization - weights / TP - reserve
    kv_tokens = floor(free / (kv_bytes_per_token / TP))
    blocks    = floor(kv_tokens / block_size)          # what vllm:cache_config_info reports

`reserve` (activations, CUDA graphs, NCCL buffers) is 2.75 GiB, the middle of the 2.5-3 GiB
seen in vLLM logs. The CPU backend takes its KV size from VLLM_CPU_KVCACHE_SPACE instead
(`kv_cache_bytes`, default 1 GiB as the local CPU fleet runs it). When TP exceeds the number of KV
heads, vLLM replicates heads so each GPU still holds one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from controlplane.errors import ConfigError
from controlplane.roofline.specs import GIB, GpuSpec, ModelSpec, gpu, model

VLLM_REFERENCE_VERSION = "0.33.0"
ACTIVATION_RESERVE_BYTES = 2.75 * GIB
# VLLM_CPU_KVCACHE_SPACE of the project's local CPU fleet (1 GiB)
CPU_DEFAULT_KV_CACHE_BYTES = 1.0 * GIB

# Per-step CPU overhead fitted per (model key, TP) to vLLM's nightly latency benchmarks
# (see controlplane.roofline.calibration); other combinations use the GPU's default.
CALIBRATED_STEP_OVERHEAD_S: dict[tuple[str, int], float] = {
    ("llama-3.1-8b", 1): 1.86e-3,
    ("llama-3.1-70b", 4): 4.14e-3,
}


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """Everything the roofline and the replica model need to know about one replica."""

    gpu_key: str
    model_key: str
    tp: int = 1
    block_size: int = 0  # 0: vLLM's default for the platform
    max_num_seqs: int = 0  # 0: vLLM's default for the device class
    max_num_batched_tokens: int = 0  # 0: vLLM's OpenAI-server default for the device class
    gpu_memory_utilization: float = 0.9
    # explicit KV capacity in blocks (a test fleet, or a replica's reported num_gpu_blocks)
    num_gpu_blocks_override: int = 0
    # CPU backend: VLLM_CPU_KVCACHE_SPACE in bytes
    kv_cache_bytes: float = 0.0
    max_model_len: int = 0  # 0: the model's own maximum context
    enable_prefix_caching: bool = True
    step_overhead_s: float = -1.0  # < 0: calibrated or the GPU's default
    # vLLM's --long-prefill-token-threshold: at most this many new tokens of one request per step
    # (0: off, vLLM's default while max_num_partial_prefills is 1); see controlplane.sim.scheduler
    long_prefill_token_threshold: int = 0
    # derived once in __post_init__ (routing reads them per request and replica)
    _kv_tokens: int = field(init=False, repr=False, compare=False, default=0)
    _blocks: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ConfigError(f"tensor parallel degree must be >= 1, got {self.tp}")
        g, m = self.gpu, self.model
        if m.kv_heads % self.tp and self.tp % m.kv_heads:
            raise ConfigError(f"TP {self.tp} does not divide {m.kv_heads} KV heads of {m.name}")
        if self.resolved_block_size <= 0:
            raise ConfigError("block_size must be positive")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold must be >= 0 (0: off)")
        object.__setattr__(self, "_kv_tokens", self._compute_kv_capacity_tokens())
        object.__setattr__(
            self,
            "_blocks",
            self.num_gpu_blocks_override or self._kv_tokens // self.resolved_block_size,
        )
        if self.gpu_key == "cpu" and self.resolved_block_size % 32:
            raise ConfigError("vLLM's CPU backend needs a block size that is a multiple of 32")
        if self.num_gpu_blocks < 2:
            raise ConfigError(
                f"{m.name} does not fit on {self.tp} x {g.name} at "
                f"gpu_memory_utilization={self.gpu_memory_utilization}"
            )

    # -- identity ----------------------------------------------------------------------------
    @property
    def gpu(self) -> GpuSpec:
        return gpu(self.gpu_key)

    @property
    def model(self) -> ModelSpec:
        return model(self.model_key)

    @property
    def label(self) -> str:
        return f"{self.model_key} TP{self.tp} on {self.gpu_key}"

    # -- vLLM defaults -------------------------------------------------------------------------
    @property
    def resolved_block_size(self) -> int:
        if self.block_size:
            return self.block_size
        return 32 if self.gpu_key == "cpu" else 16

    @property
    def resolved_max_num_seqs(self) -> int:
        if self.max_num_seqs:
            return self.max_num_seqs
        return 1024 if self.gpu.large_memory_class else 256

    @property
    def resolved_max_num_batched_tokens(self) -> int:
        if self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        return 8192 if self.gpu.large_memory_class else 2048

    @property
    def resolved_max_model_len(self) -> int:
        return self.max_model_len or self.model.max_context

    @property
    def resolved_step_overhead_s(self) -> float:
        if self.step_overhead_s >= 0:
            return self.step_overhead_s
        calibrated = CALIBRATED_STEP_OVERHEAD_S.get((self.model_key, self.tp))
        return self.gpu.step_overhead_s if calibrated is None else calibrated

    # -- memory ------------------------------------------------------------------------------
    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.model.weight_bytes / self.tp

    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        """KV heads shard across TP; beyond one head per GPU vLLM replicates them."""
        m = self.model
        return m.kv_bytes_per_token * max(1, m.kv_heads // self.tp) / m.kv_heads

    @property
    def kv_capacity_tokens(self) -> int:
        return self._kv_tokens

    def _compute_kv_capacity_tokens(self) -> int:
        if self.num_gpu_blocks_override:
            return self.num_gpu_blocks_override * self.resolved_block_size
        if self.kv_cache_bytes or self.gpu_key == "cpu":
            space = self.kv_cache_bytes or CPU_DEFAULT_KV_CACHE_BYTES
            return int(space // self.model.kv_bytes_per_token)
        free = (
            self.gpu.memory_bytes * self.gpu_memory_utilization
            - self.weight_bytes_per_gpu
            - ACTIVATION_RESERVE_BYTES
        )
        return max(0, int(free // self.kv_bytes_per_token_per_gpu))

    @property
    def num_gpu_blocks(self) -> int:
        return self._blocks

    def with_overrides(self, **changes: object) -> EngineProfile:
        return replace(self, **changes)  # type: ignore[arg-type]


def profile(
    gpu_key: str = "h100", model_key: str = "llama-3.1-8b", tp: int = 1, **knobs: object
) -> EngineProfile:
    """Build a profile by short names: `profile("h100", "llama-3.1-8b", tp=1)`."""
    gpu(gpu_key)
    model(model_key)
    return EngineProfile(gpu_key=gpu_key.lower(), model_key=model_key.lower(), tp=tp, **knobs)  # type: ignore[arg-type]
