"""A request behind our own requests on its slot: the rules (slotlogic.wait), the hold (slotkeeper.drivers.slot_wait),
and the addon sending it to a free slot (or with `id_slot: -1` when there is none) once its bound has passed, or
at once for a side call behind longer work."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest
from mitmproxy import http
from mitmproxy.connection import ConnectionState
from mitmproxy.flow import Error as flow_error

from slotkeeper.drivers.slot_wait import SlotWaits
from slotlogic import scheduler, wait
from slotlogic.scheduler import Action
from slotlogic.wait import Ahead, Elsewhere, Verdict, WaitWhy
from tests.conftest import chat, flow, sent

SIDE_SYSTEM = "You are a title generator. Reply with a short title."


def test_a_slot_with_nothing_of_ours_ahead_is_sent_to_at_once():
    assert wait.plan(Ahead(), 0.0, 30.0, side=False, own_chars=100, rate=100.0).verdict is Verdict.GO


def test_a_session_waits_until_its_bound_then_goes_to_a_free_slot_or_unpinned():
    ahead = Ahead(1, 400_000)  # 100,000 tokens ahead: far longer than the bound
    # no speed measured yet: only the bound moves it (with one, it would move at once: `slot-busy`, below)
    assert wait.plan(ahead, 29.9, 30.0, side=False, own_chars=100, rate=None,
                     where=Elsewhere(free=2)).verdict is Verdict.WAIT
    p = wait.plan(ahead, 30.0, 30.0, side=False, own_chars=100, rate=100.0)
    assert (p.verdict, p.why) == (Verdict.UNPIN, WaitWhy.BOUND) and p.wait == 1000.0
    p = wait.plan(ahead, 30.0, 30.0, side=False, own_chars=100, rate=100.0, where=Elsewhere(free=2))
    assert (p.verdict, p.why, p.slot) == (Verdict.MOVE, WaitWhy.BOUND, 2)


def test_past_its_bound_a_request_stays_while_its_own_slot_runs_it_no_later_than_elsewhere():
    """Prefills on one server share its compute: started elsewhere beside the 6,300-token prompt ahead, a
    6,300-token call reaches its first token after both; staying, after the one ahead, with the home's cache
    (bench mix-4: two memory calls of one home, the second sent out at its bound, both prefilled from 5 tokens).
    It stays at most its own prefill's time past the bound (at most twice the bound), then goes."""
    ahead, own = Ahead(1, 6_300 * 4), 6_300 * 4  # 63 s each at 100 tok/s
    at_bound = wait.plan(ahead, 30.0, 30.0, side=True, own_chars=own, rate=100.0, where=Elsewhere(free=2))
    assert (at_bound.verdict, at_bound.until) == (Verdict.WAIT, 90.0)
    late = wait.plan(ahead, 90.0, 30.0, side=True, own_chars=own, rate=100.0)
    assert (late.verdict, late.why) == (Verdict.UNPIN, WaitWhy.BOUND)
    # the work ahead still outlasts its own prefill at the bound: it goes, as before
    long_ahead = wait.plan(Ahead(1, 20_000 * 4), 30.0, 30.0, side=True, own_chars=own, rate=100.0,
                           where=Elsewhere(free=2))
    assert (long_ahead.verdict, long_ahead.why, long_ahead.slot) == (Verdict.MOVE, WaitWhy.BOUND, 2)
    # no speed measured: only the bound
    assert wait.plan(ahead, 30.0, 30.0, side=True, own_chars=own, rate=None).verdict is Verdict.UNPIN
    # before the bound it waits until the bound
    assert wait.plan(ahead, 5.0, 30.0, side=True, own_chars=own, rate=100.0).until == 30.0


def test_a_placement_keeps_its_turn_past_its_bound_while_our_request_ahead_ends_sooner_than_its_own_prompt():
    """Rule 3 for a placement: its slot's last request of ours (a 590-token title call, 35 s on a busy server)
    ends about when the bound passes; prefilling its own prompt elsewhere would take longer than what is left
    there, so it keeps the slot's lock up to its own prefill's time past the bound (at most two bounds)."""
    own = 590 * 4  # 5.9 s at 100 tok/s
    assert wait.stay_past(Ahead(1, 3_000 * 4), own, 100.0, 30.0) == pytest.approx(5.9)  # 30 s of work ahead
    assert wait.stay_past(Ahead(1, 20_000 * 4), own, 100.0, 30.0) == 0.0  # 170 s of it left: go at the bound
    assert wait.stay_past(Ahead(1, 9_000 * 4), 9_000 * 4, 100.0, 30.0) == 60.0  # two bounds at most
    assert wait.stay_past(Ahead(), own, 100.0, 30.0) == 0.0  # nothing of ours ahead (another client's work)
    assert wait.stay_past(Ahead(1, 3_000 * 4), own, None, 30.0) == 0.0  # no speed measured: the bound
    assert wait.stay_past(Ahead(1, 3_000 * 4), own, 100.0, 0.0) == 0.0  # the hold off


