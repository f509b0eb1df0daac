"""A request behind our own requests on its slot: the rules (slotlogic.wait), the hold (slotkeeper.drivers.slot_wait),
and the addon sending it with `id_slot: -1` once its bound has passed (or at once, for a side call)."""

from __future__ import annotations

import asyncio
import json
import logging

from mitmproxy import http
from mitmproxy.flow import Error as flow_error

from slotkeeper.drivers.slot_wait import SlotWaits
from slotlogic import wait
from slotlogic.wait import Ahead, Verdict, WaitWhy
from tests.conftest import chat, flow, sent

SIDE_SYSTEM = "You are a title generator. Reply with a short title."


def test_a_slot_with_nothing_of_ours_ahead_is_sent_to_at_once():
    assert wait.plan(Ahead(), 0.0, 30.0, side=False, own_chars=100, rate=100.0).verdict is Verdict.GO


def test_a_session_waits_until_its_bound_then_goes_unpinned():
    ahead = Ahead(1, 400_000)  # 100,000 tokens ahead: far longer than the bound
    assert wait.plan(ahead, 29.9, 30.0, side=False, own_chars=100, rate=100.0).verdict is Verdict.WAIT
    p = wait.plan(ahead, 30.0, 30.0, side=False, own_chars=100, rate=100.0)
    assert (p.verdict, p.why) == (Verdict.UNPIN, WaitWhy.BOUND) and p.wait == 1000.0


def test_a_side_call_never_waits_behind_longer_work_than_its_own_prefill():
    behind_long = wait.plan(Ahead(1, 4592 * 4), 0.0, 30.0, side=True, own_chars=591 * 4, rate=50.0)
    assert (behind_long.verdict, behind_long.why) == (Verdict.UNPIN, WaitWhy.SIDE_BUSY)
    behind_short = wait.plan(Ahead(1, 100 * 4), 0.0, 30.0, side=True, own_chars=591 * 4, rate=50.0)
    assert behind_short.verdict is Verdict.WAIT
    no_rate = wait.plan(Ahead(1, 4592 * 4), 0.0, 30.0, side=True, own_chars=591 * 4, rate=None)
    assert no_rate.verdict is Verdict.WAIT  # nothing measured yet: only the bound


def test_bound_zero_turns_the_hold_off():
    assert wait.plan(Ahead(3, 10**9), 999.0, 0.0, side=True, own_chars=1, rate=1.0).verdict is Verdict.GO


def test_the_unpinned_body_keeps_every_other_byte():
    raw = b'{"model":"m", "id_slot":2,"messages":[{"role":"user","content":"x"}],"cache_prompt":false}'
    out = wait.unpinned_body(raw)
    assert out is not None and json.loads(out) == {**json.loads(raw), "id_slot": -1}
    assert out.replace(b"-1", b"2") == raw
    assert json.loads(wait.unpinned_body(b'{"a":1}') or b"") == {"a": 1, "id_slot": -1, "cache_prompt": True}
    assert wait.unpinned_body(b"[1]") is None and wait.unpinned_body(b"{") is None


async def test_the_hold_ends_when_the_request_ahead_ends():
    waits = SlotWaits()
    waits.entered(1, "ahead", 4000, "s1")
    assert waits.ahead(1, "mine") == Ahead(1, 4000) and waits.holder(1, "mine") == "s1"
    task = asyncio.create_task(waits.hold(1, "mine", bound=5.0, side=False, own_chars=10, rate=lambda: None))
    await asyncio.sleep(0.05)
    assert not task.done()
    waits.left("ahead")
    assert (await asyncio.wait_for(task, 1.0)).verdict is Verdict.GO
    assert waits.open == {} and waits.holder(1) is None


async def test_the_hold_ends_at_its_bound():
    waits = SlotWaits()
    waits.entered(0, "ahead", 10)
    p = await asyncio.wait_for(waits.hold(0, "mine", bound=0.2, side=False, own_chars=10, rate=lambda: None), 2.0)
    assert (p.verdict, p.why) == (Verdict.UNPIN, WaitWhy.BOUND)


def _side(text: str) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": SIDE_SYSTEM}, {"role": "user", "content": text}]}


