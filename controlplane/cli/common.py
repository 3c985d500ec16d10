"""Option parsing shared by commands: traces with their transforms, engine profiles."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console

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


def rerun_compiled(dest: Path, launch: list[str], console: Console) -> None:
    """Re-run this command (`python launch...` with this process's arguments less --native) on
    the simulator compiled with mypyc (controlplane.sim.native: the same source, replays
    bit-identical), built into `dest` when stale; never returns. Returns, after saying why,
    where it cannot be built (no mypyc or C compiler): the caller goes on in pure Python."""
    from controlplane.sim.native import available, ensure_built, exec_compiled

    why = available()
    if why is not None:
        console.print(f"[yellow]--native: {why}; running the pure-Python simulator[/]")
        return
    with console.status("building the compiled simulator (mypyc, about 30 s)"):
        ensure_built(dest)
    exec_compiled(dest, [*launch, *(a for a in sys.argv[1:] if a != "--native")])
