"""The whole product on one machine: a private Redis, N simulated replicas, and their router
settings (what `make run` / `controlplane up` serves).

    with LocalStack(replicas=3) as stack:
        settings = stack.router_settings(port=8000)

Redis: a private `redis-server` on a free loopback port when one can be had (the shared
prefix index, as in production); otherwise the router's in-memory index (`redis_url` None).
Replicas: `deploy.local_fleet` with the simulated engine and the tiny model, KV events on, so
the router learns what each replica caches from the replicas' own events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from deploy.local_fleet import FleetSpec, LocalFleet
from deploy.redis_local import RedisServer, available
from router.config import ReplicaConfig, RouterSettings, load_settings


@dataclass
class LocalStack:
    replicas: int = 3
    redis: bool = True
    speed: float = 1.0
    num_gpu_blocks: int | None = None
    log: Any = None
    fleet: LocalFleet | None = field(default=None, init=False)
    redis_server: RedisServer | None = field(default=None, init=False)

    def start(self) -> LocalStack:
        try:
            if self.redis and available():
                self.redis_server = RedisServer()
                self.redis_server.start()
            spec = FleetSpec(
                replicas=self.replicas,
                engine="sim",
                base_port=0,
                speed=self.speed,
                num_gpu_blocks=self.num_gpu_blocks,
                max_model_len=4096,
            )
            self.fleet = LocalFleet(spec, log=self.log)
            self.fleet.start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.fleet is not None:
            self.fleet.stop()
        if self.redis_server is not None:
            self.redis_server.stop()

    @property
    def redis_url(self) -> str | None:
        return self.redis_server.url if self.redis_server is not None else None

    @property
    def model_dir(self) -> Path:
        assert self.fleet is not None
        return self.fleet.replicas[0].launch.model_dir

    def replica_configs(self) -> list[ReplicaConfig]:
        assert self.fleet is not None
        out = []
        for rep in self.fleet.replicas:
            ln = rep.launch
            out.append(
                ReplicaConfig(
                    id=ln.name,
                    url=ln.url,
                    gpu="cpu",
                    model="tiny-llama",
                    kv_events=ln.events_connect if ln.spec.kv_events else None,
                    kv_replay=ln.replay_connect if ln.spec.kv_events else None,
                    kv_topic=ln.spec.topic,
                )
            )
        return out

    def router_settings(self, **overrides: Any) -> RouterSettings:
        assert self.fleet is not None
        base: dict[str, Any] = {
            "served_model": self.fleet.spec.model_name,
            "tokenizer": str(self.model_dir),
            "replicas": [r.model_dump() for r in self.replica_configs()],
            "redis": {"url": self.redis_url},
        }
        return load_settings(**{**base, **overrides})

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
