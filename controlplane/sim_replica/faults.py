"""Fault knobs of the simulated replica, for testing routers against replicas that misbehave.

Each knob is a field of `Faults`. They are set at start with `--fault NAME[=VALUE]` (repeatable)
and at runtime with `POST /_faults` (a JSON object of the same names; `{"reset": true}` clears
every knob first), which needs `Authorization: Bearer <--admin-token>`.

- `unavailable` (bool): `/v1/completions` and `/v1/chat/completions` answer 503
  (`ServiceUnavailableError`).
- `hang_before_headers` (bool): those requests get no response at all (no status line) until
  the client goes away.
- `hang_after_chunks` (int k): a stream sends its first k SSE events, then nothing while the
  connection stays open; a non-streaming request hangs before its headers.
- `die_after_chunks` (int k): the process exits (status 1, no cleanup) once a stream has sent k
  SSE events; with k = 0, on the next generation request before answering it.
- `slow_factor` (float): every engine step takes this many times longer.
- `stall` (bool): the engine loop stops stepping (requests queue, streams freeze); `/health`
  answers 503.
- `lie_health` (bool): `/health` answers 200 even while the engine is stalled or its loop died.
- `refuse_s` (float): close the listening socket and every open connection (new connections
  are refused) for this many seconds, then listen again; `inf` for good. An action, not a
  state: it reads back as 0 once the server has acted.

An SSE event is one `data:` line (the role chunk, each content chunk, the usage chunk and
`[DONE]` each count). `-1` (or `false`, `0` for `slow_factor` = 1) switches a knob off.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from controlplane.errors import ConfigError

_BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True}
_BOOL_WORDS |= {"0": False, "false": False, "no": False, "off": False}


@dataclass(slots=True)
class Faults:
    """The fault knobs now in force (mutated in place by the admin endpoint)."""

    unavailable: bool = False
    hang_before_headers: bool = False
    # < 0: off
    hang_after_chunks: int = -1
    die_after_chunks: int = -1
    slow_factor: float = 1.0
    stall: bool = False
    lie_health: bool = False
    # > 0: refuse connections for that long (set once; the server clears it when it acts)
    refuse_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if math.isinf(self.refuse_s):
            out["refuse_s"] = "inf"
        return out

    def update(self, changes: dict[str, Any]) -> None:
        """Apply a `POST /_faults` body (or parsed `--fault` flags); raises ConfigError."""
        if changes.get("reset"):
            self.reset()
        known = {f.name: f.type for f in fields(self)}
        parsed: dict[str, Any] = {}
        for name, value in changes.items():
            if name == "reset":
                continue
            kind = known.get(name)
            if kind is None:
                raise ConfigError(f"unknown fault {name!r}; known: {', '.join(known)}")
            parsed[name] = _coerce(name, str(kind), value)
        for name, value in parsed.items():
            setattr(self, name, value)

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default)


def _coerce(name: str, kind: str, value: Any) -> Any:
    if kind == "bool":
        if isinstance(value, bool):
            return value
        word = str(value).strip().lower()
        if word in _BOOL_WORDS:
            return _BOOL_WORDS[word]
        raise ConfigError(f"fault {name} expects true/false, got {value!r}")
    try:
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"fault {name} expects a number, got {value!r}") from None
    if math.isnan(number) or number < 0:
        raise ConfigError(f"fault {name} must be >= 0, got {value!r}")
    if name == "slow_factor" and number <= 0:
        raise ConfigError("fault slow_factor must be positive")
    return number


def parse_fault_flags(specs: list[str]) -> dict[str, Any]:
    """`--fault NAME[=VALUE]` flags as a `Faults.update` body (a bare NAME means true; dashes
    and underscores are interchangeable)."""
    out: dict[str, Any] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        key = name.strip().replace("-", "_")
        if not key:
            raise ConfigError(f"bad --fault {spec!r}: expected NAME or NAME=VALUE")
        out[key] = value.strip() if sep else True
    return out
