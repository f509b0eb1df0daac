"""The request plan and the claim, as pure functions."""

import copy

import pytest

from slotlogic import core
from slotlogic import state as st
from slotlogic.ranking import Policy

SYS = "You are a coding agent."
CHAT = "/v1/chat/completions"


def body(first="hi", system=SYS):
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": first}]}


def plan(cfg=None, table=None, method="POST", path=CHAT, headers=None, b=None, now=0.0, total=4):
    return core.plan(cfg or core.Config(), table or st.SessionTable(120), method, path, headers or {},
                     body() if b is None else b, now, total_slots=total)


def test_routes():
    assert plan(method="GET").kind == "pass"
    assert plan(path="/v1/embeddings").kind == "pass"
    assert plan(b="not a dict").kind == "pass"
    messages = plan(path="/v1/messages")
    assert messages.kind == "observe" and "not pinnable" in messages.reason
    assert plan(cfg=core.Config(policy=Policy.OFF)).kind == "observe"


def test_new_then_known():
    table = st.SessionTable(120)
    first = plan(table=table)
    assert first.kind == "need_slot" and first.session is not None
    table.assign(first.session.key, 3, 0.0, prefix=None, reason="x")
    again = plan(table=table, now=10.0)
    assert (again.kind, again.slot, again.reason) == ("pin", 3, "known")
    assert plan(table=table, now=10.0, total=2).kind == "need_slot"  # pool shrank: re-choose


def test_side_calls_go_to_the_reserved_slot():
    side = body(system="You are a context summarization assistant. Summarize.")
    p = plan(b=side)
    assert (p.kind, p.slot, p.side) == ("pin", 3, True)
    assert plan(b=side, cfg=core.Config(side_slot=1)).slot == 1
    assert plan(b=side, total=1).kind == "need_slot"  # one slot: nothing to reserve


def test_assign_resumes_owned_slot_after_proxy_restart():
    state = st.ServerState("u", total_slots=4)
    st.claim(state, "k", 2, 0.0, requests=5)
    choice = core.assign(core.Config(), state, "k", None, [], 4, 60.0)
    assert (choice.slot, choice.reason) == (2, "resumed") and state.sessions["k"].requests == 6


def test_assign_does_not_resume_a_slot_taken_by_a_live_session():
    state = st.ServerState("u", total_slots=2)
    st.claim(state, "k", 0, 0.0)
    st.claim(state, "other", 0, 50.0)
    choice = core.assign(core.Config(), state, "k", None, [], 2, 60.0)
    assert choice.slot == 1 and state.slots[1].owner == "k"


def test_assign_claims_distinct_slots_in_a_row():
    state = st.ServerState("u", total_slots=3)
    got = [core.assign(core.Config(), state, f"s{i}", None, [], 3, float(i)).slot for i in range(3)]
    assert sorted(got) == [0, 1, 2]


def test_fallback():
    assert core.fallback("k", None) is None
    c = core.fallback("k", 4)
    assert c is not None and 0 <= c.slot < 4 and c.reason == "hash-fallback"


def two_sessions_and_a_displacer(table: st.SessionTable, state: st.ServerState, t_b: float) -> None:
    """A ran on slot 0 at t=0 and answered at 1; B ran on slot 1 at t_b and answered 1 s later; C, new,
    then took slot 0 at 20 and answered at 21. S works on slot 2, the side-call slot of a 3-slot server."""
    for key, slot, t in (("A", 0, 0.0), ("B", 1, t_b), ("S", 2, 20.5), ("C", 0, 20.0)):
        st.claim(state, key, slot, t)
        table.assign(key, slot, t, prefix=None, reason="x")
        table.answered(key, slot, t + 1)


def test_a_known_session_whose_slot_ran_another_session_is_displaced():
    table = st.SessionTable(120)
    first = plan(table=table)
    assert first.session is not None
    key = first.session.key
    table.assign(key, 2, 0.0, prefix=None, reason="x")
    table.answered(key, 2, 1.0)
    assert plan(table=table, now=5.0).reason == "known"
    table.assign("other", 2, 6.0, prefix=None, reason="x")  # another session was placed on slot 2
    assert plan(table=table, now=7.0).reason == "displaced"  # ours would queue behind its request
    table.answered("other", 2, 8.0)
    moved = plan(table=table, now=10.0)
    assert (moved.kind, moved.reason, moved.slot) == ("need_slot", "displaced", 2)
    table.answered("someone-else", 2, 11.0)  # not a session of this table: changes nothing
    table.answered(key, 3, 11.0)  # an answer from another slot does not make slot 2 ours again
    assert plan(table=table, now=12.0).reason == "displaced"
    table.answered(key, 2, 12.0)
    assert plan(table=table, now=13.0).reason == "known"


@pytest.mark.parametrize(("t_b", "expected"), [
    # B idle for 21 s, the displacer C answered 1 s ago: A takes B's slot rather than its own back.
    (0.0, core.Choice(1, "evict-cheapest")),
    # B answered 2 s ago (an agent between two tool calls): A stays on its slot, which C shares with it, so
    # the damage stays on one slot instead of cascading to B and on.
    (19.0, core.Choice(0, "shared")),
], ids=["moves-to-a-long-idle-owner", "shares-rather-than-evict-an-active-one"])
def test_a_displaced_session_moves_only_where_it_costs_little(t_b, expected):
    table, state = st.SessionTable(120), st.ServerState("u", total_slots=3)
    two_sessions_and_a_displacer(table, state, t_b=t_b)
    choice = core.assign(core.Config(), state, "A", None, [], 3, 22.0, local=table, displaced_from=0)
    assert choice == expected
    assert state.slots[expected.slot].owner == "A"


def test_a_displaced_session_takes_a_free_slot_and_ignores_the_spawn_rule():
    """A free slot is always worth it. And C answered moments ago, which for a *new* session would make C
    look like a waiting parent; a displaced session is nobody's subagent."""
    table, state = st.SessionTable(120), st.ServerState("u", total_slots=4)
    two_sessions_and_a_displacer(table, state, t_b=19.0)
    choice = core.assign(core.Config(), state, "A", None, [], 4, 22.0, local=table, displaced_from=0)
    assert choice == core.Choice(3, "free-empty")
    newcomer = core.assign(core.Config(), state, "D", None, [], 4, 22.5, local=table)
    assert newcomer.reason == "evict-waiting-parent"


def test_the_side_call_slot_is_held_back_only_while_side_calls_come():
    """Slot 2 (the highest, kept for side calls) has the coldest owner. Without side calls it is an ordinary
    slot and the new session evicts it; after a side call it is used last; a TTL later it is ordinary again."""
    table, state = st.SessionTable(120), st.ServerState("u", total_slots=3)
    for key, slot, t in (("A", 2, 0.0), ("B", 0, 10.0), ("C", 1, 20.0)):
        st.claim(state, key, slot, t)
        table.assign(key, slot, t, prefix=None, reason="x")
        table.answered(key, slot, t + 1)
    pick = lambda now: core.assign(core.Config(), copy.deepcopy(state), "N", None, [], 3, now,  # noqa: E731
                                   local=table).slot
    assert pick(30.0) == 2
    table.side_call(30.0)
    assert table.reserving(31.0) and pick(31.0) == 0
    assert not table.reserving(150.0)
