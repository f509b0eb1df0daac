"""The shared store holds another writer's values until checked: any client of the Redis server can write the
keys. Each attack is one a probe ran against a real redis-server (tests/redis_fixtures.py); the figures are
the proxy's Python allocations while it reads (tracemalloc peak), its event loop's longest stall, and whose
sessions and page files survive. Acceptance: a hostile value of any size costs under 50 MB and evicts no one
else's session; a squatted lock stalls no new session for long and never makes the store "unreachable".

The values are made inside redis-server where they are large (SETRANGE, APPEND in parts), so the test process
never holds one itself."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from typing import Any

import redis

from slotkeeper.drivers import store_redis
from slotkeeper.drivers.store_redis import RedisConnection, RedisSlotLocks, RedisState, state_key
from slotlogic import paging, shared
from slotlogic.events import StoreLockBusy, StoreUnavailable, StoreValueRefused
from slotlogic.paging import PageFile, PageRecord

SERVER = "http://127.0.0.1:8080"
MB = 1 << 20
BUDGET = 50 * MB  # the acceptance figure: what a hostile value may cost the proxy


async def costs(read: Callable[[], Awaitable[Any]], *, trace: bool = True) -> tuple[Any, int, float]:
    """`read()`'s result, the peak of Python allocations during it, and the event loop's longest stall (tracing
    allocations slows Python several times: `trace=False` for the stall alone)."""
    stalls = [0.0]
    done = asyncio.Event()

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        while not done.is_set():
            t = loop.time()
            await asyncio.sleep(0.01)
            stalls[0] = max(stalls[0], loop.time() - t - 0.01)

    tick = asyncio.create_task(ticker())
    if trace:
        tracemalloc.start()
    try:
        result = await read()
        peak = tracemalloc.get_traced_memory()[1] if trace else 0
    finally:
        tracemalloc.stop()
        done.set()
        await tick
    return result, peak, stalls[0]


def real_sessions(n: int, now: float) -> shared.ServerState:
    """`n` sessions another proxy placed, each with its page file (slots 0-3 owned by the last four)."""
    st = shared.ServerState(SERVER, total_slots=4)
    for i in range(n):
        key = f"real{i:012x}"
        shared.claim(st, key, i % 4, now - 100 + i * 0.1)
        st.pages[key] = PageRecord(f"page-{i:020d}.bin", 1000, now - 100, 4096, "m")
    return st


async def written(url: str, st: shared.ServerState) -> RedisState:
    """A proxy that wrote `st` (its last good copy is `st`)."""
    store = RedisState(RedisConnection(url, lambda e: None), SERVER)
    async with store.transaction() as cur:
        cur.slots, cur.sessions, cur.pages, cur.total_slots = st.slots, st.sessions, st.pages, st.total_slots
    return store


async def test_a_64_mb_value_is_refused_by_its_size_without_being_read(url, store_server):
    """The probe's 200 MB non-JSON value cost +562 MB per read; here 64 MB, made inside redis-server."""
    now = time.time()
    events: list[Any] = []
    store = await written(url, real_sessions(40, now))
    store.conn.emit = events.append
    r = redis.Redis(port=store_server.port)
    r.setrange(state_key(SERVER), 64 * MB - 1, b"x")
    st, peak, stall = await costs(store.aread)
    assert peak < 2 * MB and stall < 0.5, (peak, stall)
    assert len(st.sessions) == 40  # this proxy's last good copy

    async def transact() -> list[str]:
        async with store.transaction() as cur:
            return shared.compact(cur, now, 1e6, 256)

    doomed, peak, stall = await costs(transact)
    assert peak < 2 * MB and doomed == [] and [type(e) for e in events] == [StoreValueRefused]
    assert "64.0 MB" in events[0].why and store.conn.available
    assert len(json.loads(r.get(state_key(SERVER)))["sessions"]) == 40  # written over the hostile value