def test_past_its_bound_a_request_is_held_while_every_slot_runs_ours_and_goes_unpinned_once_one_does_not():
    """Seven requests went out with `id_slot: -1` at their 30 s bound while all three slots ran long prefills of
    ours, then queued 150 s more in the server and ran where llama-server put them, over conversations promised to
    others (docs/performance.md). With no slot free of our work the server would not run it sooner, and its
    choice would land on a promised conversation: it is held (decided again as our requests end), until its
    client's patience is spent."""
    ahead = Ahead(1, 400_000)
    held = wait.plan(ahead, 30.0, 30.0, side=False, own_chars=100, rate=100.0,
                     where=Elsewhere(idle=False, exposed=500, soonest=400_000))
    assert (held.verdict, held.until) == (Verdict.WAIT, wait.hold_cap(30.0)) and wait.hold_cap(30.0) == 90.0
    # a slot with nothing of ours and nothing promised on it: sent with id_slot -1 it runs now
    idle = wait.plan(ahead, 31.0, 30.0, side=False, own_chars=100, rate=100.0, where=Elsewhere(idle=True))
    assert (idle.verdict, idle.why) == (Verdict.UNPIN, WaitWhy.BOUND)
    # a free slot (nobody's conversation) still comes first
    assert wait.plan(ahead, 31.0, 30.0, side=False, own_chars=100, rate=100.0,
                     where=Elsewhere(free=2, idle=False, exposed=500)).verdict is Verdict.MOVE
    # at the client's patience the promise is given up where that is sooner: the other slot's work ends first
    capped = wait.plan(ahead, 90.0, 30.0, side=False, own_chars=100, rate=100.0,
                       where=Elsewhere(idle=False, exposed=500, soonest=20_000))
    assert (capped.verdict, capped.why) == (Verdict.UNPIN, WaitWhy.BOUND) and capped.pick.chosen.given_away


def test_past_its_bound_the_server_never_chooses_while_an_idle_slot_holds_a_promised_conversation():
    """Four real clients at once: a request sent with `id_slot: -1` at its bound landed on an idle slot that held
    another session's conversation (3,275 tokens lost, docs/performance.md). The promise filter removes the
    server's choice while it could land on one; the request is held for its own slot, and at its client's
    patience it goes where it starts first, its cost to the other session counted."""
    ahead = Ahead(1, 40 * 100 * 4)  # 40 s of work ahead on its own slot
    at_bound = wait.plan(ahead, 30.0, 30.0, side=False, own_chars=20 * 100 * 4, rate=100.0,
                         where=Elsewhere(idle=True, exposed=3_275))
    assert at_bound.verdict is Verdict.WAIT and at_bound.until == wait.hold_cap(30.0)
    assert (Action.SERVER_CHOOSES, "promise") in at_bound.pick.removed
    # its own slot frees before its patience ends: it runs there, nothing of anyone's written over
    freed = wait.plan(Ahead(), 45.0, 30.0, side=False, own_chars=20 * 100 * 4, rate=100.0,
                      where=Elsewhere(idle=True, exposed=3_275))
    assert freed.verdict is Verdict.GO
    # with nothing promised on the idle slot and 50 s still to run ahead, it goes now (20 s of prefill there)
    open_slot = wait.plan(Ahead(1, 80 * 100 * 4), 30.0, 30.0, side=False, own_chars=20 * 100 * 4, rate=100.0,
                          where=Elsewhere(idle=True))
    assert open_slot.verdict is Verdict.UNPIN


def test_at_the_cap_with_every_slot_running_ours_a_turn_queues_on_its_own_slot_when_that_is_no_later():
    """Claude Code and OpenCode turns held to the cap while all three slots prefilled went out with
    `id_slot: -1`, queued in the server all the same, and prefilled 2,275-3,199 tokens their own slots still held
    (docs/performance.md). Queued either way, pinned it starts once the work ahead ends and finds its cache."""
    ahead, own = Ahead(1, 100 * 100 * 4), 30 * 100 * 4  # 100 s of work ahead (90 s of it run), 30 s of its own
    queued = wait.plan(ahead, 90.0, 30.0, side=False, own_chars=own, rate=100.0,
                       where=Elsewhere(idle=False, exposed=2_275, soonest=100 * 100 * 4))
    assert queued.verdict is Verdict.GO
    # the same at the cap with a slot that runs nothing of ours nor holds anything promised: it starts now
    assert wait.plan(ahead, 90.0, 30.0, side=False, own_chars=own, rate=100.0,
                     where=Elsewhere(idle=True)).verdict is Verdict.UNPIN
    # the work ahead still to run outlasts the other slot's and its own prefill there: it goes there
    long_ahead = wait.plan(Ahead(1, 200 * 100 * 4), 90.0, 30.0, side=False, own_chars=own, rate=100.0,
                           where=Elsewhere(idle=False, exposed=100, soonest=100 * 100 * 4))
    assert (long_ahead.verdict, long_ahead.why) == (Verdict.UNPIN, WaitWhy.BOUND)
    # no speed measured: no estimate says go, so it stays with its cache
    assert wait.plan(ahead, 90.0, 30.0, side=False, own_chars=own, rate=None,
                     where=Elsewhere(idle=False, exposed=100)).verdict is Verdict.GO


def test_a_slot_counts_as_idle_only_with_nothing_of_ours_on_it_and_no_placement_but_the_askers():
    from slotlogic.ledger import Ledger

    ledger = Ledger()
    ledger.resize(3)
    assert wait.idle_slots(ledger, 3, None, busy=[0, 1]) == 1
    ledger.claim(2, "other")
    assert wait.idle_slots(ledger, 3, None, busy=[0, 1]) == 0
    assert wait.idle_slots(ledger, 3, None, busy=[0, 1], mine="other") == 1  # its own claim does not count
    assert wait.idle_slots(ledger, 3, 2, busy=[0, 1], mine="other") == 0  # the slot it is held on does not count
    assert wait.idle_slots(ledger, None, None, busy=[]) == 1  # no slot count known: the server may have one


