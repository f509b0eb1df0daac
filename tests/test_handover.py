"""Slot handovers between proxies sharing one state (slotlogic/handover.py): one writer per slot, handed on only
when the giver answers; the answer says whose conversation its last write left there; bounded and tolerant."""

from slotlogic import handover, shared
from slotlogic.handover import DEAD, Handover

A, B = "a" * 16, "b" * 16


def test_a_slot_nobody_writes_or_whose_writer_is_gone_is_taken_at_once():
    writers, asks, beats = {}, {}, {A: 100.0}
    assert handover.turn(writers, asks, beats, 0, A, "s1", 100.0) is None and writers == {0: A}
    assert handover.turn(writers, asks, beats, 0, A, "s2", 101.0) is None  # still ours: nothing to ask
    assert handover.turn(writers, asks, {A: 100.0}, 0, B, "s3", 100.0 + DEAD) is None  # A not heard of: gone
    assert writers == {0: B} and asks == {}


def test_a_live_writer_is_asked_and_its_answer_makes_the_taker_the_writer():
    writers, asks, beats = {0: A}, {}, {A: 100.0, B: 100.0}
    asked = handover.turn(writers, asks, beats, 0, B, "sb", 101.0)
    assert isinstance(asked, Handover) and asked.giver == A and writers == {0: A}
    assert handover.asked_of(asks, A) == [asked] and handover.asked_of(asks, B) == []
    assert handover.answer(asks, asked) is None
    assert handover.acknowledge(writers, asks, asked, "sa", 101.5, 102.0)
    got = handover.answer(asks, asked)
    assert got is not None and got.last == "sa" and writers == {0: B}
    assert not handover.acknowledge(writers, asks, asked, "sa", 101.5, 102.0)  # answered once


def test_a_newer_ask_by_the_same_taker_supersedes_the_old_one_but_not_another_takers():
    writers, asks, beats = {0: A}, {}, {A: 100.0, B: 100.0, "c" * 16: 100.0}
    first = handover.turn(writers, asks, beats, 0, B, "sb", 101.0)
    other = handover.turn(writers, asks, beats, 0, "c" * 16, "sc", 101.0)
    again = handover.turn(writers, asks, beats, 0, B, "sb2", 102.0)
    assert first is not None and other is not None and again is not None and again.epoch == first.epoch + 1
    assert not handover.acknowledge(writers, asks, first, None, None, 103.0)  # superseded
    assert handover.acknowledge(writers, asks, other, None, None, 103.0)


def test_without_an_answer_the_taker_takes_the_slot_when_its_wait_runs_out():
    writers, asks = {0: A}, {}
    asked = handover.turn(writers, asks, {A: 100.0, B: 100.0}, 0, B, "sb", 101.0)
    assert asked is not None
    handover.forced(writers, asked)
    assert writers == {0: B}
    # the ask stays open: a giver alive after all answers it late, and says what its last request left there
    assert handover.asked_of(asks, A) == [asked]
    assert handover.acknowledge(writers, asks, asked, "sa", 102.0, 105.0)
    late = handover.answer(asks, asked)
    assert late is not None and (late.last, late.answered) == ("sa", 105.0) and writers == {0: B}


def test_the_holder_is_whichever_of_the_two_last_requests_reached_the_server_later():
    given = Handover(0, A, B, "sb", 1, 100.0, 101.0, last="sa", last_at=50.0)
    assert handover.holder(given, None) == "sa"
    assert handover.holder(given, ("mine", 40.0)) == "sa"
    assert handover.holder(given, ("mine", 60.0)) == "mine"
    assert handover.holder(given, ("", 60.0)) is None  # a side call ran last: nobody's conversation


def test_handovers_beats_and_writers_survive_the_store_and_junk_is_dropped():
    st = shared.ServerState("u")
    st.beats[A] = 1.0
    st.writers[3] = A
    asked = handover.turn(st.writers, st.handovers, {A: 1.0, B: 1.0}, 3, B, "sb", 1.5)
    assert asked is not None
    again = shared.from_dict(shared.to_dict(st), "u")
    assert again.writers == {3: A} and again.beats == {A: 1.0} and list(again.handovers.values()) == [asked]
    junk = {"writers": {"1": "not hex!", "x": A, "99999999": A}, "beats": {"<script>": 1.0, B: "soon"},
            "handovers": [{"slot": 1, "giver": "zz", "taker": B}, "x", {"slot": -1}]}
    bad = shared.from_dict(junk, "u")
    assert bad.writers == {} and bad.beats == {} and bad.handovers == {}


def test_old_asks_and_long_dead_proxies_are_pruned_and_the_counts_are_bounded():
    writers, asks, beats = {}, {}, {}
    for i in range(handover.MAX_PROXIES + 5):
        handover.beat(beats, f"{i:016x}", float(i))
    assert len(beats) == handover.MAX_PROXIES
    writers[0] = A
    handover.turn(writers, asks, {A: 0.0, B: 0.0}, 0, B, "sb", 0.0)
    handover.prune(asks, beats, handover.DONE_KEEP + 1)
    assert asks == {}
