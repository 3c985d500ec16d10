"""vLLM KV-event wire format: event types, a tolerant decoder and a byte-exact encoder.

A vLLM publisher sends one ZMQ message per scheduler step that produced events, three frames:
`[topic, seq (8 bytes, big-endian, unsigned), payload]`, where the payload is a msgpack
`KVEventBatch`. Reference: vLLM 0.33.0 (`vllm/distributed/kv_events.py`), and
`/work/shared/reference/vllm-interfaces.md` §2.

**Encodings.** The batch is always a positional array `[ts, events, data_parallel_rank]` (two
elements from releases that predate the rank). Events come in two shapes:

- *map-shaped* (0.33.0; `tag=True, omit_defaults=True`): a msgpack map whose first key is
  `"type"` (the class name), then the fields in declaration order. Fields without a default are
  always written, even when nil; fields with a default are omitted when equal to it.
- *legacy positional* (before vllm PR #42892; `array_like=True, tag=True`): an array whose
  element 0 is the class name and whose other elements are every declared field by position
  (BlockStored grew from 6 to 12 elements over time; BlockRemoved from 2 to 4).

**Decoding** (`decode_batch`) is generic, as vLLM's own consumers learned to do after every
schema change broke a typed decoder: msgpack → Python objects, then

1. the batch may be a list (positional) or a dict (one main-branch commit map-encoded it);
2. each event may be a dict (tag at `"type"`, fields by name, unknown keys ignored) or a list
   (tag at `[0]`, fields by index, missing trailing positions = nil, extra positions ignored);
3. block hashes may be unsigned ints (default), signed ints (very old releases) or raw digests
   (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`); all are normalised to the u64 of the last 8 bytes;
4. events with an unknown tag are skipped and counted in `WireBatch.unknown_events`;
   a payload that is not msgpack, or a known event missing a required field, raises
   `KVEventDecodeError`.

**Encoding** (`encode_batch`) goes through msgspec Structs that mirror vLLM's declarations, so
the bytes are exactly what vLLM 0.33.0 writes (for instance, BlockStored's map header is always
map16, because msgspec sizes it for 16 possible keys and patches the count). Hashes are always
written as u64 ints (the digest form cannot be reproduced from a normalised int). The legacy form
writes the 12-field BlockStored and the 4-field BlockRemoved.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final, TypeAlias

import msgspec

from controlplane.errors import ControlPlaneError
from controlplane.hashing import normalize_event_hash

# the end-of-replay marker: (-1).to_bytes(8, "big", signed=True)
END_SEQ: Final = b"\xff" * 8
U64_MASK: Final = (1 << 64) - 1
MEDIUM_GPU: Final = "GPU"


class KVEventDecodeError(ControlPlaneError, ValueError):
    """A payload or frame that is not a KV-event batch this decoder understands."""


def _freeze(value: object) -> object:
    """Lists (as msgpack decodes arrays) to tuples, recursively, so events are hashable."""
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


# -- event types -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WireBlockStored:
    """The replica stored full blocks (`BlockStored`). Sequences are stored as tuples."""

    TYPE: ClassVar[str] = "BlockStored"

    # normalised u64 hashes of the stored blocks, in chain order
    block_hashes: Sequence[int]
    # hash of the block before the first stored one; None when the event starts at block 0
    parent_block_hash: int | None
    # tokens of all blocks in the event (len = len(block_hashes) * block_size for plain models)
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None = None
    # "GPU" from the GPU block pool; "CPU"/"STORAGE" from offloading connectors
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    # one entry per block: None or a tuple (LoRA, cache salt, multimodal identifiers)
    extra_keys: Sequence[object] | None = None
    # KV-cache group (0 for a plain model); hybrid models emit one event per group
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: Sequence[Sequence[int]] | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "block_hashes", tuple(normalize_event_hash(h) for h in self.block_hashes))
        if self.parent_block_hash is not None:
            set_(self, "parent_block_hash", normalize_event_hash(self.parent_block_hash))
        set_(self, "token_ids", tuple(int(t) for t in self.token_ids))
        if self.extra_keys is not None:
            set_(self, "extra_keys", _freeze(self.extra_keys))
        if self.lookahead_token_ids is not None:
            set_(self, "lookahead_token_ids", _freeze(self.lookahead_token_ids))


@dataclass(frozen=True, slots=True)
class WireBlockRemoved:
    """The replica evicted blocks (`BlockRemoved`; vLLM sends one hash per event)."""

    TYPE: ClassVar[str] = "BlockRemoved"

    block_hashes: Sequence[int]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None

    def __post_init__(self) -> None:
        hashes = tuple(normalize_event_hash(h) for h in self.block_hashes)
        object.__setattr__(self, "block_hashes", hashes)


@dataclass(frozen=True, slots=True)
class WireAllBlocksCleared:
    """The replica reset its prefix cache (`AllBlocksCleared`)."""

    TYPE: ClassVar[str] = "AllBlocksCleared"


WireEvent: TypeAlias = WireBlockStored | WireBlockRemoved | WireAllBlocksCleared


@dataclass(frozen=True, slots=True)
class WireBatch:
    """One published batch (`KVEventBatch`): the events of one scheduler step."""

    ts: float
    events: Sequence[WireEvent]
    # the 0.33.0 publisher always sets it (0 without data parallelism); None = absent on the wire
    data_parallel_rank: int | None = 0
    # decoding only: events whose tag this decoder does not know (skipped)
    unknown_events: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "events", tuple(self.events))


# -- decoding --------------------------------------------------------------------------------

# legacy positional layouts: field name per index (index 0 is the tag)
_LEGACY_FIELDS: Final[dict[str, tuple[str, ...]]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
_STORED_OPTIONAL: Final = (
    "lora_id",
    "lora_name",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
)


def _hash(value: object, what: str) -> int:
    if isinstance(value, bytes | bytearray):
        return normalize_event_hash(bytes(value))
    if isinstance(value, bool) or not isinstance(value, int):
        raise KVEventDecodeError(f"{what}: expected an int or bytes hash, got {value!r:.60}")
    return normalize_event_hash(value)


def _hashes(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise KVEventDecodeError(f"{what}: expected a list of hashes, got {value!r:.60}")
    return tuple(_hash(v, what) for v in value)


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KVEventDecodeError(f"{what}: expected an int, got {value!r:.60}")
    return value


def _opt_int(value: object, what: str) -> int | None:
    return None if value is None else _int(value, what)


def _opt_str(value: object, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    raise KVEventDecodeError(f"{what}: expected a string, got {value!r:.60}")


def _fields(raw: object) -> tuple[str | None, dict[str, Any]]:
    """(tag, fields by name) of a map-shaped or positional event."""
    if isinstance(raw, Mapping):
        tag = raw.get("type")
        return (tag if isinstance(tag, str) else None), dict(raw)
    if isinstance(raw, list | tuple) and raw:
        tag = raw[0]
        if not isinstance(tag, str):
            return None, {}
        names = _LEGACY_FIELDS.get(tag, ())
        return tag, dict(zip(names, raw[1:], strict=False))
    return None, {}


def _require(fields: Mapping[str, Any], name: str, tag: str) -> Any:
    if name not in fields:
        raise KVEventDecodeError(f"{tag}: missing required field {name!r}")
    return fields[name]


def _decode_event(raw: object) -> WireEvent | None:
    tag, f = _fields(raw)
    if tag == "BlockStored":
        tokens = _require(f, "token_ids", tag)
        if not isinstance(tokens, list | tuple):
            raise KVEventDecodeError(f"BlockStored.token_ids: expected a list, got {tokens!r:.60}")
        parent = _require(f, "parent_block_hash", tag)
        extra = f.get("extra_keys")
        lookahead = f.get("lookahead_token_ids")
        opt: dict[str, Any] = {}
        for name in _STORED_OPTIONAL:
            value = f.get(name)
            is_int = name in ("lora_id", "group_idx", "kv_cache_spec_sliding_window")
            opt[name] = (_opt_int if is_int else _opt_str)(value, f"BlockStored.{name}")
        return WireBlockStored(
            block_hashes=_hashes(_require(f, "block_hashes", tag), "BlockStored.block_hashes"),
            parent_block_hash=None if parent is None else _hash(parent, "parent_block_hash"),
            token_ids=tuple(_int(t, "BlockStored.token_ids") for t in tokens),
            block_size=_int(_require(f, "block_size", tag), "BlockStored.block_size"),
            medium=_opt_str(f.get("medium"), "BlockStored.medium"),
            extra_keys=None if extra is None else tuple(extra) if isinstance(extra, list) else None,
            lookahead_token_ids=lookahead if isinstance(lookahead, list) else None,
            **opt,
        )
    if tag == "BlockRemoved":
        return WireBlockRemoved(
            block_hashes=_hashes(_require(f, "block_hashes", tag), "BlockRemoved.block_hashes"),
            medium=_opt_str(f.get("medium"), "BlockRemoved.medium"),
            group_idx=_opt_int(f.get("group_idx"), "BlockRemoved.group_idx"),
            locality=_opt_str(f.get("locality"), "BlockRemoved.locality"),
            ownership=_opt_str(f.get("ownership"), "BlockRemoved.ownership"),
        )
    if tag == "AllBlocksCleared":
        return WireAllBlocksCleared()
    return None


def decode_batch(payload: bytes) -> WireBatch:
    """Decode one `KVEventBatch` payload of any known vLLM release (see the module docstring)."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise KVEventDecodeError(f"not a msgpack payload: {exc}") from exc
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict) and "events" in raw:
        ts, events, rank = raw.get("ts", 0.0), raw["events"], raw.get("data_parallel_rank")
    else:
        raise KVEventDecodeError(f"not a KV-event batch: {raw!r:.80}")
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise KVEventDecodeError(f"batch ts: expected a number, got {ts!r:.60}")
    if not isinstance(events, list):
        raise KVEventDecodeError(f"batch events: expected a list, got {events!r:.60}")
    decoded: list[WireEvent] = []
    unknown = 0
    for ev in events:
        out = _decode_event(ev)
        if out is None:
            unknown += 1
        else:
            decoded.append(out)
    return WireBatch(
        ts=float(ts),
        events=decoded,
        data_parallel_rank=_opt_int(rank, "data_parallel_rank"),
        unknown_events=unknown,
    )


