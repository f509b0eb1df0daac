"""Slot choice with the shared state: resume, rank, claim; displaced sessions; the hash fallback."""

import copy

import pytest

from slotlogic import placement
from slotlogic import shared as st
from slotlogic.ranking import Choice
from slotlogic.reasons import Why
from slotlogic.settings import Settings
from slotlogic.table import SessionTable


def test_assign_resumes_owned_slot_after_proxy_restart():
    state = st.ServerState("u", total_slots=4)
    st.claim(state, "k", 2, 0.0, requests=5)
    choice = placement.assign(Settings(), state, placement.Seeker("k", None), placement.SlotsSeen([], 4), 60.0)
    assert (choice.slot, choice.why) == (2, Why.RESUMED) and state.sessions["k"].requests == 6


def test_assign_does_not_resume_a_slot_taken_by_a_live_session():
    state = st.ServerState("u", total_slots=2)
    st.claim(state, "k", 0, 0.0)
    st.claim(state, "other", 0, 50.0)
    choice = placement.assign(Settings(), state, placement.Seeker("k", None), placement.SlotsSeen([], 2), 60.0)
    assert choice.slot == 1 and state.slots[1].owner == "k"


def test_assign_claims_distinct_slots_in_a_row():
    state = st.ServerState("u", total_slots=3)
    got = [placement.assign(Settings(), state, placement.Seeker(f"s{i}", None), placement.SlotsSeen([], 3),
                            float(i)).slot for i in range(3)]
    assert sorted(got) == [0, 1, 2]


def test_fallback():
    assert placement.fallback("k", None) is None
    c = placement.fallback("k", 4)
    assert c is not None and 0 <= c.slot < 4 and c.why is Why.HASH_FALLBACK


def two_sessions_and_a_displacer(table: SessionTable, state: st.ServerState, t_b: float) -> None:
    """A ran on slot 0 at t=0 and answered at 1; B ran on slot 1 at t_b and answered 1 s later; C, new,
    then took slot 0 at 20 and answered at 21. S works on slot 2, the side-call slot of a 3-slot server."""
    for key, slot, t in (("A", 0, 0.0), ("B", 1, t_b), ("S", 2, 20.5), ("C", 0, 20.0)):
        st.claim(state, key, slot, t)
        table.assign(key, slot, t, prefix=None)
        table.answered(key, slot, t + 1)


@pytest.mark.parametrize(("t_b", "expected"), [
    # B idle for 21 s, the displacer C answered 1 s ago: A takes B's slot rather than its own back.
    (0.0, Choice(1, Why.EVICT_CHEAPEST)),
    # B answered 2 s ago (an agent between two tool calls): A stays on its slot, which C shares with it, so
    # the damage stays on one slot instead of cascading to B and on.
    (19.0, Choice(0, Why.SHARED)),
], ids=["moves-to-a-long-idle-owner", "shares-rather-than-evict-an-active-one"])
def test_a_displaced_session_moves_only_where_it_costs_little(t_b, expected):
    table, state = SessionTable(120), st.ServerState("u", total_slots=3)
    two_sessions_and_a_displacer(table, state, t_b=t_b)
    choice = placement.assign(Settings(), state, placement.Seeker("A", None, displaced_from=0),
                              placement.SlotsSeen([], 3, table), 22.0)
    assert choice == expected
    assert state.slots[expected.slot].owner == "A"


def test_a_displaced_session_takes_a_free_slot_and_ignores_the_spawn_rule():
    """A free slot is always worth it. And C answered moments ago, which for a *new* session would make C
    look like a waiting parent; a displaced session is nobody's subagent."""
    table, state = SessionTable(120), st.ServerState("u", total_slots=4)
    two_sessions_and_a_displacer(table, state, t_b=19.0)
    choice = placement.assign(Settings(), state, placement.Seeker("A", None, displaced_from=0),
                              placement.SlotsSeen([], 4, table), 22.0)
    assert choice == Choice(3, Why.FREE_EMPTY)
    newcomer = placement.assign(Settings(), state, placement.Seeker("D", None), placement.SlotsSeen([], 4, table), 22.5)
    assert newcomer.why is Why.EVICT_WAITING_PARENT


def test_the_side_call_slot_is_held_back_only_while_side_calls_come():
    """Slot 2 (the highest, kept for side calls) has the coldest owner. Without side calls it is an ordinary
    slot and the new session evicts it; after a side call it is used last; a TTL later it is ordinary again."""
    table, state = SessionTable(120), st.ServerState("u", total_slots=3)
    for key, slot, t in (("A", 2, 0.0), ("B", 0, 10.0), ("C", 1, 20.0)):
        st.claim(state, key, slot, t)
        table.assign(key, slot, t, prefix=None)
        table.answered(key, slot, t + 1)
    pick = lambda now: placement.assign(Settings(), copy.deepcopy(state), placement.Seeker("N", None),  # noqa: E731
                                        placement.SlotsSeen([], 3, table), now).slot
    assert pick(30.0) == 2
    table.side_call(30.0)
    assert table.reserving(31.0) and pick(31.0) == 0
    assert not table.reserving(150.0)


def _busy(sid, *, prompt=None, done=0, decoded=0, remain=None, prefix_tokens=0):
    entry = {"id": sid, "is_processing": True, "n_prompt_tokens": prompt or prefix_tokens,
             "n_prompt_tokens_processed": done}
    if decoded:
        entry["next_token"] = [{"n_decoded": decoded, "n_remain": remain if remain is not None else -1}]
    return entry