async def test_600k_fake_sessions_are_refused_and_evict_no_real_one(url, store_server):
    """The probe's 31 MB document of 600k sessions stamped `last_used: 1e300` stalled the loop 3.4 s; then
    compaction kept 256 fakes and evicted all 300 real sessions, queueing their 300 page files for deletion."""
    now = time.time()
    store = await written(url, real_sessions(300, now))
    r = redis.Redis(port=store_server.port)
    key = state_key(SERVER)
    r.set(key, '{"version":1,"sessions":{')
    for start in range(0, 600_000, 20_000):  # appended in parts: the test never holds the document itself
        r.append(key, ",".join(f'"fake{i}":{{"slot":0,"last_used":1e300,"requests":1}}'
                               for i in range(start, start + 20_000)) + ("," if start + 20_000 < 600_000 else "}}"))
    assert r.strlen(state_key(SERVER)) > 30 * MB

    async def transact() -> list[str]:
        async with store.transaction() as cur:
            return shared.compact(cur, now, 1e6, 256)

    doomed, peak, stall = await costs(transact)
    assert peak < BUDGET and stall < 0.5, (peak / MB, stall)
    kept = json.loads(r.get(state_key(SERVER)))["sessions"]
    assert not any(k.startswith("fake") for k in kept)
    # compaction to 256 drops the 44 least recent real sessions, as it would without the attack: no more
    assert len(doomed) == 300 - 256 and len(kept) == 256


async def test_stamps_from_the_future_and_infinities_outrank_no_real_session(url, store_server):
    """Fakes added next to real sessions (a writer that read the document first), under every size cap:
    `last_used: 1e300`, `Infinity`, an hour ahead. Compaction kept the fakes and evicted every real one."""
    now = time.time()
    real = real_sessions(200, now)
    doc = shared.to_dict(real)
    for i in range(600):
        stamp = (1e300, float("inf"), now + 3600)[i % 3]
        doc["sessions"][f"fake{i}"] = {"slot": i % 4, "last_used": stamp, "requests": 1}
        doc["slots"][str(i % 4)] = {"last_used": stamp, "owner": f"fake{i}", "requests": 1}
    r = redis.Redis(port=store_server.port)
    r.set(state_key(SERVER), json.dumps(doc))
    store = RedisState(RedisConnection(url, lambda e: None), SERVER)
    async with store.transaction() as cur:
        doomed = shared.compact(cur, now, 1e6, 256)
        held = shared.held_slots(cur, now, 600)
    assert doomed == [] and held == set()  # no slot held forever by a stamp from the future either
    assert set(json.loads(r.get(state_key(SERVER)))["sessions"]) == set(real.sessions)


async def test_a_negative_page_size_does_not_switch_the_disk_budget_off(url, store_server):
    """One record with `bytes: -2**62` made the pages' total negative: the budget never dropped a page and the
    orphan sweep never ran."""
    now = time.time()
    real = real_sessions(10, now)  # 10 pages of 4 KiB: over a 16 KiB budget
    doc = shared.to_dict(real)
    doc["pages"]["hostile"] = {"file": "page-99999999999999999999.bin", "n_tokens": 1, "saved": now,
                               "bytes": -2 ** 62, "model": "m"}
    redis.Redis(port=store_server.port).set(state_key(SERVER), json.dumps(doc))
    st = await RedisState(RedisConnection(url, lambda e: None), SERVER).aread()
    assert "hostile" not in st.pages
    assert len(paging.over_budget(st.pages, 16 * 1024)) == 6
    files = {"page-88888888888888888888.bin": PageFile(now - 3600, 4096)}  # an orphan, the oldest file there
    _, doomed, fits = paging.disk_room(files, st.pages, 16 * 1024, now, keep_seconds=1e6)
    assert "page-88888888888888888888.bin" in doomed and fits


async def test_a_squatted_lock_stalls_no_new_session_and_the_store_stays_reachable(url, store_server):
    """A lock key set without expiry made every new session wait 10 s, then marked the store unreachable."""
    events: list[Any] = []
    store = RedisState(RedisConnection(url, events.append), SERVER)
    r = redis.Redis(port=store_server.port)
    for squat in (lambda k: r.set(k, "squat"), lambda k: r.hset(k, "a", "b"),
                  lambda k: r.set(k, "squat", px=3_600_000)):
        r.delete(state_key(SERVER) + ":lock")
        squat(state_key(SERVER) + ":lock")
        t0 = time.monotonic()
        async with store.transaction() as st:
            shared.claim(st, "a" * 16, 0, time.time())
        assert time.monotonic() - t0 < 0.5
    assert events == [] and store.conn.available
    assert "a" * 16 in json.loads(r.get(state_key(SERVER)))["sessions"]
    assert r.get(state_key(SERVER) + ":lock") is None


