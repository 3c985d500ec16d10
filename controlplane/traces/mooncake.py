"""Load Mooncake JSONL traces (FAST'25 release: `synthetic_trace.jsonl`, toolagent, conversation).

One JSON object per line:

    {"timestamp": 0, "input_length": 40160, "output_length": 6, "hash_ids": [0, 1, ..., 78]}

- `timestamp`: arrival in milliseconds, relative to the start of the trace; equal values occur.
- `input_length` / `output_length`: prompt and generated tokens (no text).
- `hash_ids`: chained ids of `block_tokens` (512) -token blocks: equal id at position i means
  equal content for the first (i + 1) * 512 tokens; the last block is usually partial.

Each line becomes

    TraceRequest(arrival_s=timestamp / 1000, prompt_tokens=input_length,
                 output_tokens=max(1, output_length), content_ids=tuple(hash_ids),
                 id_block_tokens=block_tokens)

and the result is `Trace(...).sorted()`: a stable sort, so file order is kept within equal
timestamps, and request ids become `<name>-<line index>`.

Validation, per line (errors name the file and the 1-based line number; blank lines are skipped):
bad JSON, a non-object, a missing field, a non-numeric or negative timestamp, a non-integer or
negative length, an empty prompt, and non-integer or negative ids raise `TraceError`.
The id count is checked against `expected = ceil(input_length / block_tokens)`:

- more ids than `expected` raises `TraceError`: the file was almost certainly written at a finer
  block granularity (e.g. 16-token SipHash ids) and treating its ids as 512-token blocks would
  claim sharing that does not exist; pass the right `block_tokens`;
- fewer ids are accepted (one warning with the count of such lines is logged): the tokens the ids
  do not reach are content nobody shares, which is exactly how `TraceRequest` treats them.

The real synthetic trace satisfies `len(hash_ids) == expected` on all 3,993 lines.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable
from pathlib import Path

from controlplane.errors import TraceError
from controlplane.traces.model import Trace, TraceRequest

logger = logging.getLogger(__name__)

MOONCAKE_BLOCK_TOKENS = 512
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


def load_mooncake(
    path: str | os.PathLike[str],
    *,
    name: str | None = None,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> Trace:
    """Read a Mooncake JSONL file into a sorted `Trace` (see the module docstring)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"cannot read Mooncake trace {p}: {e}") from e
    return parse_mooncake(
        text.splitlines(), source=str(p), name=name or p.stem, block_tokens=block_tokens
    )


def parse_mooncake(
    lines: Iterable[str],
    *,
    source: str = "<memory>",
    name: str = "mooncake",
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> Trace:
    """Parse Mooncake JSONL lines; `source` only names the input in error messages and meta."""
    if block_tokens <= 0:
        raise TraceError(f"block_tokens must be positive, got {block_tokens}")
    requests: list[TraceRequest] = []
    short_ids = 0
    first_short = 0
    clamped_outputs = 0
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not valid JSON ({e.msg})") from e
        req, short = _parse_record(obj, where, block_tokens)
        if short:
            short_ids += 1
            first_short = first_short or lineno
        if req.output_tokens != obj["output_length"]:
            clamped_outputs += 1
        requests.append(req)
    if short_ids:
        logger.warning(
            "%s: %d line(s) carry fewer hash_ids than ceil(input_length/%d) (first: line %d); "
            "their undescribed tail is treated as unshared content",
            source,
            short_ids,
            block_tokens,
            first_short,
        )
    meta: dict[str, object] = {
        "format": "mooncake",
        "source": source,
        "block_tokens": block_tokens,
        "short_hash_ids_lines": short_ids,
        "clamped_zero_outputs": clamped_outputs,
    }
    return Trace(name=name, requests=tuple(requests), meta=meta).sorted()


def _parse_record(obj: object, where: str, block_tokens: int) -> tuple[TraceRequest, bool]:
    """One validated request, and whether it carries fewer ids than its prompt needs."""
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [f for f in _FIELDS if f not in obj]
    if missing:
        raise TraceError(f"{where}: missing field(s) {', '.join(missing)}")
    ts = obj["timestamp"]
    if type(ts) not in (int, float) or not math.isfinite(ts) or ts < 0:
        raise TraceError(f"{where}: timestamp must be a non-negative number of ms, got {ts!r}")
    prompt = obj["input_length"]
    output = obj["output_length"]
    if type(prompt) is not int or prompt < 1:
        raise TraceError(f"{where}: input_length must be a positive integer, got {prompt!r}")
    if type(output) is not int or output < 0:
        raise TraceError(f"{where}: output_length must be a non-negative integer, got {output!r}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
        raise TraceError(f"{where}: hash_ids must be a list of non-negative integers")
    expected = -(-prompt // block_tokens)
    if len(ids) > expected:
        raise TraceError(
            f"{where}: {len(ids)} hash_ids for {prompt} tokens, more than "
            f"ceil({prompt}/{block_tokens}) = {expected}; is the block size right?"
        )
    req = TraceRequest(
        arrival_s=ts / 1000.0,
        prompt_tokens=prompt,
        output_tokens=max(1, output),
        content_ids=tuple(ids),
        id_block_tokens=block_tokens,
    )
    return req, len(ids) < expected
