"""Claim notices, the pure part: which claims a transaction made, their wire form (tolerant of anything), and
what a notice does to the session table."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from slotlogic import notices, shared
from slotlogic.notices import ClaimNotice
from slotlogic.table import SessionTable

A, B, C = "a" * 16, "b" * 16, "c" * 16


def test_a_transaction_tells_every_slot_that_changed_hands_and_nothing_else():
    state = shared.ServerState(upstream="u")
    shared.claim(state, A, 0, 10.0)
    shared.claim(state, B, 1, 11.0)
    before = notices.owners(state)
    shared.claim(state, C, 0, 12.0)                                       # A's slot taken
    shared.touch(state, B, 1, 13.0, requests=2, prefix=None)             # B's own slot: no news
    shared.claim(state, A, 2, 14.0)                                       # a free slot claimed
    shared.forget_session(state, B)                                       # released: tells nobody anything
    assert notices.changes(before, state, "me", 20.0) == [
        ClaimNotice(0, C, A, "me", 12.0), ClaimNotice(2, A, None, "me", 14.0)]


def test_a_notice_round_trips_and_carries_no_text():
    n = ClaimNotice(3, A, B, "0123456789abcdef", 1700000000.5)
    wire = notices.encode(n)
    assert notices.decode(wire) == n and notices.decode(wire.encode()) == n
    assert set(json.loads(wire)) == {"v", "slot", "claimant", "displaced", "instance", "at", "sent"}
    sent = ClaimNotice(3, A, None, "p", 2.0, sent=True)
    assert notices.decode(notices.encode(sent)) == sent


def test_a_message_longer_than_any_notice_is_not_parsed():
    """Anyone who can publish on the channel can send megabytes: a notice is a few hundred bytes."""
    wire = json.loads(notices.encode(ClaimNotice(3, A, B, "0123456789abcdef", 1.0)))
    wire["pad"] = "x" * (1 << 20)
    assert notices.decode(json.dumps(wire)) is None and notices.decode(json.dumps(wire).encode()) is None


@given(st.one_of(st.binary(max_size=200), st.text(max_size=200),
                 st.dictionaries(st.sampled_from(["v", "slot", "claimant", "displaced", "instance", "at", "sent"]),
                                 st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=40)))
                 .map(json.dumps)))
def test_anything_that_is_not_a_notice_is_dropped_never_raised_on(raw):
    n = notices.decode(raw)
    assert n is None or (n.slot >= 0 and n.claimant and n.instance)


def test_a_notice_with_prompt_like_text_in_a_key_is_dropped():
    wire = json.loads(notices.encode(ClaimNotice(0, A, None, "p", 1.0)))
    assert notices.decode(json.dumps({**wire, "claimant": "You are a coding agent"})) is None


def test_the_session_that_held_the_slot_is_displaced_and_stays_so_after_its_own_answer():
    t = SessionTable(ttl=120)
    t.assign(A, 0, 0.0, prefix=None)
    t.answered(A, 0, 1.0)
    t.assign(B, 1, 0.0, prefix=None)
    assert t.claimed_elsewhere(1, B) is None           # our own session is the claimant (one session, two proxies)
    assert t.claimed_elsewhere(2, C) is None           # nobody of ours there
    assert t.claimed_elsewhere(0, C) == A and t.displaced(A, 0)
    t.answered(A, 0, 2.0)  # a request of ours sent before the notice ends before the claimant's runs
    assert t.displaced(A, 0)
    t.assign(A, 0, 3.0, prefix=None)                   # placed again (on the same slot): ours again
    assert not t.displaced(A, 0)


def test_a_session_with_a_request_on_its_way_to_the_slot_is_displaced_too():
    t = SessionTable(ttl=120)
    t.assign(A, 0, 0.0, prefix=None)
    t.answered(A, 0, 1.0)
    t.assign(B, 0, 2.0, prefix=None)   # ours: B's request is on its way there (A already displaced locally)
    assert t.claimed_elsewhere(0, C) == B and t.displaced(B, 0) and t.displaced(A, 0)


def test_a_notice_during_our_own_placement_outlives_its_dispatch_and_answer():
    t = SessionTable(ttl=120)
    t.assign(A, 0, 0.0, prefix=None)   # our claim (paging and the prefix still to come)
    assert t.claimed_elsewhere(0, C) == A  # another proxy claims the slot meanwhile: its request runs after ours
    t.use(A, 1.0)                       # our request leaves
    t.dispatch(A, 0)
    t.answered(A, 0, 2.0)
    assert t.displaced(A, 0)            # the claimant's request comes after it: ours is not there any more


def test_a_send_notice_spares_a_session_of_ours_sent_to_the_slot_after_it():
    t = SessionTable(ttl=120)
    t.assign(A, 0, 0.0, prefix=None)
    t.use(A, 5.0)                                   # our request left at 5.0
    assert t.claimed_elsewhere(0, C, sent_at=4.0) is None and not t.displaced(A, 0)  # theirs ran before ours
    assert t.claimed_elsewhere(0, C, sent_at=6.0) == A and t.displaced(A, 0)         # theirs runs after ours