def test_a_side_call_never_waits_behind_longer_work_than_its_own_prefill_when_a_free_slot_can_run_it():
    behind_long = wait.plan(Ahead(1, 4592 * 4), 0.0, 30.0, side=True, own_chars=591 * 4, rate=50.0,
                            where=Elsewhere(free=0))
    assert (behind_long.verdict, behind_long.why, behind_long.slot) == (Verdict.MOVE, WaitWhy.SIDE_BUSY, 0)
    behind_short = wait.plan(Ahead(1, 100 * 4), 0.0, 30.0, side=True, own_chars=591 * 4, rate=50.0,
                             where=Elsewhere(free=0))
    assert behind_short.verdict is Verdict.WAIT
    no_rate = wait.plan(Ahead(1, 4592 * 4), 0.0, 30.0, side=True, own_chars=591 * 4, rate=None, where=Elsewhere(free=0))
    assert no_rate.verdict is Verdict.WAIT  # nothing measured yet: only the bound
    # no free slot: sent with id_slot -1 it would land on an idle slot over a conversation still promised to
    # its owner (simulator seed 352: 193 tokens of a known session lost), so it waits for its own slot
    nowhere = wait.plan(Ahead(1, 4592 * 4), 0.0, 30.0, side=True, own_chars=591 * 4, rate=50.0)
    assert nowhere.verdict is Verdict.WAIT


def test_a_sessions_turn_behind_another_sessions_longer_work_runs_on_a_free_slot_at_once():
    """The known-session case of the issue's placement by expected time to first token: 4,592 tokens of another
    session's prefill ahead outlast prefilling its own 591 from nothing, so it moves now (`slot-busy`); a short
    queue ahead costs less than its cache saves, so it waits for its own slot."""
    behind_long = wait.plan(Ahead(1, 4592 * 4), 0.0, 30.0, side=False, own_chars=591 * 4, rate=50.0,
                            where=Elsewhere(free=0))
    assert (behind_long.verdict, behind_long.why, behind_long.slot) == (Verdict.MOVE, WaitWhy.SLOT_BUSY, 0)
    behind_short = wait.plan(Ahead(1, 100 * 4), 0.0, 30.0, side=False, own_chars=591 * 4, rate=50.0,
                             where=Elsewhere(free=0))
    assert behind_short.verdict is Verdict.WAIT
    nowhere = wait.plan(Ahead(1, 4592 * 4), 0.0, 30.0, side=False, own_chars=591 * 4, rate=50.0)
    assert nowhere.verdict is Verdict.WAIT


def test_a_free_slot_holds_nobodys_current_conversation_and_nothing_of_ours_runs_there():
    from slotlogic.ledger import Holds, Ledger
    from slotlogic.table import SessionTable

    ledger, table = Ledger(), SessionTable(ttl=120)
    ledger.resize(4)
    for slot, key in ((0, "a"), (1, "b")):
        table.assign(key, slot, 0.0, prefix=None)
        ledger.write(slot, Holds.SESSION, key, 500)
    ledger.write(2, Holds.EMPTY, None)
    anywhere = lambda s: True  # noqa: E731

    assert wait.free_slot(ledger, table, 4, 3, [], writable=anywhere) == 2  # emptied: nobody's
    assert wait.free_slot(ledger, table, 4, 2, [], writable=anywhere) == 3  # never written, nobody's home
    assert wait.free_slot(ledger, table, 4, 3, [2], writable=anywhere) is None  # 2 runs ours; 0, 1 are owned
    assert wait.free_slot(ledger, table, 4, 3, [], writable=lambda s: s != 2) is None  # another proxy writes 2
    ledger.claim(2, "c")
    assert wait.free_slot(ledger, table, 4, 3, [], writable=anywhere) is None  # a placement is under way on 2
    ledger.unclaim(2, "c")
    ledger.write(3, Holds.SESSION, "a", 600)  # a ran on 3 since: what 0 holds is an older copy, nobody's now
    assert wait.free_slot(ledger, table, 4, 3, [2], writable=anywhere) == 0
    table.assign("d", 2, 0.0, prefix=None)
    ledger.resize(5)
    assert wait.free_slot(ledger, table, 5, 3, [0, 2], writable=anywhere) == 4
    table.assign("e", 4, 0.0, prefix=None)  # never written in the ledger, but a session's home in the table
    assert wait.free_slot(ledger, table, 5, 3, [0, 2], writable=anywhere) is None


def test_a_moved_request_is_written_where_it_runs_and_its_old_slot_is_its_holder_s_again():
    from slotlogic.decisions import Ticket
    from slotlogic.endpoints import Route
    from slotlogic.ledger import Holds, Ledger
    from slotlogic.reasons import Why
    from slotlogic.session import SessionId
    from slotlogic.table import SessionTable

    ledger, table = Ledger(), SessionTable(ttl=120)
    ledger.resize(3)
    table.assign("owner", 2, 0.0, prefix=None)
    ledger.write(2, Holds.SESSION, "owner", 900)
    table.dispatch("owner", 2)
    side = Ticket(SessionId("title", "side:prompt"), Route.PINNABLE, side=True, slot=2, why=Why.SIDE_CALL)
    table.dispatch("title", 2)
    side = wait.move(side, 0, WaitWhy.SIDE_BUSY, "owner", ledger, table, 1.0, paging=False)
    assert (side.slot, side.why, side.reason) == (0, Why.SIDE_BUSY, "side-busy")
    # what it leaves on slot 0 is its kind's (its home, `sidecalls.home`), not a session of the table
    assert ledger.conversation_on(0) == "title" and table.dispatched == {2: "owner", 0: "title"}
    assert "title" not in table.sessions and ledger.conversation_on(2) == "owner"

    turn = Ticket(SessionId("owner", "header:x"), Route.PINNABLE, slot=2, why=Why.KNOWN)
    turn = wait.move(turn, 1, WaitWhy.BOUND, None, ledger, table, 2.0, paging=False)
    assert (turn.reason, table.slot_of("owner"), ledger.entry(1).owner) == ("wait-bound", 1, "owner")
    assert 2 not in table.dispatched and turn.promise is not None and turn.promise.tokens == 0


