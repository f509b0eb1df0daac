"""The shared state model: tolerant parsing, restart/resize, ownership, coalesced touches, views."""

from slotlogic import shared as st
from slotlogic.server import ServerInfo


def test_round_trip():
    s = st.ServerState("http://u", media_marker="m", total_slots=4, n_ctx=8192)
    st.claim(s, "a", 2, 100.0, prefix="P", requests=3)
    back = st.from_dict(st.to_dict(s), "http://u")
    assert back == s


def test_garbage_never_raises():
    for junk in (None, [], "x", {"slots": [1]}, {"slots": {"x": {}, "-1": {"last_used": 1}, "2": "no"}},
                 {"sessions": {"a": {"slot": "1"}, "b": {"slot": 1, "last_used": True}}},
                 {"total_slots": -3, "media_marker": 5}):
        s = st.from_dict(junk, "u")
        assert s.slots == {} and s.sessions == {} and s.total_slots is None


def test_a_stamp_past_a_floats_range_is_dropped_not_raised():
    """JSON integers have no size limit; a stamp no float can hold drops its record like any other bad value."""
    big = 10**400
    s = st.from_dict({"slots": {"0": {"last_used": big}, "1": {"last_used": 5.0}},
                      "sessions": {"a": {"slot": 0, "last_used": big}}}, "u")
    assert list(s.slots) == [1] and s.sessions == {}


def test_restart_forgets_content_but_keeps_claims():
    s = st.ServerState("u", media_marker="m1", total_slots=2)
    st.claim(s, "a", 1, 10.0, prefix="P")
    assert st.note_server(s, ServerInfo(2, "m2")) == st.ServerChange(restarted=True)
    assert s.slots[1].prefix is None and s.slots[1].owner == "a" and st.owned_slot(s, "a") == 1


def test_a_restart_releases_the_claims_of_processes_that_are_gone_and_keeps_the_live_ones():
    """A fresh server after a proxy that exited: its sessions' empty slots protect nothing. A live proxy's
    sessions keep theirs (their spread), and every session keeps its record (it resumes its slot if still free)."""
    s = st.ServerState("u", media_marker="m1", total_slots=3)
    for session, slot, proxy in (("a", 0, "aa"), ("b", 1, "bb"), ("c", 2, None)):
        st.claim(s, session, slot, 100.0)
        st.touch(s, session, slot, 100.0, requests=2, prefix=None, proxy=proxy)
    s.beats.update({"aa": 199.0, "bb": 100.0})       # aa beat a second ago; bb has not for 99 s
    epochs = {k: v.epoch for k, v in s.slots.items()}
    st.note_server(s, ServerInfo(3, "m2"), me="me", now=200.0)
    assert [s.slots[i].owner for i in range(3)] == ["a", None, None]
    assert {k: v.epoch for k, v in s.slots.items()} == epochs and set(s.sessions) == {"a", "b", "c"}
    assert st.held_slots(s, 200.0, 120.0) == {0} and st.owned_slot(s, "b") == 1


def test_a_proxy_that_exits_releases_its_claims():
    s = st.ServerState("u", media_marker="m", total_slots=2)
    for session, slot, proxy in (("a", 0, "aa"), ("b", 1, "bb")):
        st.claim(s, session, slot, 100.0)
        st.touch(s, session, slot, 100.0, requests=1, prefix=None, proxy=proxy)
    s.beats.update({"aa": 100.0, "bb": 100.0})
    assert st.leave(s, "aa") == [0]
    assert s.slots[0].owner is None and s.slots[1].owner == "b" and "aa" not in s.beats
    assert st.held_slots(s, 101.0, 120.0) == {1} and st.owned_slot(s, "a") == 0   # a resumes it while free


def test_resize_drops_out_of_range():
    s = st.ServerState("u", media_marker="m", total_slots=4)
    st.claim(s, "a", 3, 10.0)
    st.claim(s, "b", 1, 10.0)
    assert st.note_server(s, ServerInfo(2, "m")) == st.ServerChange(resized=True)
    assert st.owned_slot(s, "a") is None and 3 not in s.slots and st.owned_slot(s, "b") == 1


def test_first_observation_is_not_an_event():
    assert st.note_server(st.ServerState("u"), ServerInfo(4, "m", 8192)) == st.ServerChange()


def test_ownership_lost_when_another_session_claims():
    s = st.ServerState("u", total_slots=2)
    st.claim(s, "a", 0, 10.0)
    st.claim(s, "b", 0, 200.0)
    assert st.owned_slot(s, "a") is None and st.owned_slot(s, "b") == 0


def test_touch_refreshes_own_slot_only():
    s = st.ServerState("u", total_slots=2)
    st.claim(s, "a", 0, 10.0)
    st.touch(s, "a", 0, 50.0, requests=4, prefix=None)
    assert s.slots[0].last_used == 50.0 and s.sessions["a"].requests == 4
    st.claim(s, "b", 0, 60.0)
    st.touch(s, "a", 0, 55.0, requests=5, prefix=None)  # older than b's claim: b keeps it
    assert s.slots[0].owner == "b"


def test_views_merge_live_numbers_and_claims():
    s = st.ServerState("u", total_slots=3)
    st.claim(s, "a", 1, 10.0, prefix="P", requests=2)
    live = [{"id": 0, "n_ctx": 1}, {"id": 1, "n_prompt_tokens": 700, "is_processing": True}]
    views = st.views(s, 3, live)
    assert [v.id for v in views] == [0, 1, 2]
    assert views[0].n_tokens == 0  # listed, never ran a task: empty
    assert views[1].n_tokens == 700 and views[1].busy and views[1].owner == "a" and views[1].prefix == "P"
    assert views[2].n_tokens is None  # not listed at all
    assert all(v.n_tokens is None for v in st.views(s, 3, None))


