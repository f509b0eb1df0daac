"""A real redis-server per test module, flushed before each test: the store of the scale-out tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from launch.redis_server import RedisServer


@pytest.fixture(scope="module")
def store_server() -> Iterator[RedisServer]:
    with RedisServer() as r:
        yield r


@pytest.fixture
def url(store_server: RedisServer) -> str:
    redis.Redis(port=store_server.port).flushall()
    return store_server.url
