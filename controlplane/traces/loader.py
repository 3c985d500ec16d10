"""One entry point for every trace: `load_trace(spec)`, and `trace_stats(trace)`.

A spec is, in this order of precedence:

1. `gen:<generator>?key=value&key=value`: a synthetic workload from `generators.GENERATORS`
   (`gen:shared-prefix?groups=20&prefix=6000&rate=5&seed=1`). Keys are the generator's keyword
   arguments (`-` may stand for `_`); each value is converted to the type of that argument's
   default (int, float, bool as 1/0/true/false/yes/no, or str).
2. A short name: `mooncake` (settings.mooncake_trace), `azure-code` (settings.azure_code_trace):
   when the file is missing, the bundled fixture excerpt is used and a warning is logged;
   `mooncake-fixture` / `azure-code-fixture` name the fixtures directly.
3. A path. The format comes from the extension (`.jsonl` / `.json`: Mooncake, `.csv`: Azure)
   or, failing that, from the first non-blank character (`{`: Mooncake, else a CSV header
   naming TIMESTAMP: Azure). A missing file or an unknown format raises `TraceError`.

`trace_stats` summarises a trace as numbers.md section 7 does: count, span, rate (requests /
span), input and output mean / p50 / p99 / max (percentiles interpolate linearly between order
statistics, numpy's default), distinct first content ids, and requests per tenant.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qsl

from controlplane.errors import ConfigError, TraceError
from controlplane.settings import Settings, get_settings
from controlplane.traces.azure import load_azure
from controlplane.traces.generators import GENERATORS
from controlplane.traces.model import Trace
from controlplane.traces.mooncake import load_mooncake

logger = logging.getLogger(__name__)

MOONCAKE_FIXTURE = "mooncake_synthetic_head.jsonl"
AZURE_CODE_FIXTURE = "azure_code_2023_head.csv"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def fixture_path(filename: str) -> Path:
    """Filesystem path of a bundled fixture (the package is installed as plain files)."""
    path = Path(str(resources.files("controlplane.traces").joinpath("fixtures", filename)))
    if not path.is_file():
        raise TraceError(f"bundled trace fixture {filename} is missing from the package")
    return path


def load_trace(spec: str, settings: Settings | None = None) -> Trace:
    """Load a trace from a generator spec, a short name or a path (see the module docstring)."""
    spec = spec.strip()
    if spec.startswith("gen:"):
        return generate(spec[4:])
    cfg = settings or get_settings()
    if spec == "mooncake":
        return _real_or_fixture(cfg.mooncake_trace, MOONCAKE_FIXTURE, "mooncake")
    if spec == "azure-code":
        return _real_or_fixture(cfg.azure_code_trace, AZURE_CODE_FIXTURE, "azure-code")
    if spec == "mooncake-fixture":
        return load_mooncake(fixture_path(MOONCAKE_FIXTURE), name="mooncake-fixture")
    if spec == "azure-code-fixture":
        return load_azure(fixture_path(AZURE_CODE_FIXTURE), name="azure-code-fixture")
    return load_path(Path(spec))


def _real_or_fixture(path: Path, fixture: str, name: str) -> Trace:
    if path.is_file():
        loader = load_mooncake if name == "mooncake" else load_azure
        return loader(path, name=name)
    logger.warning("%s trace not found at %s; using the bundled excerpt %s", name, path, fixture)
    return load_trace(f"{name}-fixture")


def load_path(path: Path) -> Trace:
    """Load a trace file, choosing the format by extension or by sniffing its first line."""
    if not path.is_file():
        raise TraceError(f"no trace file at {path}")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return load_mooncake(path)
    if suffix == ".csv":
        return load_azure(path)
    try:
        with path.open(encoding="utf-8-sig") as f:
            first = next((line for line in f if line.strip()), "")
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"cannot read trace {path}: {e}") from e
    if first.lstrip().startswith("{"):
        return load_mooncake(path)
    if "timestamp" in first.lower() and "," in first:
        return load_azure(path)
    raise TraceError(f"{path}: neither Mooncake JSONL nor an Azure CSV")


def generate(spec: str) -> Trace:
    """Run a generator from `<name>?key=value&...` (the part after `gen:`)."""
    name, _, query = spec.partition("?")
    fn = GENERATORS.get(name)
    if fn is None:
        raise ConfigError(f"unknown generator {name!r} (known: {', '.join(sorted(GENERATORS))})")
    kwargs = parse_params(fn, parse_qsl(query, keep_blank_values=True, strict_parsing=False))
    return fn(**kwargs)


def parse_params(fn: Callable[..., Trace], pairs: Sequence[tuple[str, str]]) -> dict[str, object]:
    """Convert `key=value` strings to `fn`'s keyword arguments by the type of each default."""
    params = inspect.signature(fn).parameters
    kwargs: dict[str, object] = {}
    for raw_key, value in pairs:
        key = raw_key.replace("-", "_")
        if key not in params or params[key].default is inspect.Parameter.empty:
            known = ", ".join(p for p in params if params[p].default is not inspect.Parameter.empty)
            raise ConfigError(f"unknown parameter {raw_key!r} for {fn.__name__} (known: {known})")
        kwargs[key] = _convert(value, params[key].default, raw_key)
    return kwargs


def _convert(value: str, default: object, key: str) -> object:
    try:
        if isinstance(default, bool):
            low = value.lower()
            if low not in _TRUE | _FALSE:
                raise ValueError(value)
            return low in _TRUE
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
    except ValueError:
        kind = type(default).__name__
        raise ConfigError(f"parameter {key}={value!r} is not a valid {kind}") from None
    return value


def _percentile(sorted_values: Sequence[int], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default method)."""
    if not sorted_values:
        return 0.0
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _summary(prefix: str, values: Sequence[int]) -> dict[str, float]:
    ordered = sorted(values)
    mean = sum(ordered) / len(ordered) if ordered else 0.0
    return {
        f"{prefix}_mean": mean,
        f"{prefix}_p50": _percentile(ordered, 0.50),
        f"{prefix}_p99": _percentile(ordered, 0.99),
        f"{prefix}_max": float(ordered[-1]) if ordered else 0.0,
    }


def trace_stats(trace: Trace) -> dict[str, object]:
    """Summary statistics of a trace (see the module docstring)."""
    reqs = trace.requests
    span = trace.duration_s
    stats: dict[str, object] = {
        "name": trace.name,
        "requests": len(reqs),
        "span_s": span,
        "rate_rps": len(reqs) / span if span > 0 else 0.0,
    }
    stats.update(_summary("input", [r.prompt_tokens for r in reqs]))
    stats.update(_summary("output", [r.output_tokens for r in reqs]))
    stats["distinct_first_ids"] = len({r.content_ids[0] for r in reqs if r.content_ids})
    stats["tenants"] = dict(Counter(r.tenant for r in reqs))
    return stats
