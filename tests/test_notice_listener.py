"""Claim notices through a real Redis server: one proxy's claim marks the other proxy's session displaced at
once (its hot path never asked the store), the listener comes back after the store restarts, and without
notices the background flush still finds the displacement."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from mitmproxy.test import taddons

from slotkeeper import addon as addon_module
from slotkeeper.drivers.store_redis import RedisConnection, RedisState
from slotlogic import shared
from slotlogic.events import DisplacedElsewhere, NoticesBack, NoticesLost, Via
from tests.conftest import FakeLlama, Proxy, chat, flow, sent

SERVER = "http://127.0.0.1:8080"
NOTICE_WITHIN = 1.0  # seconds from a claim to the other proxy's mark (a few ms when idle; a loaded CI is slower)


async def until(check, seconds: float = 5.0) -> float:
    """Seconds until `check()` is true (fails the test after `seconds`)."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < seconds, "timed out"
        await asyncio.sleep(0.005)
    return time.monotonic() - t0


class Proxies:
    def __init__(self, tmp_path, url: str, llama: FakeLlama) -> None:
        self.ctxs: list[taddons.context] = []
        self.tmp_path, self.url, self.llama = tmp_path, url, llama

    def make(self, name: str) -> tuple[Proxy, list]:
        addons = addon_module.make_addons()
        addons[0].rt.make_client = lambda u: self.llama
        ctx = taddons.context(*addons)
        self.ctxs.append(ctx)
        p = Proxy(ctx.__enter__(), addons)
        p.configure(slots_state_dir=str(self.tmp_path / name), slots_probe_interval=0, slots_log_requests="off",
                    slots_state_url=self.url)
        events: list = []
        p.rt.listeners.append(events.append)
        return p, events

    def close(self) -> None:
        for ctx in self.ctxs:
            ctx.__exit__(None, None, None)


@pytest.fixture
def proxies(tmp_path, url) -> Iterator[Proxies]:
    ps = Proxies(tmp_path, url, FakeLlama(total=1))
    try:
        yield ps
    finally:
        ps.close()


def upstream(p: Proxy):
    return next(iter(p.rt.upstreams.values()))


def next_turn(body: dict) -> dict:
    return body | {"messages": [*body["messages"], {"role": "assistant", "content": "ok"}]}


async def test_a_claim_by_one_proxy_marks_the_other_proxys_session_displaced_at_once(proxies):
    a, a_events = proxies.make("a")
    b, _ = proxies.make("b")
    mine = chat("task on proxy A")
    assert sent(await a.request(flow(mine)))["id_slot"] == 0
    up_a = upstream(a)
    conn_a = a.rt.stores.redis
    await until(lambda: conn_a.notices.connected)
    up_a.sync.stop()  # no background flush on A: only a notice can tell it
    up_a.handovers.stop()  # nor its handover loop (B then waits out its answer, `handover.WAIT`, and moves in)
    assert (await a.request(flow(next_turn(mine)))).id in a.rt.open  # A's hot path, from memory
    calls = conn_a.calls
    t0 = time.monotonic()
    taking = asyncio.create_task(b.request(flow(chat("task on proxy B"))))  # one slot: B takes it
    await until(lambda: any(isinstance(e, DisplacedElsewhere) for e in a_events))
    assert time.monotonic() - t0 < NOTICE_WITHIN
    assert conn_a.calls == calls  # A learned it without a single command of its own
    assert sent(await taking)["id_slot"] == 0
    [event] = [e for e in a_events if isinstance(e, DisplacedElsewhere)]
    assert event.via is Via.NOTICE and event.slot == 0
    f = await a.request(flow(next_turn(next_turn(mine))))  # A's session is placed again, not sent from memory
    assert a.rt.open[f.id].ticket.displaced
    assert conn_a.calls > calls


