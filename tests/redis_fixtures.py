"""A real redis-server per test module, flushed before each test: the store of the scale-out tests.

A missing server fails these tests with one line (never a skip): `make test` installs it first, so only a run
that bypassed it gets here, and a green run must mean the shared store was tested."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from bench.real.redis_server import RedisServer


def new_redis() -> RedisServer:
    """A RedisServer not yet started (use it as a context manager); fails the test when none is installed."""
    try:
        return RedisServer()
    except FileNotFoundError as exc:
        missing = str(exc)
    pytest.fail(missing, pytrace=False)  # outside `except`: the one line, without a chained copy


@pytest.fixture(scope="module")
def store_server() -> Iterator[RedisServer]:
    with new_redis() as r:
        yield r


@pytest.fixture
def url(store_server: RedisServer) -> str:
    redis.Redis(port=store_server.port).flushall()
    return store_server.url
