"""Which replicas an indexer follows: `ReplicaSource`, from option strings or a YAML file.

Option form (repeatable `--replica`), comma-separated `key=value` pairs:

    id=r0,events=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558,topic=kv,block_size=32,model=tiny

YAML form: a list of mappings with the same keys, or `{replicas: [...]}`:

    replicas:
      - {id: r0, events: "tcp://10.0.0.5:5557", replay: "tcp://10.0.0.5:5558",
         topic: kv, block_size: 32, model: tiny}

`id`, `events` and `model` are required; `replay` (no replay endpoint: every gap is a loss),
`topic` (""), `block_size` (None: each event's own) and `incarnation` (None: the indexer picks)
are optional. Endpoints are ZMQ addresses the indexer *connects* to (the replica binds
`tcp://*:port`, vLLM's default).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from controlplane.errors import ConfigError

_SCHEMES = ("tcp://", "ipc://", "inproc://")
_KEYS = ("id", "events", "replay", "topic", "block_size", "model", "incarnation")


@dataclass(frozen=True, slots=True)
class ReplicaSource:
    replica_id: str
    events: str
    model: str
    replay: str | None = None
    topic: str = ""
    block_size: int | None = None
    incarnation: int | None = None


def _endpoint(value: object, key: str, rid: str) -> str:
    if not isinstance(value, str) or not value.startswith(_SCHEMES):
        raise ConfigError(f"replica {rid}: {key} must be a tcp://, ipc:// or inproc:// address")
    if "*" in value:
        raise ConfigError(f"replica {rid}: {key} is a bind address ({value}); give host:port")
    return value


def _opt_int(value: object, key: str, rid: str, minimum: int) -> int | None:
    if value is None or value == "":
        return None
    try:
        n = int(str(value))
    except ValueError:
        raise ConfigError(f"replica {rid}: {key} must be an integer, got {value!r}") from None
    if n < minimum:
        raise ConfigError(f"replica {rid}: {key} must be >= {minimum}")
    return n


def source_from_mapping(raw: Mapping[str, Any]) -> ReplicaSource:
    unknown = sorted(set(raw) - set(_KEYS))
    rid = str(raw.get("id") or "")
    if unknown:
        raise ConfigError(f"replica {rid or '?'}: unknown keys {', '.join(unknown)}")
    if not rid:
        raise ConfigError("every replica needs an id")
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        raise ConfigError(f"replica {rid}: model is required")
    replay = raw.get("replay")
    topic = raw.get("topic")
    return ReplicaSource(
        replica_id=rid,
        events=_endpoint(raw.get("events"), "events", rid),
        model=model,
        replay=None if replay in (None, "") else _endpoint(replay, "replay", rid),
        topic="" if topic is None else str(topic),
        block_size=_opt_int(raw.get("block_size"), "block_size", rid, 1),
        incarnation=_opt_int(raw.get("incarnation"), "incarnation", rid, 0),
    )


def parse_replica_spec(spec: str) -> ReplicaSource:
    """`id=r0,events=tcp://h:5557,...` → `ReplicaSource`."""
    raw: dict[str, str] = {}
    for part in spec.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep:
            raise ConfigError(f"--replica expects key=value pairs, got {part!r} in {spec!r}")
        raw[key.strip()] = value.strip()
    return source_from_mapping(raw)


def load_replica_file(path: Path) -> list[ReplicaSource]:
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if isinstance(doc, Mapping):
        doc = doc.get("replicas")
    if not isinstance(doc, list) or not all(isinstance(r, Mapping) for r in doc):
        raise ConfigError(f"{path}: expected a list of replicas (or `replicas:` with one)")
    return [source_from_mapping(r) for r in doc]


def check_unique(sources: Iterable[ReplicaSource]) -> list[ReplicaSource]:
    out = list(sources)
    seen: set[str] = set()
    for s in out:
        if s.replica_id in seen:
            raise ConfigError(f"replica id {s.replica_id} appears twice")
        seen.add(s.replica_id)
    return out