async def test_the_listener_comes_back_after_the_store_restarts(url, store_server):
    events: list = []
    got: list = []
    conn = RedisConnection(url, events.append)
    RedisState(conn, SERVER).watch(got.append)
    other = RedisState(RedisConnection(url, lambda e: None), SERVER)
    try:
        await until(lambda: conn.notices.connected)
        store_server.stop()
        await until(lambda: any(isinstance(e, NoticesLost) for e in events))
        store_server.start()
        await until(lambda: any(isinstance(e, NoticesBack) for e in events), seconds=10.0)
        async with other.transaction() as st:
            shared.claim(st, "b" * 16, 1, time.time())
        await until(lambda: got, seconds=NOTICE_WITHIN)
        assert got[0].slot == 1 and got[0].claimant == "b" * 16
        assert [type(e) for e in events] == [NoticesLost, NoticesBack]  # one line each way
    finally:
        conn.close_sync()


async def test_without_notices_the_flush_still_finds_the_displacement(proxies):
    a, a_events = proxies.make("a")
    b, _ = proxies.make("b")
    mine = chat("task on proxy A")
    await a.request(flow(mine))
    up_a = upstream(a)
    up_a.sync.stop()
    a.rt.stores.redis.notices.close()  # the subscriber is gone (and stays gone)
    a.rt.stores.redis.notices.ensure = lambda: None
    await b.request(flow(chat("task on proxy B")))
    await asyncio.sleep(0.2)
    assert not any(isinstance(e, DisplacedElsewhere) for e in a_events)
    await up_a.sync.reconcile()  # what the background flush does when it has nothing to write
    [event] = [e for e in a_events if isinstance(e, DisplacedElsewhere)]
    assert event.via is Via.FLUSH
    f = await a.request(flow(next_turn(mine)))
    assert a.rt.open[f.id].ticket.displaced


async def test_two_proxies_page_one_slot_one_after_the_other_and_learn_what_was_sent(url, tmp_path):
    """The shared paging lock of a slot: the second proxy's pager waits until the first one's request was sent,
    then learns which session that was (what its save will write)."""
    from slotkeeper.drivers.page_runner import PageRunner
    from slotkeeper.drivers.store_redis import RedisSlotLocks

    runners = []
    for _ in range(2):
        r = PageRunner(FakeLlama(), str(tmp_path), 1 << 20, lambda e: None, SERVER)  # type: ignore[arg-type]
        r.shared = RedisSlotLocks(RedisConnection(url, lambda e: None), SERVER)
        runners.append(r)
    one, two = runners
    assert await one.hold(0, "flow-1", "a" * 16) and one.last_sent[0] is None
    second = asyncio.ensure_future(two.hold(0, "flow-2", "b" * 16))
    await asyncio.sleep(0.3)
    assert not second.done()                      # the slot is being paged by the other proxy
    assert await two.shared.hold(1, "t") == (True, None)  # another slot is not
    before = time.time()
    one.unlock("flow-1")                          # its request reached the server
    assert await asyncio.wait_for(second, 5.0)
    session, at = two.last_sent[0]
    assert session == "a" * 16 and at >= before
    two.unlock("flow-2", sent=False)              # abandoned: nothing sent, nothing recorded
    await asyncio.sleep(0.1)
    assert await one.hold(0, "flow-3") and one.last_sent[0][0] == "a" * 16
    one.unlock("flow-3")


async def test_a_send_under_the_shared_lock_tells_the_other_proxies_who_is_on_top(url):
    """Claims and sends of two proxies may cross; the send notice (at the lock's release) names the session
    whose request reached the slot last."""
    from slotkeeper.drivers.store_redis import RedisSlotLocks

    got: list = []
    listener = RedisConnection(url, lambda e: None)
    RedisState(listener, SERVER).watch(got.append)
    sender = RedisSlotLocks(RedisConnection(url, lambda e: None), SERVER)
    try:
        await until(lambda: listener.notices.connected)
        assert (await sender.hold(2, "tok"))[0]
        await sender.let_go(2, "tok", "b" * 16, 123.5)
        await until(lambda: got, seconds=NOTICE_WITHIN)
        assert (got[0].slot, got[0].claimant, got[0].sent, got[0].at) == (2, "b" * 16, True, 123.5)
        assert (await sender.hold(2, "tok2"))[0]
        await sender.let_go(2, "tok2", None, 124.0)   # nothing sent: nobody is told anything
        await asyncio.sleep(0.2)
        assert len(got) == 1
    finally:
        listener.close_sync()
