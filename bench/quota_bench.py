"""Quota hard bound on a live simulated fleet: writes the `quota` key of `fairness.json`.

The scenario (`tests/integration/quota_scenario.py`, the same as `test_quota_live.py`): a private
Redis, 3 simulated replicas (one a spare), 4 router processes (`controlplane serve`) sharing the
Redis quota store, one tenant with a hard quota; 64 concurrent requests of that tenant spread over
the routers, some clients leaving mid-stream or before their answer, and a replica killed while it
streams (stalled, its counters read, then SIGKILLed).

    admitted_tokens          Σ over the replicas of Δ(vllm:prompt_tokens_total +
                             vllm:generation_tokens_total): the fleet's own count
    settlements_missing      reservations the store holds as reserved but never settled
    settlements_duplicated   settles the store answered `duplicate`

The other keys of `fairness.json` belong to the fairness benchmark: this one reads the file,
replaces `quota` and writes it back (atomically), whatever else it holds.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from common import console, machine, out_dir, print_table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integration"))
from quota_scenario import run_quota_scenario
from redis_server import RedisServer

from deploy.tiny_model import default_model_dir, make_tiny_model

ROUTERS = 4
REQUESTS = 64
QUOTA_TOKENS = 2500


def merge_key(path: Path, key: str, value: Any) -> None:
    """Set `key` in the JSON object at `path`, keeping every other key."""
    data: dict[str, Any] = {}
    if path.exists():
        try:
            loaded = json.loads(path.read_text())
            data = loaded if isinstance(loaded, dict) else {}
        except ValueError:
            console.print(f"[yellow]{path} was not valid JSON: replaced")
    data[key] = value
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def main() -> None:
    model_dir = default_model_dir()
    make_tiny_model(model_dir)
    with RedisServer() as redis_server:
        run = run_quota_scenario(
            model_dir,
            redis_server.url,
            routers=ROUTERS,
            requests=REQUESTS,
            quota_tokens=QUOTA_TOKENS,
        )
    result = run.summary()
    overshoot = max(0, run.admitted_tokens - QUOTA_TOKENS)
    print_table(
        "Quota hard bound: 64 concurrent requests of one tenant over 4 routers",
        ["quantity", "value"],
        [
            ("quota tokens", QUOTA_TOKENS),
            ("admitted tokens (replicas' counters)", run.admitted_tokens),
            ("charged tokens (store)", run.stats.charged),
            ("overshoot", overshoot),
            ("tokens on the killed replica", run.killed_replica_tokens),
            ("reservations / rejected", f"{run.stats.reserved} / {run.stats.rejected}"),
            ("settlements missing / duplicated", f"{run.settlements_missing} / "
             f"{run.settlements_duplicated}"),
            ("request outcomes", ", ".join(f"{k} {v}" for k, v in sorted(run.statuses.items()))),
        ],
    )  # fmt: skip
    path = out_dir() / "fairness.json"
    merge_key(path, "quota", {**result, "machine": machine()})
    console.print(f"wrote `quota` into {path}")
    if overshoot or run.settlements_missing or run.settlements_duplicated:
        sys.exit("quota bound or exactly-once settlement violated")


if __name__ == "__main__":
    main()
