"""Published measurements the roofline is calibrated and validated against.

Each `Anchor` holds a figure someone measured on real hardware and a function that computes the same
figure from this project's model. The test suite holds every anchor within `TOLERANCE`; the
benchmark `bench/roofline_fidelity.py` prints the same table for the docs.

Sources:
- vidur (microsoft/vidur, MIT): per-operator medians from `data/profiling/compute/*/mlp.csv`,
  summing the four linear kernels (QKV, O, up/gate, down) per layer. Figures below are the medians
  over all rows at that token count and TP degree (recomputed by `vidur_linear_medians`). The
  efficiency factors are calibrated on the TP1 profiles of a 7-8B model (H100 and A100), the
  shapes this project simulates most; the 70B and TP > 1 profiles are *held out* and shown with
  their error: a single roofline cannot follow both the 7B and the 70B knee near 256 tokens
  (small GEMMs reach 40% of peak there, large ones 62%), and at TP >= 4 a 7B layer is so small that
  kernel latency floors dominate.
- vLLM nightly benchmarks (buildkite vllm/performance-benchmark build 9515): `latency_llama8B_tp1`
  and `latency_llama70B_tp4` on H200, 32 input / 128 output tokens, batch 8. These two *fit* the
  per-step CPU overhead (`CALIBRATED_STEP_OVERHEAD_S`); they are listed so the fit stays honest.
- vLLM startup logs: KV capacity of a Llama-2-7B-class model on H100 at 0.9 (GIE PR #550,
  "# cuda blocks: 7191"), and llm-d's B2B benchmark (307,328 KV tokens per Qwen3-32B TP2 pod).
"""

from __future__ import annotations

import csv
import functools
import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from controlplane.roofline.profile import EngineProfile, profile
from controlplane.roofline.specs import GPUS, MODELS
from controlplane.roofline.step import SMOOTH_P, StepCostModel

TOLERANCE = 0.15


@dataclass(frozen=True, slots=True)
class Anchor:
    """One published figure and how the model computes the same quantity."""

    source: str
    setting: str
    quantity: str
    unit: str
    measured: float
    model: Callable[[], float]
    fitted: bool = False  # True when this anchor was used to fit a constant
    held_out: bool = False  # shown beside the model, outside the calibration set

    @property
    def within_tolerance(self) -> bool:
        return abs(self.error()) <= TOLERANCE

    def modelled(self) -> float:
        return self.model()

    def error(self) -> float:
        return self.modelled() / self.measured - 1.0


def linear_layer_ms(gpu_key: str, model_key: str, tp: int, tokens: int) -> float:
    """Model time of the four linear kernels of one layer, in ms (vidur's `mlp.csv` scope)."""
    g, m = GPUS[gpu_key], MODELS[model_key]
    d, hd = m.hidden, m.head_dim
    linear_params = (d * m.attn_width * 2 + d * m.kv_heads * hd * 2 + 3 * d * m.intermediate) / tp
    mem = linear_params * m.dtype_bytes / (g.eta_bw * g.bandwidth_bps)
    comp = 2 * linear_params * tokens / (g.eta_compute * g.flops_bf16)
    p = SMOOTH_P
    return float((mem**p + comp**p) ** (1.0 / p)) * 1e3


def latency_benchmark_s(prof: EngineProfile, input_len: int, output_len: int, batch: int) -> float:
    """vLLM's `benchmark_latency`: one prefill step for the batch, then output_len - 1 decodes."""
    cost = StepCostModel.from_profile(prof)
    n = input_len * batch
    pairs = batch * (input_len * (input_len + 1) / 2)
    total = cost.step_time(n, n, pairs, batch)
    for j in range(output_len - 1):
        total += cost.decode_step_time(batch, batch * (input_len + j))
    return total


# vidur medians (ms per layer, four linear kernels), recomputed by vidur_linear_medians()
VIDUR_LINEAR_MS: dict[tuple[str, str, int], dict[int, float]] = {
    ("h100", "llama-2-7b", 1): {
        1: 0.156,
        8: 0.152,
        64: 0.162,
        128: 0.180,
        256: 0.260,
        512: 0.329,
        1024: 0.565,
        2048: 1.083,
        4096: 2.213,
    },
    ("h100", "llama-2-7b", 2): {512: 0.189, 1024: 0.311, 2048: 0.573, 4096: 1.101},
    ("h100", "llama-2-7b", 4): {1024: 0.186, 2048: 0.317, 4096: 0.571},
    ("h100", "llama-2-7b", 8): {2048: 0.185, 4096: 0.317},
    ("h100", "llama-2-70b", 1): {
        1: 0.593,
        8: 0.575,
        64: 0.600,
        128: 0.611,
        256: 0.719,
        512: 1.169,
        1024: 2.759,
        2048: 4.947,
        4096: 10.163,
    },
    ("h100", "llama-2-70b", 2): {1: 0.294, 64: 0.310, 256: 0.376, 1024: 1.327, 4096: 4.928},
    ("h100", "llama-2-70b", 4): {1: 0.159, 64: 0.170, 256: 0.215, 1024: 0.688, 4096: 2.377},
    ("h100", "llama-2-70b", 8): {1: 0.087, 64: 0.093, 256: 0.121, 1024: 0.332, 4096: 1.175},
    ("a100", "llama-3-8b", 1): {
        1: 0.276,
        8: 0.286,
        64: 0.324,
        128: 0.377,
        256: 0.554,
        512: 0.994,
        1024: 2.175,
        2048: 4.128,
        4096: 7.828,
    },
}