def test_a_held_request_that_leaves_another_sessions_slot_leaves_that_session_known_there():
    """A title call pinned by hash (the server could not be asked) onto the idle slot of a session whose turn
    had just ended there, then moved by the wait to a free slot, or sent with id_slot -1, before it ran: the slot
    still holds the session's conversation (sim seed 2670: taken for displaced, its next turn got a prefix
    restored over it, 205 of 391 tokens lost)."""
    from slotlogic.decisions import Ticket
    from slotlogic.endpoints import Route
    from slotlogic.ledger import Holds, Ledger
    from slotlogic.reasons import Why
    from slotlogic.session import SessionId
    from slotlogic.table import SessionTable

    for leave in ("move", "unpin"):
        ledger, table = Ledger(), SessionTable(ttl=120)
        ledger.resize(3)
        table.assign("owner", 2, 0.0, prefix=None)
        ledger.write(2, Holds.SESSION, "owner", 900)
        table.dispatch("title", 2)
        title = Ticket(SessionId("title", "side:prompt"), Route.PINNABLE, side=True, slot=2, why=Why.HASH_FALLBACK,
                       promise=ledger.pin(2, "title", side=True))
        assert not ledger.holds(2, "owner")
        if leave == "move":
            wait.move(title, 0, WaitWhy.SIDE_BUSY, "owner", ledger, table, 1.0, paging=True)
        else:
            wait.unpin(title, WaitWhy.SIDE_BUSY, "owner", table, ledger)
        assert ledger.holds(2, "owner") and ledger.conversation_on(2) == "owner", leave
        assert ledger.entry(2).tokens == 900 and "owner" not in ledger.gone, leave


def test_bound_zero_turns_the_hold_off():
    assert wait.plan(Ahead(3, 10**9), 999.0, 0.0, side=True, own_chars=1, rate=1.0).verdict is Verdict.GO


def test_the_body_with_slot_keeps_every_other_byte():
    raw = b'{"model":"m", "id_slot":2,"messages":[{"role":"user","content":"x"}],"cache_prompt":false}'
    out = wait.body_with_slot(raw)
    assert out is not None and json.loads(out) == {**json.loads(raw), "id_slot": -1}
    assert out.replace(b"-1", b"2") == raw
    assert json.loads(wait.body_with_slot(b'{"a":1}') or b"") == {"a": 1, "id_slot": -1, "cache_prompt": True}
    assert wait.body_with_slot(b"[1]") is None and wait.body_with_slot(b"{") is None


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


async def test_the_bound_counts_from_the_request_s_arrival_not_from_its_hold():
    """A request whose placement took the bound already (paging its slot's holder out behind a long prefill;
    bench mix-4: wait-bound lines after 231-259 s with a 30 s bound) is not held a further bound."""
    waits = SlotWaits()
    waits.entered(0, "ahead", 10)
    late = await asyncio.wait_for(waits.hold(0, "mine", bound=30.0, side=False, own_chars=10, rate=lambda: None,
                                             waited=30.0), 1.0)
    assert (late.verdict, late.why) == (Verdict.UNPIN, WaitWhy.BOUND)
    early = asyncio.create_task(waits.hold(0, "mine", bound=30.0, side=False, own_chars=10, rate=lambda: None,
                                           waited=29.0))
    await asyncio.sleep(0.1)
    assert not early.done()  # a second of its bound left
    early.cancel()


OTHER_SIDE = "You are a context summarization assistant. Summarize the conversation."  # another kind: its own home


def _side(text: str, system: str = SIDE_SYSTEM) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": text}]}


async def test_a_request_behind_another_on_its_slot_goes_to_a_free_slot_after_the_bound(proxy, caplog):
    proxy.configure(slots_client_patience=3)
    first = await proxy.request(flow(_side("the first title")))
    assert sent(first)["id_slot"] == 3
    with caplog.at_level(logging.INFO):  # no prefill rate measured yet: it waits the whole bound
        second = await asyncio.wait_for(proxy.request(flow(_side("a summary", OTHER_SIDE))), 5.0)
        assert sent(second)["id_slot"] == 0  # the emptiest slot nobody else writes
        await proxy.answer(second, http.Response.make(200, b'{"id_slot":0,"timings":{"cache_n":0,"prompt_n":5}}', {}))
    assert "why=wait-bound" in caplog.text
    await proxy.answer(first, http.Response.make(200, b'{"timings":{"cache_n":0,"prompt_n":5}}', {}))
    third = await asyncio.wait_for(proxy.request(flow(_side("the third title"))), 1.0)
    assert sent(third)["id_slot"] == 3  # nothing ahead any more: pinned again, no wait


async def test_a_side_call_behind_one_of_its_own_kind_waits_for_it_in_the_proxy_then_runs_at_home(proxy):
    """Two title calls at once share their kind's home (`sidecalls.home`) but not a conversation: the second is
    held in the proxy like any request behind another (its bound still applies: a long generation ahead of it
    is not its own work), and runs at home, where the prompt is, once the first has ended."""
    proxy.configure(slots_client_patience=90)
    first = await proxy.request(flow(_side("the first title")))
    second = asyncio.ensure_future(proxy.request(flow(_side("the second title"))))
    await asyncio.sleep(0.3)
    assert not second.done()  # held: not handed to the server's queue behind the first
    await proxy.answer(first, http.Response.make(200, b'{"timings":{"cache_n":0,"prompt_n":5}}', {}))
    done = await asyncio.wait_for(second, 1.0)
    assert sent(first)["id_slot"] == sent(done)["id_slot"] == 3


