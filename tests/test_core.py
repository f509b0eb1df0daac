"""The request plan and the claim, as pure functions."""

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