VIDUR_FILES = {
    ("h100", "llama-2-7b"): "h100/meta-llama/Llama-2-7b-hf/mlp.csv",
    ("h100", "llama-2-70b"): "h100/meta-llama/Llama-2-70b-hf/mlp.csv",
    ("a100", "llama-3-8b"): "a100/meta-llama/Meta-Llama-3-8B/mlp.csv",
}
LINEAR_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")


def vidur_linear_medians(compute_dir: Path) -> dict[tuple[str, str, int], dict[int, float]]:
    """Recompute `VIDUR_LINEAR_MS` from vidur's CSVs (for the benchmark's provenance check)."""
    out: dict[tuple[str, str, int], dict[int, float]] = {}
    for (gpu_key, model_key), rel in VIDUR_FILES.items():
        samples: dict[tuple[int, int], list[float]] = defaultdict(list)
        with (compute_dir / rel).open() as fh:
            for row in csv.DictReader(fh):
                tp, tokens = int(row["num_tensor_parallel_workers"]), int(row["num_tokens"])
                ms = sum(float(row[f"time_stats.{op}.median"]) for op in LINEAR_OPS)
                samples[(tp, tokens)].append(ms)
        for (tp, tokens), values in samples.items():
            key = (gpu_key, model_key, tp)
            if key in VIDUR_LINEAR_MS and tokens in VIDUR_LINEAR_MS[key]:
                out.setdefault(key, {})[tokens] = round(statistics.median(values), 3)
    return out


def _vidur_anchors() -> list[Anchor]:
    anchors = []
    for (gpu_key, model_key, tp), points in VIDUR_LINEAR_MS.items():
        held_out = tp > 1 or model_key == "llama-2-70b"
        for tokens, ms in points.items():
            anchors.append(
                Anchor(
                    source=f"vidur {VIDUR_FILES[(gpu_key, model_key)]}",
                    setting=f"{gpu_key.upper()} {model_key} TP{tp}, {tokens} tokens",
                    quantity="linear layers per layer",
                    unit="ms",
                    measured=ms,
                    model=functools.partial(linear_layer_ms, gpu_key, model_key, tp, tokens),
                    held_out=held_out,
                )
            )
    return anchors


def anchors() -> list[Anchor]:
    """Every anchor, vidur points first; `held_out` ones are reported, not calibrated on."""
    h200_8b = profile("h200", "llama-3.1-8b", tp=1)
    h200_70b = profile("h200", "llama-3.1-70b", tp=4)
    return [
        *_vidur_anchors(),
        Anchor(
            source="vLLM nightly latency_llama8B_tp1 (buildkite 9515)",
            setting="H200 Llama-3.1-8B TP1, in 32 / out 128, batch 8",
            quantity="request latency",
            unit="ms",
            measured=833.4,
            model=lambda: latency_benchmark_s(h200_8b, 32, 128, 8) * 1e3,
            fitted=True,
        ),
        Anchor(
            source="vLLM nightly latency_llama70B_tp4 (buildkite 9515)",
            setting="H200 Llama-3-70B TP4, in 32 / out 128, batch 8",
            quantity="request latency",
            unit="ms",
            measured=2077.5,
            model=lambda: latency_benchmark_s(h200_70b, 32, 128, 8) * 1e3,
            fitted=True,
        ),
        Anchor(
            source="vLLM startup log (gateway-api-inference-extension PR #550)",
            setting="H100 Llama-2-7B-class (MHA) TP1, util 0.9, block 16",
            quantity="num_gpu_blocks",
            unit="blocks",
            measured=7191,
            model=lambda: float(profile("h100", "llama-2-7b").num_gpu_blocks),
        ),
        Anchor(
            source="llm-d B2B benchmark (llm-d-kv-cache benchmarking/73-capacity)",
            setting="H100 Qwen3-32B TP2, util 0.9",
            quantity="KV tokens per pod",
            unit="tokens",
            measured=307_328,
            model=lambda: float(profile("h100", "qwen3-32b", tp=2).kv_capacity_tokens),
        ),
    ]
