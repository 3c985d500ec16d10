"""Load Azure LLM inference traces (2023 Splitwise sample; the 2024 week-long files too).

CSV with a header naming `TIMESTAMP`, `ContextTokens` and `GeneratedTokens` (matched without
regard to case or column order; other columns are ignored):

    TIMESTAMP,ContextTokens,GeneratedTokens
    2023-11-16 18:17:03.9799600,4808,10

Timestamps are parsed by hand, because Python's `%f` takes at most 6 fractional digits and the
2023 files have 7. Accepted: `YYYY-MM-DD[ T]HH:MM:SS[.fraction]` with any number of fractional
digits (kept to the nanosecond), and an optional `Z` or `+HH:MM`/`-HH:MM` offset, applied. This
covers the 2024 files' mixed formats (rows with and without a fraction). Each timestamp becomes
an integer count of nanoseconds, so nothing is lost to float rounding of epoch values, and

    arrival_s = (ns - min(ns)) / 1e9

i.e. seconds since the first row (the earliest row, should a file not be sorted; the result is
`Trace.sorted()`, stable, so file order is kept within a tick). Lengths:
`prompt_tokens = max(1, ContextTokens)` and `output_tokens = max(1, GeneratedTokens)` (zeros are
counted in meta; negative or non-integer values raise `TraceError` naming file and line).

The trace has no prefix, session or tenant information: `content_ids` is empty, so every
request's content is unique (overlay tenants with `transform.overlay_tenants`).
"""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Iterable
from datetime import date
from pathlib import Path

from controlplane.errors import TraceError
from controlplane.traces.model import Trace, TraceRequest

_TS = re.compile(
    r"\s*(\d{4})-(\d{1,2})-(\d{1,2})[ T](\d{1,2}):(\d{2}):(\d{2})(?:\.(\d+))?"
    r"\s*(Z|[+-]\d{2}:?\d{2})?\s*$"
)
_COLUMNS = {"timestamp": "TIMESTAMP", "prompt": "ContextTokens", "output": "GeneratedTokens"}


def parse_timestamp_ns(text: str) -> int:
    """Nanoseconds since 0001-01-01 UTC of an Azure trace timestamp; ValueError if malformed."""
    m = _TS.match(text)
    if m is None:
        raise ValueError(f"unrecognised timestamp {text!r}")
    y, mo, d, h, mi, s, frac, tz = m.groups()
    seconds = date(int(y), int(mo), int(d)).toordinal() * 86_400
    seconds += int(h) * 3600 + int(mi) * 60 + int(s)
    if int(h) > 23 or int(mi) > 59 or int(s) > 60:
        raise ValueError(f"time of day out of range in {text!r}")
    if tz and tz != "Z":
        sign = -1 if tz[0] == "-" else 1
        digits = tz[1:].replace(":", "")
        seconds -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    nanos = int((frac or "0")[:9].ljust(9, "0"))
    return seconds * 1_000_000_000 + nanos


def load_azure(path: str | os.PathLike[str], *, name: str | None = None) -> Trace:
    """Read an Azure LLM inference CSV into a sorted `Trace` (see the module docstring)."""
    p = Path(path)
    try:
        with p.open(encoding="utf-8-sig", newline="") as f:
            return parse_azure(f, source=str(p), name=name or p.stem)
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"cannot read Azure trace {p}: {e}") from e


def parse_azure(lines: Iterable[str], *, source: str = "<memory>", name: str = "azure") -> Trace:
    """Parse Azure CSV lines (header first); `source` names the input in errors and meta."""
    reader = csv.reader(lines)
    header = next(reader, None)
    if header is None:
        raise TraceError(f"{source}: empty file, expected a CSV header")
    index = {col.strip().lower(): i for i, col in enumerate(header)}
    cols: dict[str, int] = {}
    for key, col in _COLUMNS.items():
        if col.lower() not in index:
            raise TraceError(f"{source}:1: header {header!r} lacks column {col}")
        cols[key] = index[col.lower()]
    width = max(cols.values()) + 1
    rows: list[tuple[int, int, int]] = []
    zero_prompts = zero_outputs = 0
    for row in reader:
        lineno = reader.line_num
        if not row or not "".join(row).strip():
            continue
        where = f"{source}:{lineno}"
        if len(row) < width:
            raise TraceError(f"{where}: expected at least {width} columns, got {len(row)}")
        try:
            ns = parse_timestamp_ns(row[cols["timestamp"]])
        except ValueError as e:
            raise TraceError(f"{where}: {e}") from e
        prompt = _count(row[cols["prompt"]], where, _COLUMNS["prompt"])
        output = _count(row[cols["output"]], where, _COLUMNS["output"])
        zero_prompts += prompt == 0
        zero_outputs += output == 0
        rows.append((ns, prompt, output))
    base = min((ns for ns, _, _ in rows), default=0)
    requests = tuple(
        TraceRequest(
            arrival_s=(ns - base) / 1e9, prompt_tokens=max(1, prompt), output_tokens=max(1, out)
        )
        for ns, prompt, out in rows
    )
    meta: dict[str, object] = {
        "format": "azure",
        "source": source,
        "clamped_zero_prompts": zero_prompts,
        "clamped_zero_outputs": zero_outputs,
    }
    return Trace(name=name, requests=requests, meta=meta).sorted()


def _count(text: str, where: str, column: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise TraceError(f"{where}: {column} must be an integer, got {text!r}") from None
    if value < 0:
        raise TraceError(f"{where}: {column} must be non-negative, got {value}")
    return value
