"""vLLM KV events: wire format, per-replica ZMQ subscribers, and ingestion into a prefix index.

    wire.py        event dataclasses, tolerant `decode_batch`, byte-exact `encode_batch`
    sink.py        `EventSink` protocol (apply / purge) and `PurgeReason`
    subscriber.py  `ReplicaSubscriber`: SUB + replay DEALER per replica, seq tracking
    ingest.py      `EventIngestor`: engine hashes -> the project's chained hashes -> index
    config.py      `ReplicaSource`: which replicas to follow (option strings, YAML)
    service.py     `EventIndexer`: one subscriber + ingestor per replica, one index
    testing.py     `FakePublisher`: a vLLM-like PUB + replay ROUTER for tests and demos

Only `wire` is imported here (it has no ZMQ dependency).
"""

from controlplane.kvevents.wire import (
    END_SEQ,
    KVEventDecodeError,
    WireAllBlocksCleared,
    WireBatch,
    WireBlockRemoved,
    WireBlockStored,
    WireEvent,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)

__all__ = [
    "END_SEQ",
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
