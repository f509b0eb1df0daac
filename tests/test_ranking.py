"""Slot ranking: seed 000's rule as a table, and the auto policy's levers."""

from dataclasses import replace

import pytest

from slotlogic.ranking import Asking, Choice, Policy, SlotView, choose, hash_slot, worth_moving
from slotlogic.reasons import Why

NOW, TTL = 1000.0, 120.0
FRESH, STALE = NOW - 10, NOW - 500  # claimed (within TTL) / abandoned


def v(i, tokens=0, last=None, busy=False, owner=None, prefix=None):
    return SlotView(id=i, n_tokens=tokens, busy=busy, last_used=last, owner=owner, prefix=prefix)


SEED_CASES = [
    # (slots, expected slot, why)
    ([v(0), v(1), v(2)], 0, "all empty and free: lowest id"),
    ([v(0, 500), v(1, 100), v(2, 300)], 1, "free: fewest cached tokens"),
    ([v(0, 10, FRESH), v(1, 900, STALE), v(2, 500)], 2, "free before claimed, then fewest tokens"),
    ([v(0, 10, FRESH), v(1, 900, STALE)], 1, "an abandoned claim counts as free"),
    ([v(0, 10, NOW - 5), v(1, 900, NOW - 50), v(2, 5, NOW - 20)], 1, "all claimed: oldest last_used"),
    ([v(0, 300, FRESH), v(1, 100, FRESH), v(2, 200, FRESH)], 1, "claimed, same age: fewest tokens"),
    ([v(0, 100, FRESH), v(1, 100, FRESH)], 0, "full tie: lowest id"),
    ([v(0, 5, busy=True), v(1, 50)], 0, "seed ignores busy (verbatim rule)"),
]


@pytest.mark.parametrize(("slots", "expected", "why"), SEED_CASES, ids=[c[2] for c in SEED_CASES])
def test_seed_ranking_table(slots, expected, why):
    assert choose(Policy.SEED, slots, Asking(NOW, TTL)).slot == expected, why


def test_seed_reason_says_free_or_claimed():
    assert choose(Policy.SEED, [v(0)], Asking(NOW, TTL)) == Choice(0, Why("seed-free"))
    assert choose(Policy.SEED, [v(0, 1, FRESH)], Asking(NOW, TTL)) == Choice(0, Why("seed-claimed-coldest"))


AUTO_CASES = [
    ([v(0, 50, busy=True), v(1, 900, FRESH)], 1, "evict-cheapest", "never a busy slot while an idle one exists"),
    ([v(0), v(1, 800, STALE, prefix="P")], 1, "free-same-prefix", "free slot holding our prefix beats empty"),
    ([v(0, 800, STALE, prefix="Q"), v(1)], 1, "free-empty", "empty beats a free slot with other content"),
    ([v(0, 800, STALE, prefix="Q"), v(1, 300, STALE, prefix="Q")], 1, "free-fewest-tokens",
     "free, foreign content: lose the fewest tokens"),
    ([v(0, 100, FRESH, owner="a"), v(1, 900, STALE, prefix="Q")], 1, "free-fewest-tokens",
     "free before claimed"),
    ([v(0, 900, NOW - 50, owner="a"), v(1, 200, NOW - 5, owner="b")], 0, "evict-cheapest",
     "all claimed: the coldest owner, which spreads new sessions over the slots"),
    ([v(0, 900, NOW - 20, owner="a"), v(1, 200, NOW - 20, owner="b")], 1, "evict-cheapest",
     "all claimed, equally cold: a short-lived owner before a long-lived one"),
    ([v(0, 1, busy=True), v(1, 1, busy=True)], 0, "all-busy", "everything busy: still a valid slot"),
]


@pytest.mark.parametrize(("slots", "expected", "reason", "why"), AUTO_CASES, ids=[c[3] for c in AUTO_CASES])
def test_auto_ranking(slots, expected, reason, why):
    chosen = choose(Policy.AUTO, slots, Asking(NOW, TTL, prefix="P", prefix_tokens=200))
    assert chosen == Choice(expected, Why(reason)), why


def test_auto_uses_reserved_side_slot_last():
    slots = [v(0, 500, FRESH, owner="a"), v(1), v(2)]
    assert choose(Policy.AUTO, slots, Asking(NOW, TTL, reserved=(2,))).slot == 1
    only_reserved_free = [v(0, 500, FRESH, owner="a"), v(1, 500, FRESH, owner="b"), v(2)]
    assert choose(Policy.AUTO, only_reserved_free, Asking(NOW, TTL, reserved=(2,))).slot == 2


