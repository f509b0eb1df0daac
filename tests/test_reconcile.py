"""Two proxy processes on one state file: a slot shared while another is free is noticed off the hot path, and
only the later session moves, at its next request."""

from __future__ import annotations

import json
import time

from slotkeeper.drivers import store_file
from slotkeeper.drivers.upstream import Upstream
from slotlogic import events as ev
from slotlogic import reconcile
from slotlogic import shared as st
from slotlogic.decisions import RequestFacts
from slotlogic.reasons import Why
from slotlogic.settings import Settings
from tests.conftest import UP, FakeLlama, chat


def state(*sessions: tuple[str, int, float], total: int = 2) -> st.ServerState:
    s = st.ServerState(UP, total_slots=total)
    for key, slot, when in sessions:
        st.claim(s, key, slot, when)
    return s


def test_the_later_of_two_sessions_on_one_slot_moves_while_a_slot_is_free():
    s = state(("a", 0, 100.0), ("b", 0, 105.0))
    assert reconcile.misplaced(s, {"b": 0}, 110.0, 120.0, 2) == ["b"]
    assert reconcile.misplaced(s, {"a": 0}, 110.0, 120.0, 2) == []  # the earlier one stays: the other side moves


def test_nothing_moves_when_every_slot_is_claimed_or_the_sharer_expired():
    assert reconcile.misplaced(state(("a", 0, 100.0), ("b", 0, 105.0), ("c", 1, 101.0)), {"b": 0}, 110.0, 120.0,
                               2) == []
    assert reconcile.misplaced(state(("a", 0, 100.0), ("b", 0, 105.0)), {"b": 0}, 300.0, 120.0, 2) == []
    assert reconcile.misplaced(state(("a", 0, 100.0), ("b", 0, 105.0)), {"b": 0}, 110.0, 120.0, 2, reserved=(1,)) == []


def test_two_sessions_of_this_process_on_one_slot_are_not_another_process_s():
    """The server put our new session b where our a was (affinity, or a client's own slot): a's claim is still in
    the state file, but a is ours, displaced in memory. One process alone never marks b (it once did, and b's
    next turn went out unpinned: "shares slot 0 with an earlier session of another proxy" with one proxy)."""
    s = state(("a", 0, 100.0), ("b", 0, 105.0))
    assert reconcile.misplaced(s, {"b": 0}, 110.0, 120.0, 2, mine={"a", "b"}) == []
    assert reconcile.misplaced(s, {"b": 0}, 110.0, 120.0, 2, mine={"b"}) == ["b"]  # a another process's: b moves


def test_touches_keep_the_time_of_the_claim():
    s = state(("a", 0, 100.0), ("b", 0, 105.0))
    st.touch(s, "a", 0, 109.0, requests=3, prefix=None)  # a's touch retakes the slot's newest claim...
    assert reconcile.misplaced(s, {"b": 0}, 110.0, 120.0, 2) == ["b"]  # ...but b still came later
    back = st.from_dict(json.loads(json.dumps(st.to_dict(s))), UP)
    assert back.sessions["a"].claimed == 100.0 and reconcile.misplaced(back, {"b": 0}, 110.0, 120.0, 2) == ["b"]


def facts(first: str) -> RequestFacts:
    return RequestFacts("POST", "/v1/chat/completions", (), json.dumps(chat(first)).encode(), time.time())


async def test_two_processes_one_state_dir_end_up_on_two_slots(tmp_path, monkeypatch):
    """Process 2 places B onto A's slot while slot 1 is busy; slot 1 frees; process 2's background pass sees the
    shared slot, and B's next request moves to slot 1 (A, the earlier, stays)."""
    seen: list[ev.Event] = []
    llama1, llama2 = FakeLlama(total=2), FakeLlama(total=2)
    p1 = Upstream(UP, Settings(probe_interval=0), tmp_path / "state", seen.append, client=llama1)
    p2 = Upstream(UP, Settings(probe_interval=0), tmp_path / "state", seen.append, client=llama2)
    a = await p1.decide(facts("A"), "fa")
    llama2.slots_data[0]["n_prompt_tokens"] = 400
    llama2.slots_data[1]["is_processing"] = True  # a long request nobody pinned
    b = await p2.decide(facts("B"), "fb")
    assert (a.ticket.slot, b.ticket.slot) == (0, 0) and b.ticket.why is Why.EVICT_CHEAPEST
    llama2.slots_data[1]["is_processing"] = False
    transactions = []
    real = store_file.StateFile.transaction
    monkeypatch.setattr(store_file.StateFile, "transaction", lambda self: transactions.append(1) or real(self))
    assert (await p2.decide(facts("B"), "fb2")).ticket.slot == 0  # the hot path does not know yet: no I/O
    assert transactions == []
    await p1.sync.flush()
    await p2.sync.flush()  # the background pass (a touch to write, then the look at what was written)
    assert ev.SlotShared(UP, b.ticket.session.short, 0) in seen
    moved = await p2.decide(facts("B"), "fb3")
    again = await p1.decide(facts("A"), "fa2")
    assert (moved.ticket.slot, moved.ticket.why, again.ticket.slot) == (1, Why.FREE_EMPTY, 0)
    assert moved.ticket.displaced