async def test_a_request_behind_another_on_its_slot_goes_unpinned_after_the_bound(proxy, caplog):
    proxy.configure(slots_wait_bound=1)
    first = await proxy.request(flow(_side("the first title")))
    assert sent(first)["id_slot"] == 3
    with caplog.at_level(logging.INFO):  # no prefill rate measured yet: it waits the whole bound
        second = await asyncio.wait_for(proxy.request(flow(_side("the second title"))), 5.0)
        assert sent(second)["id_slot"] == -1
        await proxy.answer(second, http.Response.make(200, b'{"id_slot":0,"timings":{"cache_n":0,"prompt_n":5}}', {}))
    assert "why=wait-bound" in caplog.text
    await proxy.answer(first, http.Response.make(200, b'{"timings":{"cache_n":0,"prompt_n":5}}', {}))
    third = await asyncio.wait_for(proxy.request(flow(_side("the third title"))), 1.0)
    assert sent(third)["id_slot"] == 3  # nothing ahead any more: pinned again, no wait


async def test_a_sessions_own_open_request_holds_nothing(proxy):
    proxy.configure(slots_wait_bound=1)
    first = await proxy.request(flow(chat("task A")))
    again = await asyncio.wait_for(proxy.request(flow(chat("task A"))), 0.5)  # its own work: its cache is there
    assert sent(again)["id_slot"] == sent(first)["id_slot"]


async def test_a_side_call_behind_a_long_side_call_goes_elsewhere_at_once(proxy, caplog):
    long = await proxy.request(flow(_side("x " * 20000)))
    assert sent(long)["id_slot"] == 3
    next(iter(proxy.rt.upstreams.values())).keeper.outcomes.prefill_rate = 50.0  # measured: 50 tok/s
    with caplog.at_level(logging.INFO):
        short = await asyncio.wait_for(proxy.request(flow(_side("short one"))), 1.0)  # no 30 s wait
        assert sent(short)["id_slot"] == -1
        await proxy.answer(short, http.Response.make(200, b'{"id_slot":0,"timings":{"cache_n":0,"prompt_n":5}}', {}))
    assert "why=side-busy" in caplog.text


async def test_a_known_session_on_a_free_slot_is_not_held(proxy):
    a = await proxy.request(flow(chat("task A")))
    await proxy.answer(a, http.Response.make(200, b'{"timings":{"cache_n":0,"prompt_n":5}}', {}))
    up = next(iter(proxy.rt.upstreams.values()))
    assert up.waits.open == {}
    b = await asyncio.wait_for(proxy.request(flow(chat("task A"))), 0.5)
    assert sent(b)["id_slot"] == sent(a)["id_slot"]


async def test_a_client_that_hangs_up_while_held_is_logged_as_gone_with_the_time_it_waited(proxy, caplog):
    proxy.configure(slots_wait_bound=1)
    await proxy.request(flow(_side("the first title")))
    second = await proxy.request(flow(_side("the second title")))  # held 1 s, then sent unpinned
    second.error = flow_error("Client disconnected.")
    with caplog.at_level(logging.INFO):
        await proxy.hook("error", second)
    line = next(x for x in caplog.text.splitlines() if "why=wait-bound" in x)
    assert "error=client-gone" in line
    seconds = float(line.split("reuse=")[1].split()[1].rstrip("s"))
    assert seconds >= 1.0  # the proxy's own wait is in the line, not 0.00s


def test_where_an_unpinned_request_ran_is_written_in_the_ledger():
    from slotlogic.decisions import Ticket
    from slotlogic.endpoints import Route
    from slotlogic.ledger import Holds, Ledger
    from slotlogic.session import SessionId

    ledger = Ledger()
    ledger.write(0, Holds.SESSION, "owner-a", 900)
    turn = Ticket(SessionId("mine", "header:x"), Route.PINNABLE)
    wait.ran(ledger, 0, turn)
    assert ledger.entry(0).owner == "mine"
    side = Ticket(SessionId("side", "content:root"), Route.PINNABLE, side=True)
    wait.ran(ledger, 0, side)
    assert ledger.entry(0).holds is Holds.SIDE and ledger.entry(0).owner is None