async def test_a_sessions_own_open_request_holds_nothing(proxy):
    proxy.configure(slots_client_patience=3)
    first = await proxy.request(flow(chat("task A")))
    again = await asyncio.wait_for(proxy.request(flow(chat("task A"))), 0.5)  # its own work: its cache is there
    assert sent(again)["id_slot"] == sent(first)["id_slot"]


async def test_a_side_call_behind_a_long_side_call_goes_to_a_free_slot_at_once(proxy, caplog):
    long = await proxy.request(flow(_side("x " * 20000)))
    assert sent(long)["id_slot"] == 3
    up = next(iter(proxy.rt.upstreams.values()))
    up.keeper.outcomes.prefill_rate = 50.0  # measured: 50 tok/s
    up.keeper.table.assign("owner", 0, 0.0, prefix=None)  # slot 0 is a session's home
    with caplog.at_level(logging.INFO):
        short = await asyncio.wait_for(proxy.request(flow(_side("short one", OTHER_SIDE))), 1.0)  # no 30 s wait
        assert sent(short)["id_slot"] == 1  # free: not 3 (busy), not 0 (a session's home)
        await proxy.answer(short, http.Response.make(200, b'{"id_slot":1,"timings":{"cache_n":0,"prompt_n":5}}', {}))
    home = up.keeper.ledger.entry(1).owner
    assert "why=side-busy" in caplog.text and home is not None and up.keeper.ledger.conversation_on(1) == home
    assert 1 in up.keeper.ledger.writing  # made this proxy's to write in the state before it was sent there


async def test_a_known_session_behind_another_sessions_long_prompt_on_its_slot_moves_to_a_free_slot(proxy, caplog):
    """Another session's request of ours open on A's slot (two sessions sharing a slot, `why=shared`, when no
    other slot was worth moving to): A's turn does not queue 400 s of prefill behind it with a slot free."""
    a = await proxy.request(flow(chat("task A")))
    home = sent(a)["id_slot"]
    await proxy.answer(a, http.Response.make(200, b'{"timings":{"cache_n":0,"prompt_n":5}}', {}))
    up = next(iter(proxy.rt.upstreams.values()))
    up.keeper.outcomes.prefill_rate = 50.0
    up.waits.entered(home, "b-flow", 80_000, "b-session")  # 20,000 tokens of session B's prompt ahead
    with caplog.at_level(logging.INFO):
        turn = await asyncio.wait_for(proxy.request(flow(chat("task A"))), 1.0)  # not 30 s behind it
        moved = sent(turn)["id_slot"]
        await proxy.answer(turn, http.Response.make(200, b'{"timings":{"cache_n":0,"prompt_n":5}}', {}))
    assert moved != home and "why=slot-busy" in caplog.text
    owner = up.keeper.ledger.conversation_on(moved)
    assert owner is not None and up.keeper.table.sessions[owner].slot == moved  # at home there now
    up.waits.left("b-flow")
    again = await asyncio.wait_for(proxy.request(flow(chat("task A"))), 1.0)
    assert sent(again)["id_slot"] == moved  # its next turn finds its cache there


async def test_a_side_call_behind_longer_work_waits_when_every_other_slot_is_another_proxy_s(proxy):
    long = await proxy.request(flow(_side("x " * 20000)))
    up = next(iter(proxy.rt.upstreams.values()))
    up.keeper.outcomes.prefill_rate = 50.0
    async with up.store.transaction() as state:  # another proxy, alive, writes slots 0-2
        for slot in range(3):
            state.writers[slot] = "0123456789abcdef"
        state.beats["0123456789abcdef"] = time.time()
    done = await asyncio.wait_for(proxy.request(flow(_side("short one", OTHER_SIDE))), 1.0)  # queued on its slot
    assert sent(done)["id_slot"] == 3 and up.keeper.ledger.writing.isdisjoint({0, 1, 2})
    up.keeper.outcomes.prefill_rate = None  # no speed known: a request waits its bound, then goes unpinned
    proxy.configure(slots_client_patience=3)
    late = await asyncio.wait_for(proxy.request(flow(_side("short two", OTHER_SIDE))), 5.0)
    assert sent(late)["id_slot"] == -1
    await proxy.answer(long, http.Response.make(200, b'{"timings":{"cache_n":0,"prompt_n":5}}', {}))


async def test_a_known_session_on_a_free_slot_is_not_held(proxy):
    a = await proxy.request(flow(chat("task A")))
    await proxy.answer(a, http.Response.make(200, b'{"timings":{"cache_n":0,"prompt_n":5}}', {}))
    up = next(iter(proxy.rt.upstreams.values()))
    assert up.waits.open == {}
    b = await asyncio.wait_for(proxy.request(flow(chat("task A"))), 0.5)
    assert sent(b)["id_slot"] == sent(a)["id_slot"]


async def test_a_client_that_hangs_up_while_held_is_logged_as_gone_with_the_time_it_waited(proxy, caplog):
    proxy.configure(slots_client_patience=3)
    await proxy.request(flow(_side("the first title")))
    second = await proxy.request(flow(_side("a summary", OTHER_SIDE)))  # held 1 s, then sent unpinned
    second.error = flow_error("Client disconnected.")
    second.client_conn.state = ConnectionState.CAN_WRITE  # what mitmproxy leaves when the client's end closes
    with caplog.at_level(logging.INFO):
        await proxy.hook("error", second)
    line = next(x for x in caplog.text.splitlines() if "why=wait-bound" in x)
    assert "error=client-gone" in line
    seconds = float(line.split("reuse=")[1].split()[1].rstrip("s"))
    assert seconds >= 1.0  # the proxy's own wait is in the line, not 0.00s