def test_a_holder_without_a_prefix_does_not_borrow_another_owners_from_the_file():
    """The file's newest claim is another session's, older than our holder's answer: the view is our holder's,
    and its prefix is its own (unknown), not the other session's signature."""
    from slotlogic.table import SessionTable

    s = st.ServerState("u", total_slots=2)
    st.claim(s, "opencode", 1, 10.0, prefix="P")
    local = SessionTable(ttl=120.0)
    local.assign("codex", 1, 20.0, prefix=None)
    (view,) = [v for v in st.views(s, 2, None, local) if v.id == 1]
    assert view.owner == "codex" and view.prefix is None
    local.assign("opencode", 1, 30.0, prefix=None)  # the file's owner itself: its own signature stands
    (view,) = [v for v in st.views(s, 2, None, local) if v.id == 1]
    assert view.owner == "opencode" and view.prefix == "P"


def test_prune_keeps_recent_sessions():
    s = st.ServerState("u")
    st.claim(s, "old", 0, 0.0)
    st.claim(s, "new", 1, 900.0)
    st.prune(s, 1000.0, 500.0)
    assert set(s.sessions) == {"new"}


def test_another_proxys_newer_claim_on_our_slot_is_a_displacement():
    from slotlogic.table import Assignment

    state = st.ServerState(upstream="u")
    st.claim(state, "theirs", 1, 20.0)
    st.claim(state, "mine-b", 2, 5.0)
    ours = {"mine-a": Assignment(slot=1, last_used=10.0), "mine-b": Assignment(slot=2, last_used=5.0)}
    assert st.displaced_by_others(state, ours, {1: "mine-a", 2: "mine-b"}) == {1: "theirs"}
    ours["mine-a"].last_used = 30.0  # our request went there after theirs
    assert st.displaced_by_others(state, ours, {1: "mine-a", 2: "mine-b"}) == {}


def test_a_slot_count_or_slot_id_past_the_cap_in_the_state_is_junk():
    """Only `/props` sizes anything: a state naming 100,000,000 slots (or slot ids that far out) is not read
    as such (issue 20: it grew the proxy to 23 GB)."""
    data = {"total_slots": 100_000_000, "slots": {"5": {"last_used": 1.0}, "99999999": {"last_used": 1.0}},
            "sessions": {"a": {"slot": 99999999, "last_used": 1.0}, "b": {"slot": 5, "last_used": 1.0}}}
    s = st.from_dict(data, "http://up")
    assert s.total_slots is None and list(s.slots) == [5] and list(s.sessions) == ["b"]
    capped = st.from_dict({"total_slots": st.MAX_SLOTS}, "http://up")
    assert capped.total_slots == st.MAX_SLOTS
    assert st.from_dict({"total_slots": st.MAX_SLOTS + 1}, "http://up").total_slots is None


def test_idle_clearing_seen_by_one_proxy_is_kept_for_that_server_process_only():
    state = st.ServerState(upstream="u")
    assert st.saw_idle_clearing(state, "m1") and not st.saw_idle_clearing(state, "m1")  # news once
    back = st.from_dict(st.to_dict(state), "u")
    assert st.clears_idle_slots(back, "m1") and not st.clears_idle_slots(back, "m2")  # a restart forgets it
    assert not st.clears_idle_slots(back, None)
    junk = st.to_dict(state) | {"idle_clearing": "x" * 500}
    assert st.from_dict(junk, "u").idle_clearing is None
    assert st.from_dict({"idle_clearing": 5}, "u").idle_clearing is None


def test_the_slots_live_sessions_hold_are_those_claimed_and_used_within_the_ttl():
    state = st.ServerState(upstream="u")
    state.slots = {0: st.SlotRecord(last_used=100.0, owner="a", requests=2),
                   1: st.SlotRecord(last_used=10.0, owner="b", requests=2),     # expired
                   2: st.SlotRecord(last_used=100.0, owner=None, requests=0)}   # nobody's
    assert st.held_slots(state, 110.0, 60.0) == {0}


def test_a_slot_found_emptied_is_kept_for_its_session_bounded_and_read_tolerantly():
    state = st.ServerState(upstream="u")
    st.note_emptied(state, "a", "idle-clear", 10.0)
    st.note_emptied(state, "b", "made-up", 11.0)          # not a cause the state carries
    assert st.from_dict(st.to_dict(state), "u").emptied == {"a": st.Emptied("idle-clear", 10.0)}
    for i in range(st.MAX_EMPTIED + 5):
        st.note_emptied(state, f"s{i}", "restart", 20.0 + i)
    assert len(state.emptied) == st.MAX_EMPTIED and "a" not in state.emptied  # the oldest go first
    junk = {"emptied": {"a": {"cause": "idle-clear"}, "b": {"cause": 3, "at": 1.0}, "c": [], "x" * 500: {
        "cause": "restart", "at": 1.0}, "d": {"cause": "restart", "at": 2.0}}}
    assert st.from_dict(junk, "u").emptied == {"d": st.Emptied("restart", 2.0)}
    assert st.from_dict({"emptied": "no"}, "u").emptied == {}


def test_a_session_ran_on_the_slot_it_was_given_within_the_ttl():
    state = st.ServerState(upstream="u")
    state.sessions = {"a": st.SessionRecord(slot=1, last_used=100.0, requests=2),
                      "b": st.SessionRecord(slot=0, last_used=100.0)}
    assert st.ran_there(state, 1, "a", 110.0, 30.0)
    assert not st.ran_there(state, 0, "a", 110.0, 30.0) and not st.ran_there(state, 1, "a", 140.0, 30.0)
    assert not st.ran_there(state, 0, "b", 110.0, 30.0)   # given, never ran there
