"""Helpers for tests against real vLLM CPU replicas started by `deploy.local_fleet`.

`real_fleet(n)` starts the tiny model on `n` replicas (free ports, KV events on) and yields a
`RealFleet`; teardown stops it and checks that no process of any replica is left. Also: a small
Prometheus text parser, a raw ZMQ SUB collector for KV events and a replay client. These use
pyzmq and msgspec directly (not the project's subscriber), so they check vLLM independently.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import zmq

from deploy.local_fleet import FleetSpec, LocalFleet
from deploy.processes import group_pids
from deploy.tiny_model import make_tiny_model
from deploy.vllm_env import default_venv, read_stamp

BLOCK_SIZE = 32
MODEL_NAME = "tiny-llama"
HASH_SEED = "0"


def vllm_missing_reason() -> str | None:
    """Why real-vLLM tests cannot run here, or None when they can."""
    venv = default_venv()
    if read_stamp(venv) is None:
        return f"no ready vLLM CPU env at {venv}: run `make vllm-env`"
    return None


@dataclass
class RealFleet:
    fleet: LocalFleet
    model_dir: Path
    startup_s: float
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def urls(self) -> list[str]:
        return self.fleet.urls

    def events_endpoint(self, i: int) -> str:
        return self.fleet.replicas[i].launch.events_connect

    def replay_endpoint(self, i: int) -> str:
        return self.fleet.replicas[i].launch.replay_connect


@contextmanager
def real_fleet(
    replicas: int, model_dir: Path, *, log: Callable[[str], None] | None = None
) -> Iterator[RealFleet]:
    make_tiny_model(model_dir)
    spec = FleetSpec(
        replicas=replicas,
        engine="vllm",
        base_port=0,
        model_dir=model_dir,
        model_name=MODEL_NAME,
        block_size=BLOCK_SIZE,
        kv_cache_gib=1,
        python_hash_seed=HASH_SEED,
        startup_timeout_s=420.0,
    )
    fleet = LocalFleet(spec, log=log)
    t0 = time.monotonic()
    fleet.start()
    rf = RealFleet(fleet=fleet, model_dir=model_dir, startup_s=time.monotonic() - t0)
    for rep in fleet.replicas:
        rf.timings[f"{rep.name}_ready_s"] = rep.startup_s or 0.0
    pgids = fleet.pgids()
    try:
        yield rf
    finally:
        t1 = time.monotonic()
        fleet.stop()
        rf.timings["stop_s"] = time.monotonic() - t1
        leftovers = {g: group_pids(g) for g in pgids}
        assert not any(leftovers.values()), f"processes left behind: {leftovers}"


def rss_mib(fleet: LocalFleet) -> dict[str, float]:
    """Resident memory of each replica's whole process group, MiB."""
    out: dict[str, float] = {}
    for rep in fleet.replicas:
        if rep.child is None:
            continue
        total = 0
        for pid in group_pids(rep.child.pgid):
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
            except OSError:
                continue
        out[rep.name] = total / 1024
    return out


# -- Prometheus -------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_metrics(text: str) -> list[Sample]:
    samples: list[Sample] = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m:
            labels = dict(_LABEL.findall(m.group(3) or ""))
            samples.append(Sample(m.group(1), labels, float(m.group(4))))
    return samples


def scrape(client: httpx.Client, url: str) -> list[Sample]:
    resp = client.get(f"{url}/metrics")
    resp.raise_for_status()
    return parse_metrics(resp.text)


def metric(samples: list[Sample], name: str, **labels: str) -> float:
    found = [
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    if not found:
        raise KeyError(f"no sample {name}{labels}")
    return sum(found)


# -- KV events --------------------------------------------------------------------------------


def decode_payload(payload: bytes) -> list[dict[str, Any]]:
    """A KVEventBatch payload → its events as dicts (map-shaped or legacy positional)."""
    batch = msgspec.msgpack.decode(payload)
    events = batch[1] if isinstance(batch, list) else batch["events"]
    out: list[dict[str, Any]] = []
    for ev in events:
        if isinstance(ev, dict):
            out.append(dict(ev))
        else:  # legacy positional: [tag, block_hashes, parent, token_ids, block_size, ...]
            names = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size"]
            out.append(dict(zip(names, ev, strict=False)))
    return out


class EventCollector:
    """A raw ZMQ SUB socket on one replica's KV-event PUB endpoint."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, topic: str) -> None:
        self.sock: zmq.Socket[bytes] = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sock.connect(endpoint)
        self.frames: list[list[bytes]] = []

    def drain(self, timeout_s: float) -> list[list[bytes]]:
        """Receive messages for up to `timeout_s` seconds (stops early after a quiet 0.3 s)."""
        got: list[list[bytes]] = []
        end = time.monotonic() + timeout_s
        quiet_after = 0.3
        while time.monotonic() < end:
            wait = min(end - time.monotonic(), quiet_after if got else end - time.monotonic())
            if not self.sock.poll(max(1, int(wait * 1000))):
                if got:
                    break
                continue
            got.append(self.sock.recv_multipart())
        self.frames.extend(got)
        return got

    def close(self) -> None:
        self.sock.close(linger=0)


def block_stored(messages: list[list[bytes]]) -> list[dict[str, Any]]:
    return [
        ev
        for frames in messages
        for ev in decode_payload(frames[-1])
        if ev.get("type") == "BlockStored"
    ]


def replay(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start_seq: int = 0, timeout_s: float = 5.0
) -> list[tuple[int, bytes]]:
    """Ask a replica's replay ROUTER for batches from `start_seq`; [(seq, payload)] until END."""
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: list[tuple[int, bytes]] = []
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if not sock.poll(200):
                continue
            frames = sock.recv_multipart()
            seq_frame, payload = frames[-2], frames[-1]
            if seq_frame == b"\xff" * 8:
                return out
            out.append((int.from_bytes(seq_frame, "big"), payload))
        raise TimeoutError(f"no end-of-replay marker from {endpoint} within {timeout_s} s")
    finally:
        sock.close(linger=0)