@pytest.mark.parametrize("msg", ["Client disconnected.", "Server disconnected."])
async def test_the_error_label_follows_the_client_connection_not_the_words(proxy, caplog, msg):
    """A client still connected is never called gone, whatever the error says; one whose end closed is."""
    f = await proxy.request(flow(chat("task A")))
    f.error = flow_error(msg)
    with caplog.at_level(logging.INFO):
        await proxy.hook("error", f)
    assert "error=transport" in caplog.text and "client-gone" not in caplog.text
    g = await proxy.request(flow(chat("task B")))
    g.error, g.client_conn.state = flow_error(msg), ConnectionState.CLOSED
    with caplog.at_level(logging.INFO):
        await proxy.hook("error", g)
    assert "error=client-gone" in caplog.text


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
    side = Ticket(SessionId("side", "side:prompt"), Route.PINNABLE, side=True)
    wait.ran(ledger, 0, side)
    assert ledger.entry(0).owner == "side"  # a side call's home with no content elsewhere holds what it ran


def test_a_side_call_that_ran_unpinned_beside_its_home_leaves_the_home_on_its_own_slot():
    """Two memory calls of one Qwen Code home at once (bench mix-4): one pinned to the home's side slot, the
    other sent with id_slot -1. The one that ran elsewhere had moved the home to its slot in the ledger, so the
    side slot's content was nobody's, and the next placement wrote over it without paging it out: the home's
    next call found 5 tokens of 6,300."""
    from slotlogic.decisions import Ticket
    from slotlogic.endpoints import Route
    from slotlogic.ledger import Cause, Holds, Ledger
    from slotlogic.session import SessionId

    ledger = Ledger()
    ledger.write(0, Holds.SESSION, "owner-a", 2_253)
    ledger.write(2, Holds.SESSION, "home", 6_303)
    side = Ticket(SessionId("home", "side:prompt"), Route.PINNABLE, side=True)
    wait.ran(ledger, 0, side)
    assert ledger.conversation_on(2) == "home"  # still paged out before anyone else writes slot 2
    assert ledger.conversation_on(0) is None and ledger.entry(0).holds is Holds.UNKNOWN
    assert ledger.gone["owner-a"] is Cause.UNPINNED  # what it wrote over is a labelled loss


async def test_a_side_call_whose_slot_another_placement_holds_past_its_bound_goes_unpinned(tmp_path, monkeypatch):
    """bench mix-4 run D: an OpenCode title call whose home had been paged out was placed on a slot whose lock
    another placement held through a 137-second prefill; its own page-in waited for that lock 140 s, past its
    30 s bound (which covered only waits behind requests already sent), and OpenCode had exited by then
    (client-gone). Its placement now waits at most the bound, then it goes as the client sent it, to the first
    slot that frees, and nothing of ours is written to the held slot."""
    from slotlogic.decisions import Observe, Pin
    from slotlogic.reasons import Unpinned, Why
    up, _, _, firsts = await _two_sessions_on_two_slots(tmp_path, 0.3)
    facts = _chat_facts
    assert {p.ticket.slot for p in firsts.values()} == {0, 1}
    assert up.pages is not None
    for slot in (0, 1):
        assert await up.pages.hold(slot, f"another-placement-{slot}")  # long prefills' placements hold both
    started = time.monotonic()
    late = await asyncio.wait_for(up.decide(facts(chat("task c")), "f-c"), 5)
    assert time.monotonic() - started < 3.0  # two caps of 0.9 s: placed again once at the first (Rule 9)
    assert isinstance(late, Observe) and late.ticket.slot is None and late.body is None  # the client's bytes
    assert late.ticket.unpinned is Unpinned.WAIT_BOUND and late.ticket.reason == "wait-bound"
    for pin in firsts.values():  # nothing of c's written anywhere: each holder keeps its slot
        assert up.keeper.ledger.entry(pin.ticket.slot).owner == pin.ticket.session.key
    for slot in (0, 1):
        up.pages.unlock(f"another-placement-{slot}")
    a = firsts["a"]
    follow = chat("task a")
    follow["messages"] += [{"role": "assistant", "content": "done"}, {"role": "user", "content": "next"}]
    again = await asyncio.wait_for(up.decide(facts(follow), "f-a-2"), 5)
    assert isinstance(again, Pin) and again.ticket.slot == a.ticket.slot and again.ticket.why is Why.KNOWN


async def test_a_new_session_past_its_bound_with_every_slot_running_ours_is_placed_on_the_first_that_frees(tmp_path):
    """bench mix-4 (stop 36): with every slot running a long prefill of ours, new sessions went out with
    `id_slot: -1` at their bound, queued in the server anyway, and ran where llama-server chose, over
    conversations promised to others (Claude Code's 3,100-token conversation lost, a Qwen Code memory home
    overwritten). A placement past its bound is now placed again once one of our requests ends: on the slot
    that freed, its holder paged out first, pinned; only at `HOLD_CAP` bounds would it go unpinned."""
    from slotlogic.decisions import Pin

    bound = 0.4
    up, client, slots, firsts = await _two_sessions_on_two_slots(tmp_path, bound)
    facts = _chat_facts
    # their next turns run long prefills on both slots
    for name, pin in firsts.items():
        up.sent(f"f-{name}-2", pin.ticket.slot, pin.ticket.session.key, 40_000)
        up.unlock(f"f-{name}-2")  # the server has it (its response headers came)
        client.slots_data[pin.ticket.slot]["is_processing"] = True
    started = time.monotonic()
    task = asyncio.create_task(up.decide(facts(chat("task c")), "f-c"))
    await asyncio.sleep(bound * 1.6)
    assert not task.done()  # past its bound, held: sent unpinned it would only queue in the server
    freed = firsts["b"].ticket.slot
    client.slots_data[freed]["is_processing"] = False
    up.ended("f-b-2")
    placed = await asyncio.wait_for(task, 5)
    assert time.monotonic() - started < scheduler.PATIENCE_BOUNDS * bound
    assert isinstance(placed, Pin) and placed.ticket.slot == freed and placed.ticket.unpinned is None
    assert "save" in slots.calls  # b's conversation paged out before c was sent there
    b_key = firsts["b"].ticket.session.key
    assert up.keeper.pager.page_of(b_key) is not None


