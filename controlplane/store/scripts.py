"""What every Redis store of the project shares: its Lua clock, its scripts, its connection pool.

The prefix index, the quota store and the shared fair queue each keep their state in Redis and
change it only through server-side scripts, one call per event, with Redis time as the only
clock. This module holds the parts they have in common:

- `LUA_NOW`: the Lua preamble that sets `now` (ms) from `ARGV[2]` when a test passes a fixed
  time, else from Redis `TIME`;
- `Script`: a script's source and SHA-1 (`caller.ScriptCaller` calls it by EVALSHA and loads it
  again after a Redis restart);
- `script_client`: a pooled asyncio client with no hidden retries (the caller keeps the time
  budgets and the circuit breaker), after the URL guard of `check_url`;
- `check_key_prefix`: key prefixes are plain words (no spaces, no `{}` hash-tag braces).
"""

from __future__ import annotations

import hashlib
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from controlplane.errors import ConfigError

LUA_NOW = r"""
local now
if ARGV[2] ~= '' then
  now = tonumber(ARGV[2])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""


class Script:
    """A Lua script, called by its SHA-1 (`EVALSHA`)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


def check_key_prefix(prefix: str, what: str) -> None:
    if not prefix or any(c.isspace() or c in "{}" for c in prefix):
        raise ConfigError(f"{what} key_prefix must be non-empty, without whitespace or braces")


def script_client(
    url: str,
    *,
    client_name: str | None,
    max_connections: int,
    pool_timeout_s: float,
    socket_timeout_s: float,
    connect_timeout_s: float,
    password: str | None = None,
    **extra: Any,
) -> tuple[aioredis.BlockingConnectionPool, aioredis.Redis]:
    """A blocking pool (waits `pool_timeout_s` for a free connection) and its client."""
    kwargs: dict[str, Any] = {
        "max_connections": max_connections,
        "timeout": pool_timeout_s,
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": connect_timeout_s,
        "retry": Retry(NoBackoff(), 0),  # no hidden retries: the budget is the caller's
        "health_check_interval": 0,
        "client_name": client_name,
        **extra,
    }
    if password is not None:
        kwargs["password"] = password
    pool = aioredis.BlockingConnectionPool.from_url(url, **kwargs)
    return pool, aioredis.Redis(connection_pool=pool)