def test_with_paging_a_session_is_paged_out_before_the_side_slot_is_taken():
    """Paging makes an eviction cost a save and a restore; the side calls' prompt on the reserved slot is
    nobody's page, so a session placed there would cost the next side call its whole prefill. Without paging
    both are prefilled again: the side prompt surely (the next side call comes), a live conversation less surely
    the longer its owner has been idle, so the cost weighs the two."""
    only_reserved_free = [v(0, 500, FRESH, owner="a"), v(1, 500, NOW - 30, owner="b"), v(2, 900)]
    assert choose(Policy.AUTO, only_reserved_free, Asking(NOW, TTL, reserved=(2,))).slot == 1  # 900 sure, 500 idle
    short_side = [v(0, 500, NOW - 1, owner="a"), v(1, 500, NOW - 2, owner="b"), v(2, 100)]
    side_held = Asking(NOW, TTL, reserved=(2,))
    assert choose(Policy.AUTO, short_side, side_held).slot == 2  # a short side prompt, busy agents
    assert choose(Policy.AUTO, short_side, replace(side_held, paging=True)).slot == 1  # their pages are cheap
    paged = choose(Policy.AUTO, only_reserved_free, Asking(NOW, TTL, reserved=(2,), paging=True))
    assert paged == Choice(1, Why("evict-cheapest"))  # the coldest owner
    all_busy_but_reserved = [v(0, 500, FRESH, owner="a", busy=True), v(1, 500, FRESH, owner="b", busy=True), v(2)]
    assert choose(Policy.AUTO, all_busy_but_reserved, Asking(NOW, TTL, reserved=(2,), paging=True)).slot == 2
    two = [v(0, 500, FRESH, owner="a"), v(1), v(2)]
    assert choose(Policy.AUTO, two, Asking(NOW, TTL, reserved=(2,), paging=True)).slot == 1


def test_with_every_slot_busy_sessions_queue_on_the_side_slot_last():
    """bench mix-4 runs N and R: with every slot busy, the side slot running a 590-token title call was the
    shortest wait, two OpenCode sessions queued there, and the home's next title call waited behind their
    prefills until OpenCode gave up on it. Sessions queue behind other sessions' work; the side slot only when
    it is the one slot there is to queue on."""
    busy = [SlotView(0, 3000, busy=True, wait_tokens=3000), SlotView(1, 4600, busy=True, wait_tokens=4600),
            SlotView(2, 590, busy=True, wait_tokens=590)]
    for paging in (False, True):
        chosen = choose(Policy.AUTO, busy, Asking(NOW, TTL, reserved=(2,), paging=paging))
        assert chosen == Choice(0, Why("all-busy-shortest-wait"))
        assert choose(Policy.AUTO, busy, Asking(NOW, TTL, paging=paging)).slot == 2  # none held back: the shortest
    assert choose(Policy.AUTO, busy[2:], Asking(NOW, TTL, reserved=(2,))).slot == 2


def test_auto_beats_seed_on_the_empty_slot_trap():
    """Seed picks the empty slot (fewest tokens); auto picks the free slot that already holds the prefix."""
    slots = [v(0, 0), v(1, 700, STALE, prefix="P")]
    assert choose(Policy.SEED, slots, Asking(NOW, TTL)).slot == 0
    assert choose(Policy.AUTO, slots, Asking(NOW, TTL, prefix="P", prefix_tokens=300)).slot == 1
    assert choose(Policy.AUTO, slots, Asking(NOW, TTL, prefix="P", prefix_tokens=5)).slot == 0  # too short to pay


def test_unknown_token_counts_do_not_crash():
    slots = [SlotView(0, None, last_used=FRESH), SlotView(1, None)]
    assert choose(Policy.AUTO, slots, Asking(NOW, TTL)).slot == 1
    assert choose(Policy.SEED, slots, Asking(NOW, TTL)).slot == 1


def test_off_and_empty_are_refused():
    with pytest.raises(ValueError):
        choose(Policy.OFF, [v(0)], Asking(NOW, TTL))
    with pytest.raises(ValueError):
        choose(Policy.AUTO, [], Asking(NOW, TTL))


def test_hash_slot_is_stable_and_in_range():
    assert hash_slot("abc", 4) == hash_slot("abc", 4)
    assert {hash_slot(f"s{i}", 4) for i in range(50)} == {0, 1, 2, 3}
    with pytest.raises(ValueError):
        hash_slot("abc", 0)


def test_auto_gives_a_subagent_its_waiting_parents_slot():
    """All slots claimed; the owner of slot 2 answered 1 s ago and is idle: it is waiting for the subagent that
    just started, so its next request is the furthest away. A busy or long-ago answer does not count."""
    slots = [SlotView(0, 900, last_used=NOW - 60, owner="a", owner_done=NOW - 50),
             SlotView(1, 900, busy=True, last_used=NOW - 2, owner="b", owner_done=NOW - 0.5),
             SlotView(2, 1200, last_used=NOW - 3, owner="p", owner_done=NOW - 1)]
    assert choose(Policy.AUTO, slots, Asking(NOW, TTL)) == Choice(2, Why("evict-waiting-parent"))
    stale = [*slots[:2], SlotView(2, 1200, last_used=NOW - 3, owner="p", owner_done=NOW - 10)]
    assert choose(Policy.AUTO, stale, Asking(NOW, TTL)) == Choice(0, Why("evict-cheapest"))