async def test_a_placement_past_its_bound_keeps_its_slot_from_a_later_one_while_the_request_there_ends_soon(
        tmp_path, monkeypatch):
    """bench mix-4 run N: an OpenCode title call's placement let go of its home's slot at its bound, 0.6 s before
    the title call running there ended; a placement that arrived after it took the slot (a page-out, a 7 s
    warm-up, a 71 s turn), and the title call, held while every slot ran ours, reached the 90 s cap after
    OpenCode had given up on it. Now it keeps its turn while that request is expected to end before its own
    prompt would prefill elsewhere (Rule 3), so it goes first, pinned, and the later placement waits."""
    from slotlogic.decisions import Pin
    bound = 0.5
    up, client, _, firsts = await _two_sessions_on_two_slots(tmp_path, bound)
    up.keeper.outcomes.probed(100.0)  # 100 prompt tokens a second: c's own prompt (~600 chars) 1.5 s
    a_slot, b_slot = firsts["a"].ticket.slot, firsts["b"].ticket.slot
    for name, chars in (("a", 800), ("b", 40_000)):  # a's short turn (2 s) and b's long one (100 s) run
        pin = firsts[name]
        up.sent(f"f-{name}-2", pin.ticket.slot, pin.ticket.session.key, chars)
        up.unlock(f"f-{name}-2")
        client.slots_data[pin.ticket.slot]["is_processing"] = True
    done: list[str] = []

    async def decide(name: str) -> object:  # nothing of a's or b's to copy (no seed source to wait for)
        out = await up.decide(_chat_facts(chat(f"task {name}", system=f"You review pull requests, {name}. " * 20)),
                              f"f-{name}")
        done.append(name)
        return out

    c_task = asyncio.create_task(decide("c"))
    await asyncio.sleep(0.45)
    d_task = asyncio.create_task(decide("d"))  # its bound ends after a's turn does
    await asyncio.sleep(0.2)
    assert up.keeper.ledger.claims_on(a_slot) and not up.keeper.ledger.claims_on(b_slot)  # d queues on a's
    client.slots_data[a_slot]["is_processing"] = False  # a's turn ends, past c's bound, before d's
    up.ended("f-a-2")
    c = await asyncio.wait_for(c_task, 5)
    assert isinstance(c, Pin) and c.ticket.slot == a_slot and c.ticket.unpinned is None
    assert done == ["c"]  # d still waits its turn behind c
    client.slots_data[b_slot]["is_processing"] = False
    up.ended("f-b-2")
    await asyncio.wait_for(d_task, 10)
    assert done == ["c", "d"]


async def test_a_placement_sends_no_save_to_a_slot_the_server_still_runs_past_its_bound(tmp_path, monkeypatch):
    """bench mix-4 run E: page-outs of slots still running a request waited in the server's queue behind
    minutes-long prefills until they timed out, and the sessions paged out prefilled again. A slot action cannot
    be called back once sent (the server writes the file whenever the slot frees), so a bounded placement sends
    none to a slot `/slots` says is running: past the bound it goes as the client sent it, nothing saved."""
    from slotkeeper.drivers.upstream import Upstream
    from slotlogic.answers import Observation
    from slotlogic.decisions import Observe, Pin, RequestFacts
    from slotlogic.reasons import Unpinned
    from slotlogic.settings import Settings
    from tests.conftest import UP
    from tests.test_page_safety import PagingLlama, Slots
    (tmp_path / "slots").mkdir()
    settings = Settings(probe_interval=0, paging=True, save_dir=str(tmp_path / "slots"), patience=1.5)
    actions = Slots()
    client = PagingLlama(actions)
    client.props_data = {**(client.props_data or {}), "total_slots": 2}
    client.slots_data = [{"id": i, "n_ctx": 8192, "is_processing": False, "n_prompt_tokens": 0} for i in range(2)]
    up = Upstream(UP, settings, tmp_path / "state", lambda e: None, client=client)

    def facts(body: dict) -> RequestFacts:
        return RequestFacts("POST", "/v1/chat/completions", (), json.dumps(body).encode(), time.time())

    for name in ("a", "b"):
        pin = await up.decide(facts(chat(f"task {name}")), f"f-{name}")
        assert isinstance(pin, Pin)
        up.unlock(f"f-{name}")
        up.answered(pin.ticket, Observation(cache_n=0, prompt_n=300), path="/v1/chat/completions", seconds=1.0)
    calls_before = list(actions.calls)
    client.slots_data = [{**e, "is_processing": True} for e in client.slots_data]  # another client's long prompts
    started = time.monotonic()
    other = chat("task c", system="You are a reviewer of pull requests. " * 20)  # nothing of a's or b's to copy
    late = await asyncio.wait_for(up.decide(facts(other), "f-c"), 8)
    assert time.monotonic() - started < 4.5  # two caps of 1.5 s: placed again once at the first (Rule 9)
    assert isinstance(late, Observe) and late.ticket.unpinned is Unpinned.WAIT_BOUND
    assert actions.calls == calls_before, (calls_before, actions.calls)
    client.slots_data = [{**e, "is_processing": False} for e in client.slots_data]
    placed = await asyncio.wait_for(up.decide(facts(other), "f-c-2"), 5)  # idle now: paged as before
    assert isinstance(placed, Pin) and "save" in actions.calls[len(calls_before):]  # its holder paged out