async def test_a_lock_renewed_by_a_squatter_is_waited_for_briefly_then_taken_over(url, store_server, monkeypatch):
    """A squatter that renews a proxy-like expiry: the first transactions wait `LOCK_WAIT` and run on the last
    copy (the store is reachable: one "lock busy" line, no back-off); once the same holder has been seen longer
    than a proxy's lock lives, it is taken over. (LOCK_SECONDS scaled from 10 s to 1 s.)"""
    monkeypatch.setattr(store_redis, "LOCK_SECONDS", 1.0)
    monkeypatch.setattr(store_redis, "LOCK_WAIT", 0.3)
    events: list[Any] = []
    store = RedisState(RedisConnection(url, events.append), SERVER)
    r = redis.Redis(port=store_server.port)
    stop = threading.Event()

    def squatter() -> None:
        while not stop.is_set():
            r.set(state_key(SERVER) + ":lock", "squat", px=1000)
            stop.wait(0.1)

    thread = threading.Thread(target=squatter, daemon=True)
    thread.start()
    deadline = time.monotonic() + 5
    while r.get(state_key(SERVER) + ":lock") is None and time.monotonic() < deadline:
        await asyncio.sleep(0.01)  # the squatter holds the lock before the first transaction asks for it
    try:
        waits = []
        for i in range(8):
            t0 = time.monotonic()
            async with store.transaction() as st:
                shared.claim(st, f"s{i:015d}", 0, time.time())
            waits.append(time.monotonic() - t0)
            if r.get(state_key(SERVER)) is not None:
                break
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        thread.join()
    assert max(waits) < 0.6 and sum(waits) < 3, waits
    assert r.get(state_key(SERVER)) is not None  # taken over, written
    assert [type(e) for e in events] == [StoreLockBusy] and store.conn.available
    assert not any(isinstance(e, StoreUnavailable) for e in events)


async def test_a_slots_paging_lock_and_last_send_are_bounded_too(url, store_server):
    """The slot's last send (read with its paging lock) and a build marker: a 64 MB value is not read; a paging
    lock squatted without expiry is taken over instead of waited for (60 s by default)."""
    r = redis.Redis(port=store_server.port)
    locks = RedisSlotLocks(RedisConnection(url, lambda e: None), SERVER)
    r.setrange(f"{locks.prefix}0:sent", 64 * MB - 1, b"x")
    r.set(f"{locks.prefix}0:lock", "squat")
    t0 = time.monotonic()
    (held, sent), peak, _ = await costs(lambda: locks.hold(0, "tok", wait=2.0))
    assert held and sent is None and peak < 2 * MB and time.monotonic() - t0 < 1
    r.setrange("slotkeeper:v1:build:prefix-x", 64 * MB - 1, b"x")
    owner, peak, _ = await costs(lambda: locks.conn.build_owner("prefix-x"))
    assert owner is None and peak < 2 * MB


async def test_the_largest_value_accepted_costs_under_the_budget(url, store_server):
    """The worst shape under the size cap: tiny fake sessions filling `MAX_STATE_BYTES` (about 60k), read and
    written back by a transaction: its cost is what any accepted value can cost."""
    r = redis.Redis(port=store_server.port)
    n = store_redis.MAX_STATE_BYTES // 34
    key = state_key(SERVER)
    r.set(key, '{"sessions":{')
    for start in range(0, n, 10_000):
        r.append(key, ",".join(f'"{i}":{{"slot":0,"last_used":1}}' for i in range(start, min(n, start + 10_000)))
                 + ("," if start + 10_000 < n else "}}"))
    assert store_redis.MAX_STATE_BYTES * 0.9 < r.strlen(state_key(SERVER)) <= store_redis.MAX_STATE_BYTES
    dump = r.dump(state_key(SERVER))
    store = RedisState(RedisConnection(url, lambda e: None), SERVER)

    async def transact() -> int:
        async with store.transaction() as cur:
            shared.compact(cur, time.time(), 1e12, 256)
            return len(cur.sessions)

    kept, peak, _ = await costs(transact)
    redis.Redis(port=store_server.port).restore(state_key(SERVER), 0, dump, replace=True)
    _, _, stall = await costs(transact, trace=False)
    # the stall: JSON parsing holds the interpreter even in a worker thread (0.1 s on an idle 2-core machine)
    assert kept == 256 and peak < BUDGET and stall < 1.0, (kept, peak / MB, stall)
    print(f"largest accepted value: {peak / MB:.1f} MB, loop stall {stall:.3f} s")