def test_the_cost_writes_over_the_conversation_due_back_last():
    """Of two idle owners with the same tokens, the one whose own turn gap says it is back later is the cheaper
    to write over (a displaced session: no parent rule, it is no subagent). Unmeasured, an owner is taken to
    come back at once: the longer idle, the cheaper."""
    displacer = SlotView(0, 900, last_used=NOW - 0.5, owner="c", owner_done=NOW - 0.5, owner_gap=3.0)
    due_now = SlotView(1, 900, last_used=NOW - 2.9, owner="b", owner_done=NOW - 2.9, owner_gap=3.0)
    asking = Asking(NOW, TTL, spawn=False)
    assert choose(Policy.AUTO, [displacer, due_now], asking) == Choice(0, Why.EVICT_CHEAPEST)  # c back in 2.5 s
    quick = replace(displacer, owner_gap=0.5)  # c calls back within half a second: it is due now
    assert choose(Policy.AUTO, [quick, due_now], asking).slot == 1
    gone = replace(due_now, last_used=NOW - 4, owner_done=NOW - 4, owner_gap=0.3)  # silent 13 of its gaps
    assert choose(Policy.AUTO, [quick, gone], asking).slot == 1
    assert choose(Policy.AUTO, [quick, replace(gone, busy=True)], asking).slot == 0  # a busy slot only if all are
    unmeasured = [replace(s, owner_gap=None) for s in (displacer, due_now)]  # back at once: the longer idle
    assert choose(Policy.AUTO, unmeasured, asking).slot == 1


def test_a_displaced_session_moves_only_onto_an_owner_not_due_back():
    """It stays on its own slot (writing over the displacer) unless the target's owner is free or far less
    surely back than the displacer, by each owner's own turn gap: a fixed idle time cannot tell an agent
    between two calls from one that has finished."""
    own = SlotView(0, 900, last_used=NOW - 1, owner="c", owner_done=NOW - 1, owner_gap=1.0)  # due now
    assert not worth_moving(own, own, NOW, TTL)
    assert worth_moving(SlotView(1, 900), own, NOW, TTL)  # nobody's
    assert worth_moving(SlotView(1, 900, last_used=STALE, owner="x"), own, NOW, TTL)  # expired claim
    assert not worth_moving(SlotView(1, 0, busy=True), own, NOW, TTL)
    thinking = SlotView(1, 900, last_used=NOW - 4, owner="b", owner_done=NOW - 4, owner_gap=4.5)
    assert not worth_moving(thinking, own, NOW, TTL)  # silent 4 s, as it always is between two calls
    finished = replace(thinking, owner_gap=0.5)  # silent 4 s where it calls back within half a second
    assert worth_moving(finished, own, NOW, TTL)
    unmeasured = replace(thinking, owner_gap=None)  # 4 s idle, no habit known: an agent between two calls
    assert not worth_moving(unmeasured, own, NOW, TTL)
    assert worth_moving(replace(unmeasured, last_used=NOW - 8, owner_done=NOW - 8), own, NOW, TTL)
    late = replace(finished, owner_gap=2.0)  # overdue by one of its gaps: half as sure as one due now
    assert worth_moving(late, own, NOW, TTL)
    assert not worth_moving(late, replace(own, owner_gap=6.0), NOW, TTL)  # the displacer is back only in 5 s
    busy_displacer = SlotView(0, 900, busy=True, last_used=NOW - 1, owner="c")
    assert worth_moving(finished, busy_displacer, NOW, TTL)  # staying would also queue behind it
    assert not worth_moving(thinking, busy_displacer, NOW, TTL)


def test_with_paging_a_displaced_session_leaves_only_a_busy_slot_or_for_a_free_one():
    own = SlotView(0, 900, last_used=NOW - 2, owner="c", owner_done=NOW - 1)
    cold = SlotView(1, 900, last_used=NOW - 30, owner="b", owner_done=NOW - 6)
    recent = SlotView(1, 900, last_used=NOW - 1, owner="b", owner_done=NOW - 0.5)
    busy_own = SlotView(0, 900, busy=True, last_used=NOW - 1, owner="c")
    assert not worth_moving(cold, own, NOW, TTL, paging=True)  # staying pages the displacer out: no churn
    assert worth_moving(recent, busy_own, NOW, TTL, paging=True)  # any idle slot beats queueing
    assert not worth_moving(recent, busy_own, NOW, TTL)  # without paging the recent owner would lose a lot
    assert worth_moving(SlotView(2, 0), own, NOW, TTL, paging=True)  # a free slot evicts nobody
    assert not worth_moving(SlotView(2, 0, busy=True), busy_own, NOW, TTL, paging=True)