def _chat_facts(body: dict):
    from slotlogic.decisions import RequestFacts

    return RequestFacts("POST", "/v1/chat/completions", (), json.dumps(body).encode(), time.time())


async def _two_sessions_on_two_slots(tmp_path, bound: float):
    """A paging upstream on 2 slots with sessions a and b answered on them: (upstream, client, slot actions,
    the two first pins by name)."""
    from slotkeeper.drivers.upstream import Upstream
    from slotlogic.answers import Observation
    from slotlogic.decisions import Pin
    from slotlogic.settings import Settings
    from tests.conftest import UP
    from tests.test_page_safety import PagingLlama, Slots

    (tmp_path / "slots").mkdir()
    settings = Settings(probe_interval=0, paging=True, save_dir=str(tmp_path / "slots"), patience=3 * bound)
    slots = Slots()
    client = PagingLlama(slots)
    client.props_data = {**(client.props_data or {}), "total_slots": 2}
    client.slots_data = [{"id": i, "n_ctx": 8192, "is_processing": False, "n_prompt_tokens": 0} for i in range(2)]
    up = Upstream(UP, settings, tmp_path / "state", lambda e: None, client=client)
    firsts = {}
    for name in ("a", "b"):
        pin = await up.decide(_chat_facts(chat(f"task {name}")), f"f-{name}")
        assert isinstance(pin, Pin) and pin.ticket.slot is not None
        up.unlock(f"f-{name}")
        up.answered(pin.ticket, Observation(cache_n=0, prompt_n=300), path="/v1/chat/completions", seconds=1.0)
        firsts[name] = pin
    return up, client, slots, firsts


def _waits_on(total: int) -> SlotWaits:
    from slotlogic import shared
    from slotlogic.keeper import Keeper
    from slotlogic.server import ServerInfo
    from slotlogic.settings import Settings
    keeper = Keeper(Settings(), "http://up")
    keeper.facts.note_server(shared.ServerState("http://up"), ServerInfo(total_slots=total, media_marker="m1"))
    return SlotWaits(keeper=keeper, bound=lambda: 30.0)


async def test_a_slot_that_frees_goes_to_the_placement_waiting_longest():
    """Rule 10: two placements wait for slots of their own (0 and 1) while slot 2 runs a request of ours; when
    slot 2 frees, the one that came first is told, the other keeps waiting; a slot already idle when a wait
    begins does not end it (the ranking saw it then)."""
    waits = _waits_on(4)
    waits.entered(2, "running", 100, "s")
    old = asyncio.create_task(waits.freed(0, "old", "a", arrived=1.0))
    young = asyncio.create_task(waits.freed(1, "young", "b", arrived=2.0))
    await asyncio.sleep(0.01)
    assert waits.placing == {"old": 1.0, "young": 2.0}  # slot 3 is idle already: neither is told of it
    waits.left("running")
    assert await asyncio.wait_for(old, 1.0) == 2
    await asyncio.sleep(0.01)
    assert not young.done() and waits.placing == {"young": 2.0}
    young.cancel()


async def test_a_placement_past_its_bound_waits_for_the_slot_an_older_one_is_not_placed_on():
    """Rule 8 under Rule 10's order: with one slot idle and an older placement waiting too, a younger one past
    its bound is not placed again on that slot; it is once a second slot runs nothing of ours."""
    waits = _waits_on(2)
    waits.entered(0, "running", 100, "s")
    older = asyncio.create_task(waits.freed(0, "older", "a", arrived=1.0))
    await asyncio.sleep(0.01)
    assert not await waits.until_idle(waits.clock() + 0.05, mine="b", flow_id="younger", arrived=2.0)
    assert await waits.until_idle(waits.clock() + 0.05, mine="b")  # not ordered (no arrival): slot 1 is idle
    waits.left("running")
    assert await asyncio.wait_for(waits.until_idle(waits.clock() + 1.0, mine="b", flow_id="younger", arrived=2.0),
                                  1.0)
    older.cancel()


async def test_a_turn_held_past_its_bound_is_not_sent_to_the_server_s_choice_over_promised_conversations(proxy,
                                                                                                       caplog):
    """Four real clients at once: a turn sent with `id_slot: -1` at its bound landed on an idle slot holding
    another session's conversation (3,275 tokens, docs/performance.md). Here every other slot holds a promised
    conversation: the turn is held for its own slot instead, and runs there once the work ahead ends; the
    decision line names the filter that removed the server's choice."""
    proxy.configure(slots_client_patience=3)
    homes = []
    for task in ("task A", "task B", "task C"):
        f = await proxy.request(flow(chat(task)))
        homes.append(sent(f)["id_slot"])
        await proxy.answer(f, http.Response.make(200, b'{"timings":{"cache_n":0,"prompt_n":5}}', {}))
    side = await proxy.request(flow(_side("a title")))
    await proxy.answer(side, http.Response.make(200, b'{"timings":{"cache_n":0,"prompt_n":5}}', {}))
    up = next(iter(proxy.rt.upstreams.values()))
    assert sorted([*homes, sent(side)["id_slot"]]) == [0, 1, 2, 3]  # every slot holds someone's conversation
    up.waits.entered(homes[0], "b-flow", 8_000, "b-session")  # another session's request of ours ahead on A's slot
    with caplog.at_level(logging.INFO):
        turn = asyncio.ensure_future(proxy.request(flow(chat("task A"))))
        await asyncio.sleep(1.6)
        assert not turn.done()  # past its bound, and not sent for the server to place over a promise
        up.waits.left("b-flow")
        done = await asyncio.wait_for(turn, 1.0)
    assert sent(done)["id_slot"] == homes[0]
    assert "removed server-chooses by promise" in caplog.text and "run-own" in caplog.text
