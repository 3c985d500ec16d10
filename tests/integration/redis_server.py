"""Tests import the private Redis launcher by this short name (it lives in `deploy/`)."""

from deploy.redis_local import REDIS_SERVER, RedisServer, available, free_port

__all__ = ["REDIS_SERVER", "RedisServer", "available", "free_port"]