def test_with_every_slot_busy_a_new_session_queues_where_it_reaches_its_first_token_soonest():
    def state_now():
        state = st.ServerState("u", total_slots=3)
        for i in range(3):
            st.claim(state, f"o{i}", i, 50.0)
        return state

    # slot 0 prefills 3,000 tokens more, slot 1 generates 40 more tokens at 25 prefill tokens each (1,000),
    # slot 2 generates with no limit: nobody can size it
    live = [_busy(0, prompt=4000, done=1000), _busy(1, prompt=900, done=900, decoded=10, remain=40),
            _busy(2, prompt=500, done=500, decoded=5)]
    seen = placement.SlotsSeen(live, 3, decode_cost=25.0)
    choice = placement.assign(Settings(), state_now(), placement.Seeker("new", None), seen, 60.0)
    assert (choice.slot, choice.why) == (1, Why.ALL_BUSY_SHORTEST)
    # no decode speed measured yet: the generating slot cannot be sized; the prefilling one can
    choice = placement.assign(Settings(), state_now(), placement.Seeker("new", None), placement.SlotsSeen(live, 3),
                              60.0)
    assert (choice.slot, choice.why) == (0, Why.ALL_BUSY_SHORTEST)


def rank(views, **asking):
    ranking = placement.ranking
    return ranking.choose(ranking.Policy.AUTO, views, ranking.Asking(0.0, 300.0, **asking))


def test_a_busy_slot_holding_the_session_s_prefix_spares_its_prefill_and_unknown_work_ranks_last():
    views = [placement.ranking.SlotView(0, 3000, busy=True, prefix="p"), placement.ranking.SlotView(1, 10, busy=True)]
    # 2,000 tokens left on both; slot 0 holds the new session's 1,600-token (6,400 chars) prefix: 400 to wait
    live = [_busy(0, prompt=5000, done=3000), _busy(1, prompt=2100, done=100)]
    got = placement.waits(views, placement.SlotsSeen(live, 2), "p", 6400)
    assert [v.wait_tokens for v in got] == [400.0, 2000.0]
    assert rank(got, prefix="p").slot == 0
    # without /slots, the prompts of ours open there are the wait; a slot with none of ours is unknown
    got = placement.waits(views, placement.SlotsSeen(None, 2, ahead={1: (800,)}), "p", 6400)
    assert [v.wait_tokens for v in got] == [None, 200.0]
    choice = rank(got, prefix="p")
    assert (choice.slot, choice.why) == (1, Why.ALL_BUSY_SHORTEST)
    unknown = rank(views)
    assert unknown.why is Why.ALL_BUSY                    # nothing sized: as before, by the owners' claims


def test_the_requests_of_ours_queued_behind_a_busy_slot_count_in_its_wait():
    """Three new sessions placed within seconds on every-slot-busy: each one's wait is the running work plus
    those placed there before it (bench mix-4: the third waited 337 s behind two 9,000-token prompts while
    another slot had 1,000 tokens left)."""
    views = [placement.ranking.SlotView(0, 3000, busy=True), placement.ranking.SlotView(1, 10, busy=True)]
    live = [_busy(0, prompt=3100, done=3000), _busy(1, prompt=1100, done=100)]
    alone = placement.waits(views, placement.SlotsSeen(live, 2, ahead={0: (12_400,)}), None, 0)
    assert [v.wait_tokens for v in alone] == [100.0, 1000.0]  # the running one: /slots sizes it
    queued = placement.waits(views, placement.SlotsSeen(live, 2, ahead={0: (12_400, 36_000, 36_000)}), None, 0)
    assert [v.wait_tokens for v in queued] == [18_100.0, 1000.0]
    choice = rank(queued)
    assert (choice.slot, choice.why) == (1, Why.ALL_BUSY_SHORTEST)


def test_work_left_reads_a_busy_slot_s_entry():
    from slotlogic.server import work_left
    assert work_left(_busy(0, prompt=4000, done=1000), None) == 3000.0
    # measured on the server: 2,731 prompt tokens, 1,524 of them from the slot's cache, 0 processed in one batch
    assert work_left({**_busy(0, prompt=2731, done=0), "n_prompt_tokens_cache": 1524}, None) == 1207.0
    assert work_left(_busy(0, prompt=900, done=900, decoded=3, remain=40), 25.0) == 1000.0
    assert work_left(_busy(0, prompt=900, done=900, decoded=3, remain=40), None) is None  # no decode speed
    assert work_left(_busy(0, prompt=900, done=900, decoded=3), 25.0) is None            # n_remain -1: no limit
    assert work_left({"id": 0, "is_processing": False, "n_prompt_tokens": 9}, 25.0) is None
    assert work_left({"id": 0, "is_processing": True, "n_prompt_tokens": True, "n_prompt_tokens_processed": 0},
                     1.0) is None
    assert work_left(None, 1.0) is None


def test_a_slot_with_a_request_of_ours_open_ranks_busy_before_slots_shows_it_running():
    """A known session's turn sent to slot 1 a moment ago (not yet `is_processing`): a new session placed now does
    not take that slot as an idle one (its owner is the colder) and page the session out under its own request;
    it takes slot 0."""
    state = st.ServerState("u", total_slots=2)
    st.claim(state, "a", 0, 10.0)
    st.claim(state, "b", 1, 5.0)  # the colder owner: ranked first among claimed idle slots without the rule
    live = [{"id": 0, "is_processing": False, "n_prompt_tokens": 900}, {"id": 1, "is_processing": False,
                                                                          "n_prompt_tokens": 900}]
    seen = placement.SlotsSeen(live, 2, ahead={1: (4000,)})
    choice = placement.assign(Settings(), state, placement.Seeker("new", None), seen, 20.0)
    assert choice.slot == 0
    views = placement.waits(st.views(state, 2, live), seen, None, 0)
    assert views[1].busy and views[1].wait_tokens == 1000 and not views[0].busy
