"""The shared state in a real Redis server: the same state model as the file, atomic claims across
connections, a TTL on every document, fail open when the store goes away, and no round trip on the hot path."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
from mitmproxy.test import taddons

from slotkeeper import addon as addon_module
from slotkeeper.drivers.store import BUILT, Stores, parse_url, redacted
from slotkeeper.drivers.store_redis import KEEP_MS, RedisConnection, RedisState, state_key
from slotlogic import prefix as pfx
from slotlogic import shared
from slotlogic.events import StoreBack, StoreUnavailable
from slotlogic.server import ServerInfo
from tests.conftest import UP, FakeLlama, Proxy, chat, flow, sent

SERVER = "http://127.0.0.1:8080"


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


def make_proxy(tmp_path, url: str, llama: object, name: str, **options: object) -> tuple[Proxy, object]:
    """One proxy with a state dir of its own (as on another machine), its server calls going to `llama`."""
    addons = addon_module.make_addons()
    addons[0].rt.make_client = lambda u: llama
    ctx = taddons.context(*addons)
    tctx = ctx.__enter__()
    p = Proxy(tctx, addons)
    p.configure(slots_state_dir=str(tmp_path / name), slots_probe_interval=0, slots_log_requests="off",
                slots_state_url=url, **options)
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
        await up.sync.flush()  # the background flush carries the touches
        assert stores.redis.calls > before
    finally:
        c.__exit__(None, None, None)


async def test_one_proxy_builds_a_prefix_checkpoint_and_only_it_releases_the_marker(url):
    a, b = RedisConnection(url, lambda e: None), RedisConnection(url, lambda e: None)
    assert await a.claim_build("prefix-0123456789abcdef.bin", "ta") is True
    assert await b.claim_build("prefix-0123456789abcdef.bin", "tb") is False
    assert await b.build_owner("prefix-0123456789abcdef.bin") not in (None, BUILT)
    await b.release_build("prefix-0123456789abcdef.bin", "tb")  # not b's: stays
    assert await a.build_owner("prefix-0123456789abcdef.bin") not in (None, BUILT)
    await a.release_build("prefix-0123456789abcdef.bin", "ta")
    assert await b.build_owner("prefix-0123456789abcdef.bin") in (None, BUILT)


async def test_a_saved_build_leaves_a_built_mark_that_only_its_owner_can_set(url):
    a, b = RedisConnection(url, lambda e: None), RedisConnection(url, lambda e: None)
    name = "prefix-0123456789abcdef.bin"
    assert await a.claim_build(name, "ta") is True
    await b.finish_build(name, "tb", saved=True)  # not b's: still a's build
    assert await b.build_owner(name) == "ta"
    await a.finish_build(name, "ta", saved=True)
    assert await b.build_owner(name) == BUILT
    assert await b.claim_build(name, "tb") is False  # nobody builds it again


class SaveDirServer(FakeLlama):
    """A scripted llama-server for a pool (`/health`, 404 on `/running`) whose slot files live in a save dir
    shared with the other server; a cold warm-up prefills 300 tokens and takes a while (the race window)."""

    def __init__(self, files: set[str], total: int = 2) -> None:
        super().__init__(total=total)
        self.files = files
        self.cold = 0
        self.held: set[int] = set()

    async def get_json(self, path: str, timeout: float | None = None) -> Any:
        return None

    async def health(self, timeout: float = 3.0) -> str:
        return "ok"

    async def post_json(self, path: str, body: Any, timeout: float) -> tuple[int, Any]:
        if path.startswith("/slots/"):
            slot, action = int(path.split("/")[2].split("?")[0]), path.split("action=")[1]
            if action == "save":
                self.files.add(body["filename"])
                return 200, {"n_saved": 301}
            if action == "restore":
                if body["filename"] not in self.files:
                    return 400, {"error": {"message": "no file"}}
                self.held.add(slot)
                return 200, {"n_restored": 301}
            self.held.discard(slot)
            return 200, {"n_erased": 0}
        slot = body["id_slot"]
        if slot in self.held:
            return 200, {"timings": {"cache_n": 300, "prompt_n": 1}}
        self.cold += 1
        await asyncio.sleep(0.3)
        self.held.add(slot)
        return 200, {"timings": {"cache_n": 0, "prompt_n": 300}}


B = "http://127.0.0.1:8081"
SYSTEM = "You are a coding agent working in a shared repository. " * 12 + "\nCurrent date: 2026-11-30"


def pool_proxy(tmp_path, url: str, servers: dict[str, SaveDirServer], name: str) -> tuple[Proxy, object]:
    """One proxy in front of both servers (a pool), with a state dir of its own (as on another machine)."""
    addons = addon_module.make_addons()
    addons[0].rt.make_client = lambda u: servers[u]
    ctx = taddons.context(*addons)
    tctx = ctx.__enter__()
    p = Proxy(tctx, addons)
    p.configure(slots_state_dir=str(tmp_path / name), slots_probe_interval=0, slots_log_requests="off",
                slots_state_url=url, slots_prefix_cache="disk", mode=[f"reverse:{UP}@127.0.0.1:1"],
                slots_upstreams=[B])
    return p, ctx


@pytest.fixture
def build_servers() -> dict[str, SaveDirServer]:
    files: set[str] = set()
    return {UP: SaveDirServer(files), B: SaveDirServer(files)}


async def test_two_proxies_on_other_machines_build_a_prefix_checkpoint_once(tmp_path, url, build_servers):
    p1, c1 = pool_proxy(tmp_path, url, build_servers, "one")
    p2, c2 = pool_proxy(tmp_path, url, build_servers, "two")
    p3, c3 = pool_proxy(tmp_path, url, build_servers, "three")
    try:
        # Four new sessions at once, two per proxy: one cold build, the others wait and restore it.
        await asyncio.gather(*(p.request(flow(chat(f"task {i}", system=SYSTEM)))
                               for i, p in enumerate((p1, p2, p1, p2))))
        assert sum(s.cold for s in build_servers.values()) == 1 and len(build_servers[UP].files) == 1
        # A proxy that starts later (its own index knows nothing) restores the file too.
        for s in build_servers.values():
            s.held.clear()
        await p3.request(flow(chat("task 5", system=SYSTEM)))
        assert sum(s.cold for s in build_servers.values()) == 1
    finally:
        for c in (c1, c2, c3):
            c.__exit__(None, None, None)


async def test_a_waiter_follows_the_build_when_its_builder_claims_it_again(tmp_path, url, build_servers):
    # Another proxy lets its claim go and claims again (a new token: its marker expired, or an older
    # proxy's placement was refused): this proxy's session waits for that build too, then restores the file.
    p, c = pool_proxy(tmp_path, url, build_servers, "one")
    other = RedisConnection(url, lambda e: None)
    try:
        up = p.rt.upstream(UP)
        await up.prober.ask()
        info = ServerInfo.parse(await build_servers[UP].props())
        assert up.checkpoints is not None and info is not None
        stable = pfx.extract(chat("x", system=SYSTEM), up.settings.markers)
        assert stable is not None
        name = pfx.file_name(up.checkpoints.fingerprint(stable, info))
        assert await other.claim_build(name, "other:1")
        session = asyncio.create_task(p.request(flow(chat("task 0", system=SYSTEM))))
        await asyncio.sleep(0.4)
        await other.release_build(name, "other:1")
        assert await other.claim_build(name, "other:2")
        await asyncio.sleep(0.6)
        assert not session.done()  # still waiting for the second claim
        build_servers[UP].files.add(name)
        await other.finish_build(name, "other:2", saved=True)
        await asyncio.wait_for(session, 10)
        assert sum(s.cold for s in build_servers.values()) == 0
    finally:
        c.__exit__(None, None, None)


def single_proxy(tmp_path, url: str, server: SaveDirServer, name: str) -> tuple[Proxy, object]:
    """One proxy in front of one server (no pool), with a state dir of its own (as on another machine)."""
    return make_proxy(tmp_path, url, server, name, slots_prefix_cache="disk", mode=[f"reverse:{UP}@127.0.0.1:1"])


async def test_proxies_of_one_shared_server_build_a_prefix_checkpoint_once(tmp_path, url):
    # Developers' proxies on their own machines, all in front of one llama-server, sharing a Redis store.
    server = SaveDirServer(set(), total=4)
    p1, c1 = single_proxy(tmp_path, url, server, "one")
    p2, c2 = single_proxy(tmp_path, url, server, "two")
    p3, c3 = single_proxy(tmp_path, url, server, "three")
    try:
        assert p1.rt.pool is None and p1.rt.upstream(UP).mover.builds is not None
        f = await asyncio.gather(*(p.request(flow(chat(f"task {i}", system=SYSTEM)))
                                   for i, p in enumerate((p1, p2, p3))))
        assert server.cold == 1 and len(server.files) == 1  # one cold build, the others restored it
        assert len({sent(x)["id_slot"] for x in f}) == 3
        name = next(iter(server.files))
        assert await RedisConnection(url, lambda e: None).build_owner(name) == BUILT
        # A proxy that starts later (its own index knows nothing) restores the file too.
        server.held.clear()
        p4, c4 = single_proxy(tmp_path, url, server, "four")
        try:
            await p4.request(flow(chat("task 4", system=SYSTEM)))
        finally:
            c4.__exit__(None, None, None)
        assert server.cold == 1
    finally:
        for c in (c1, c2, c3):
            c.__exit__(None, None, None)


async def test_a_single_server_proxy_builds_locally_while_the_store_is_down(tmp_path, url, store_server):
    server = SaveDirServer(set(), total=2)
    p, c = single_proxy(tmp_path, url, server, "one")
    store_server.stop()
    try:
        await asyncio.wait_for(p.request(flow(chat("task 0", system=SYSTEM))), 10)
        assert server.cold == 1 and len(server.files) == 1  # built and saved here, nothing waited for
    finally:
        store_server.start()
        c.__exit__(None, None, None)


async def test_a_key_nested_too_deep_to_parse_is_refused_and_the_lock_is_never_left_held(url, store_server):
    """A key another tool wrote 100k levels deep: every new session raised RecursionError with the lock held,
    and every later one waited 10 s for it."""
    r = redis.Redis(port=store_server.port)
    r.set(state_key(SERVER), b"[" * 100_000 + b"]" * 100_000)
    a = RedisState(RedisConnection(url, lambda e: None), SERVER)
    b = RedisState(RedisConnection(url, lambda e: None), SERVER)
    assert (await a.aread()).sessions == {}
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    async with a.transaction() as st:
        assert st.sessions == {}
        shared.claim(st, "a" * 16, 0, 1.0)
    async with b.transaction() as st:
        assert st.slots[0].owner == "a" * 16  # the damaged key was replaced by a's write
    assert loop.time() - t0 < 2 and r.get(state_key(SERVER) + ":lock") is None
    r.set(state_key(SERVER), b"[" * 100_000 + b"]" * 100_000)
    with a.transaction_sync() as st:  # a value no proxy wrote: this proxy's last good copy, written over it
        assert set(st.sessions) == {"a" * 16}
    assert r.get(state_key(SERVER) + ":lock") is None


async def test_the_lock_is_released_when_reading_the_state_fails_unexpectedly(url, store_server, monkeypatch):
    store = RedisState(RedisConnection(url, lambda e: None), SERVER)

    def broken(*_: Any) -> Any:
        raise MemoryError

    monkeypatch.setattr(shared, "from_dict", broken)
    with pytest.raises(MemoryError):
        async with store.transaction():
            pass
    assert redis.Redis(port=store_server.port).get(state_key(SERVER) + ":lock") is None


async def test_a_huge_slot_count_in_the_redis_key_sizes_nothing(url, store_server):
    """Issue 20 item 1: 3,000,000 slots written into the key by another tool grew the proxy by 3 GB in 43 s."""
    redis.Redis(port=store_server.port).set(state_key(SERVER), '{"version":1,"total_slots":3000000,"slots":'
                                            '{"2999999":{"last_used":1.0,"owner":"x"}},"sessions":{}}')
    st = await RedisState(RedisConnection(url, lambda e: None), SERVER).aread()
    assert st.total_slots is None and st.slots == {}


async def test_the_shutdown_flush_does_not_wait_out_a_transaction_of_its_own_suspended_on_the_loop(url, store_server):
    """CI, test_scale_real: `done` (sync, on the event loop) waited the lock's whole 10 s for a flush of this same
    proxy that could not run to let go, then gave up (`unreachable (LockError)`) and dropped the last touches."""
    store = RedisState(RedisConnection(url, lambda e: None), SERVER)
    inside, resume = asyncio.Event(), asyncio.Event()

    async def background_flush() -> None:
        async with store.transaction() as st:
            shared.claim(st, "b" * 16, 1, 1.0)
            inside.set()
            await resume.wait()  # suspended, holding the lock, when `done` runs

    task = asyncio.create_task(background_flush())
    await inside.wait()
    t0 = asyncio.get_running_loop().time()
    with store.transaction_sync() as st:  # blocks the loop, as `done` does
        shared.claim(st, "d" * 16, 0, 2.0)
    assert asyncio.get_running_loop().time() - t0 < 2 and store.conn.available
    resume.set()
    await task
    r = redis.Redis(port=store_server.port)
    seen = await RedisState(RedisConnection(url, lambda e: None), SERVER).aread()
    assert seen.slots[0].owner == "d" * 16  # the suspended flush did not write its older state over it
    assert r.get(state_key(SERVER) + ":lock") is None
