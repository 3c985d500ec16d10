"""Replica sources (options, YAML), the EventIndexer service and the `indexer` command."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from kvevents_fakes import assert_no_other_tasks, until
from rich.console import Console
from typer.testing import CliRunner

from controlplane.cli import _register, app
from controlplane.cli.indexer import collect_sources, run_indexer
from controlplane.errors import ConfigError
from controlplane.hashing import BlockHasher, scope_key, vllm_block_hashes
from controlplane.kvevents.config import ReplicaSource, parse_replica_spec
from controlplane.kvevents.service import EventIndexer
from controlplane.kvevents.testing import FakePublisher
from controlplane.kvevents.wire import WireBlockStored
from controlplane.prefix.memory import InMemoryPrefixIndex

SPEC = "id=r0,events=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558,topic=kv,block_size=32,model=m"


def test_parse_replica_spec() -> None:
    assert parse_replica_spec(SPEC) == ReplicaSource(
        replica_id="r0",
        events="tcp://10.0.0.5:5557",
        model="m",
        replay="tcp://10.0.0.5:5558",
        topic="kv",
        block_size=32,
    )
    minimal = parse_replica_spec("id=r1,events=ipc:///tmp/ev,model=m")
    assert (minimal.replay, minimal.topic, minimal.block_size) == (None, "", None)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("id=r0,events=tcp://h:1", "model is required"),
        ("events=tcp://h:1,model=m", "needs an id"),
        ("id=r0,events=h:1,model=m", "tcp://"),
        ("id=r0,events=tcp://*:5557,model=m", "bind address"),
        ("id=r0,events=tcp://h:1,model=m,block_size=x", "integer"),
        ("id=r0,events=tcp://h:1,model=m,block_size=0", ">= 1"),
        ("id=r0,events=tcp://h:1,model=m,colour=red", "unknown keys colour"),
        ("id=r0,events", "key=value"),
    ],
)
def test_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_replica_spec(spec)


def test_yaml_file_and_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "replicas.yaml"
    path.write_text(
        "replicas:\n"
        "  - {id: r1, events: 'tcp://h:1', replay: 'tcp://h:2', model: m, block_size: 16}\n"
        "  - {id: r2, events: 'tcp://h:3', model: m, incarnation: 7}\n"
    )
    sources = collect_sources([SPEC], path)
    assert [s.replica_id for s in sources] == ["r0", "r1", "r2"]
    assert sources[2].incarnation == 7
    with pytest.raises(ConfigError, match="twice"):
        collect_sources([SPEC, SPEC], None)
    with pytest.raises(ConfigError, match="no replicas"):
        collect_sources(None, None)
    path.write_text("just a string\n")
    with pytest.raises(ConfigError, match="list of replicas"):
        collect_sources(None, path)


async def test_indexer_service_feeds_the_index_and_reports() -> None:
    pub = await FakePublisher(topic="kv").start()
    index = InMemoryPrefixIndex(clock=lambda: 0.0)
    src = ReplicaSource(
        "r0", pub.events_endpoint, "m", replay=pub.replay_endpoint, topic="kv", block_size=16
    )
    tokens = list(range(64))
    engine = vllm_block_hashes(tokens, 16, seed="0")
    console = Console(file=io.StringIO(), width=200)
    indexer = EventIndexer([src], index, secret=b"s", initial_incarnation=lambda: 42)
    async with indexer:
        await pub.wait_for_subscribers(1)
        await indexer.subscribers["r0"].wait_synced(5.0)
        await pub.publish([WireBlockStored(engine, None, tokens, 16)])
        await until(lambda: indexer.status()[0].applied_seq == 0)
        (row,) = indexer.status()
        assert (row.replica_id, row.batches, row.mapped_blocks, row.trusted) == ("r0", 1, 4, True)
        assert row.incarnation == 42
    expected = BlockHasher(16, scope_key("m", secret=b"s")).hash_blocks(tokens)
    assert index.lookup(expected, ["r0"])["r0"].matched_blocks == 4
    assert indexer.subscribers["r0"].sockets_closed
    await run_indexer(
        EventIndexer([src], index), duration_s=0.05, status_interval_s=0.01, console=console
    )
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "r0 live" in text or "r0 replaying" in text or "r0 connecting" in text
    assert "kv-event indexer" in text
    await pub.close()
    assert_no_other_tasks()


def test_indexer_command_runs_and_stops() -> None:
    _register()
    result = CliRunner().invoke(
        app,
        [
            "indexer",
            "--memory",
            "--replica",
            "id=r0,events=tcp://127.0.0.1:9,replay=tcp://127.0.0.1:9,model=m",
            "--duration",
            "0.2",
            "--status-interval",
            "0.05",
            "--replay-timeout",
            "0.05",
            "--metrics-port",
            "0",
            "--metrics-host",
            "127.0.0.1",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "following 1 replica(s)" in result.output
    assert "/metrics on 127.0.0.1:" in result.output


def test_indexer_command_refuses_an_unknown_exporter() -> None:
    _register()
    result = CliRunner().invoke(
        app,
        ["indexer", "--memory", "--replica", "id=r0,events=tcp://127.0.0.1:9,model=m",
         "--otel-exporter", "jaeger"],
    )  # fmt: skip
    assert result.exit_code != 0
    assert "none, console or otlp" in str(result.exception or "") + result.output
