"""The shared state in a real Redis server: the same state model as the file, atomic claims across
connections, a TTL on every document, fail open when the store goes away, and no round trip on the hot path."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator

import pytest
import redis
from mitmproxy.test import taddons

import addon as addon_module
from drivers.store import parse_url, redacted
from drivers.store_redis import KEEP_MS, RedisConnection, RedisState, state_key
from drivers.stores import Stores
from launch.redis_server import RedisServer
from slotlogic import shared
from slotlogic.events import StoreBack, StoreUnavailable
from tests.conftest import FakeLlama, Proxy, chat, flow, sent

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (apt-get install redis-server; .ci/run does)")
SERVER = "http://127.0.0.1:8080"


@pytest.fixture(scope="module")
def store_server() -> Iterator[RedisServer]:
    with RedisServer() as r:
        yield r


@pytest.fixture
def url(store_server) -> str:
    redis.Redis(port=store_server.port).flushall()
    return store_server.url


def test_urls_choose_the_store_and_never_show_credentials(tmp_path):
    assert parse_url("", tmp_path) == ("file", tmp_path)
    assert parse_url("file:///var/x", tmp_path) == ("file", __import__("pathlib").Path("/var/x"))
    assert parse_url("redis://h:6379/2", tmp_path) == ("redis", "redis://h:6379/2")
    with pytest.raises(ValueError, match="scheme"):
        parse_url("mysql://h", tmp_path)
    assert redacted("rediss://user:secret@h:6380/1") == "rediss://h:6380/1"


async def test_a_claim_made_by_one_proxy_is_seen_by_another_with_a_ttl(url, store_server):
    a = RedisState(RedisConnection(url, lambda e: None), SERVER)
    b = RedisState(RedisConnection(url, lambda e: None), SERVER)
    async with a.transaction() as st:
        shared.claim(st, "s" * 16, 1, 1000.0, prefix="p")
    seen = await b.aread()
    assert seen.slots[1].owner == "s" * 16 and seen.sessions["s" * 16].slot == 1
    ttl = redis.Redis(port=store_server.port).pttl(state_key(SERVER))
    assert KEEP_MS - 60_000 < ttl <= KEEP_MS


async def test_transactions_of_two_connections_never_lose_an_update(url):
    stores = [RedisState(RedisConnection(url, lambda e: None), SERVER) for _ in range(2)]

    async def bump(store: RedisState) -> None:
        async with store.transaction() as st:
            rec = st.sessions.get("k" * 16)
            n = rec.requests if rec else 0
            await asyncio.sleep(0.001)  # a read-modify-write that would lose updates without the lock
            shared.claim(st, "k" * 16, 0, 1.0, requests=n + 1)

    await asyncio.gather(*(bump(stores[i % 2]) for i in range(30)))
    assert (await stores[0].aread()).sessions["k" * 16].requests == 30


async def test_the_store_going_away_fails_open_logs_once_and_comes_back(url, store_server):
    events = []
    conn = RedisConnection(url, events.append)
    store = RedisState(conn, SERVER)
    async with store.transaction() as st:
        shared.claim(st, "a" * 16, 0, 1.0)
    store_server.stop()
    try:
        for _ in range(3):
            async with store.transaction() as st:  # runs on the local copy, writes nothing, raises nothing
                assert st.slots[0].owner == "a" * 16
                shared.claim(st, "b" * 16, 1, 2.0)
            conn.retry_at = 0.0
        assert [type(e) for e in events] == [StoreUnavailable]
        assert "secret" not in str(events[0]) and events[0].store.startswith("redis://127.0.0.1")
    finally:
        store_server.start()
    conn._clients.clear()
    conn.retry_at = 0.0
    async with store.transaction() as st:
        shared.claim(st, "c" * 16, 1, 3.0)
    assert [type(e) for e in events] == [StoreUnavailable, StoreBack]


def make_proxy(tmp_path, url: str, llama: FakeLlama, name: str) -> tuple[Proxy, object]:
    addons = addon_module.make_addons()
    addons[0].rt.make_client = lambda u: llama
    ctx = taddons.context(*addons)
    tctx = ctx.__enter__()
    p = Proxy(tctx, addons)
    p.configure(slots_state_dir=str(tmp_path / name), slots_probe_interval=0, slots_log_requests="off",
                slots_state_url=url)
    return p, ctx


async def test_two_proxies_on_one_store_never_claim_one_slot_while_another_is_free(tmp_path, url):
    llama = FakeLlama(total=4)
    p1, c1 = make_proxy(tmp_path, url, llama, "one")
    p2, c2 = make_proxy(tmp_path, url, llama, "two")
    try:
        slots = []
        for i in range(4):
            p = (p1, p2)[i % 2]
            slots.append(sent(await p.request(flow(chat(f"task {i}"))))["id_slot"])
        assert sorted(slots) == [0, 1, 2, 3]
    finally:
        c1.__exit__(None, None, None)
        c2.__exit__(None, None, None)


async def test_the_hot_path_sends_nothing_to_the_store(tmp_path, url):
    llama = FakeLlama()
    p, c = make_proxy(tmp_path, url, llama, "hot")
    try:
        body = chat()
        await p.request(flow(body))
        stores: Stores = p.rt.stores
        assert stores.kind == "redis" and stores.redis.calls > 0  # the new session's claim went there
        before = stores.redis.calls
        later = body | {"messages": [*body["messages"], {"role": "assistant", "content": "ok"}]}
        for _ in range(20):
            f = await p.request(flow(later))
            assert p.rt.open[f.id].ticket.why.value == "known"
        assert stores.redis.calls == before  # no round trip: decided from memory
        up = next(iter(p.rt.upstreams.values()))
        await up.flush()  # the background flush carries the touches
        assert stores.redis.calls > before
    finally:
        c.__exit__(None, None, None)


async def test_one_proxy_builds_a_prefix_checkpoint_and_only_it_releases_the_marker(url):
    a, b = RedisConnection(url, lambda e: None), RedisConnection(url, lambda e: None)
    assert await a.claim_build("prefix-0123456789abcdef.bin", "ta") is True
    assert await b.claim_build("prefix-0123456789abcdef.bin", "tb") is False
    assert await b.build_running("prefix-0123456789abcdef.bin")
    await b.release_build("prefix-0123456789abcdef.bin", "tb")  # not b's: stays
    assert await a.build_running("prefix-0123456789abcdef.bin")
    await a.release_build("prefix-0123456789abcdef.bin", "ta")
    assert not await b.build_running("prefix-0123456789abcdef.bin")