# -- encoding (msgspec Structs mirroring vLLM's declarations) ---------------------------------


class _MapEvent(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class _MapBlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _MapBlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _MapAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


class _LegacyEvent(msgspec.Struct, array_like=True, tag=True):
    pass


class _LegacyBlockStored(_LegacyEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _LegacyBlockRemoved(_LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class _LegacyAllBlocksCleared(_LegacyEvent, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def _thaw(value: object) -> Any:
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


def _to_struct(ev: WireEvent, legacy: bool) -> msgspec.Struct:
    if isinstance(ev, WireBlockStored):
        common: dict[str, Any] = {
            "block_hashes": list(ev.block_hashes),
            "parent_block_hash": ev.parent_block_hash,
            "token_ids": list(ev.token_ids),
            "block_size": ev.block_size,
            "lora_id": ev.lora_id,
            "medium": ev.medium,
            "lora_name": ev.lora_name,
            # tuples inside extra keys stay tuples: msgspec writes them as arrays either way
            "extra_keys": None if ev.extra_keys is None else list(ev.extra_keys),
            "group_idx": ev.group_idx,
            "kv_cache_spec_kind": ev.kv_cache_spec_kind,
            "kv_cache_spec_sliding_window": ev.kv_cache_spec_sliding_window,
        }
        if legacy:
            return _LegacyBlockStored(**common)
        return _MapBlockStored(
            **common,
            locality=ev.locality,
            ownership=ev.ownership,
            session_id=ev.session_id,
            lookahead_token_ids=_thaw(ev.lookahead_token_ids),
        )
    if isinstance(ev, WireBlockRemoved):
        if legacy:
            return _LegacyBlockRemoved(list(ev.block_hashes), ev.medium, ev.group_idx)
        return _MapBlockRemoved(
            list(ev.block_hashes), ev.medium, ev.group_idx, ev.locality, ev.ownership
        )
    return _LegacyAllBlocksCleared() if legacy else _MapAllBlocksCleared()


def encode_batch(batch: WireBatch, *, legacy: bool = False) -> bytes:
    """The payload vLLM 0.33.0 publishes for `batch` (legacy: the positional-event form)."""
    events = [_to_struct(ev, legacy) for ev in batch.events]
    return _encoder.encode(_Batch(float(batch.ts), events, batch.data_parallel_rank))


# -- frames ----------------------------------------------------------------------------------


def encode_seq(seq: int) -> bytes:
    """The seq frame: 8 bytes, big-endian, unsigned."""
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise KVEventDecodeError(f"seq frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


__all__ = [
    "END_SEQ",
    "MEDIUM_GPU",
    "KVEventDecodeError",
    "WireAllBlocksCleared",
    "WireBatch",
    "WireBlockRemoved",
    "WireBlockStored",
    "WireEvent",
    "decode_batch",
    "decode_seq",
    "encode_batch",
    "encode_seq",
]
