"""Option parsing shared by commands: traces with their transforms, engine profiles."""

from __future__ import annotations

from controlplane.errors import ConfigError
from controlplane.roofline.profile import EngineProfile, profile
from controlplane.traces import densest_window, head, load_trace, scale_rate, window
from controlplane.traces.model import Trace


def build_profile(
    gpu: str, model: str, tp: int, block_size: int = 0, num_gpu_blocks: int = 0
) -> EngineProfile:
    return profile(gpu, model, tp=tp, block_size=block_size, num_gpu_blocks_override=num_gpu_blocks)


def build_trace(
    spec: str,
    *,
    rate_scale: float = 1.0,
    window_spec: str = "",
    densest: int = 0,
    max_requests: int = 0,
    seed: int | None = None,
) -> Trace:
    if spec.startswith("gen:") and seed is not None and "seed=" not in spec:
        spec = f"{spec}{'&' if '?' in spec else '?'}seed={seed}"
    trace = load_trace(spec)
    if window_spec:
        try:
            start, end = (float(x) for x in window_spec.split(":"))
        except ValueError:
            raise ConfigError(
                f"--window expects START:END in seconds, got {window_spec!r}"
            ) from None
        trace = window(trace, start, end)
    if densest:
        trace = densest_window(trace, requests=densest)
    if max_requests:
        trace = head(trace, max_requests)
    if rate_scale != 1.0:
        if rate_scale <= 0:
            raise ConfigError("--rate-scale must be positive")
        trace = scale_rate(trace, rate_scale)
    if not len(trace):
        raise ConfigError("the selected trace has no requests")
    return trace
