"""Side calls' homes and slots (`slotlogic.sidecalls`): one home per side-call prompt, more side slots in a large
pool, and which of them a home goes to."""

from __future__ import annotations

from slotlogic import sidecalls
from slotlogic.ledger import Holds, Ledger
from slotlogic.session import SessionId


def test_each_side_call_prompt_has_a_home_of_its_own():
    came_with = SessionId("0123456789abcdef", "header:x-session-affinity")
    title, memory = sidecalls.home("sig-title", came_with), sidecalls.home("sig-memory", came_with)
    assert title.source == memory.source == "side:prompt" and title.key != memory.key
    assert sidecalls.home("sig-title", SessionId("f" * 16, "content:root")) == title  # any session's title calls
    assert sidecalls.home(None, came_with) == came_with                               # nothing to name it by


def test_a_large_pool_reserves_more_side_slots_and_a_configured_one_is_the_only_one():
    assert [sidecalls.side_slots(n) for n in (1, 2, 4, 7, 8, 13, 14, 32)] == [
        (), (1,), (3,), (6,), (7, 6), (12, 11), (13, 12, 11), (31, 30, 29)]
    assert sidecalls.side_slots(8, configured=2) == (2,) and sidecalls.side_slots(8, configured=9) == (7, 6)


def test_a_side_call_goes_from_memory_only_to_the_side_slot_holding_its_home_s_content():
    ledger = Ledger()
    ledger.resize(8)
    ledger.write(6, Holds.SESSION, "b" * 16, 300)           # another kind's home on slot 6
    ledger.write(7, Holds.SESSION, "a" * 16, 300)           # ours on slot 7
    anyone = lambda s: True  # noqa: E731
    assert sidecalls.home_slot((7, 6), "a" * 16, ledger, anyone, paging=True, paged=True) == 7
    assert sidecalls.home_slot((7, 6), "c" * 16, ledger, anyone, paging=True, paged=False) is None  # placed
    assert sidecalls.home_slot((7, 6), "a" * 16, ledger, lambda s: s != 7, paging=True, paged=True) is None
    ledger.claim(7, "x")
    assert sidecalls.home_slot((7, 6), "a" * 16, ledger, anyone, paging=True, paged=True) is None  # under way
    ledger.unclaim(7, "x")
    # without paging nothing is paged: a kind goes to its own side slot (a stable hash), whatever is there
    assert sidecalls.home_slot((7, 6), "c" * 16, ledger, anyone, paging=False, paged=False) in (7, 6)


def test_a_side_call_s_placement_takes_its_home_s_slot_else_an_idle_one_least_recently_used():
    owners = {7: "a" * 16, 6: "b" * 16}
    used = {7: 10.0, 6: 20.0}.__getitem__
    assert sidecalls.choose_side_slot((7, 6), "b" * 16, owners, lambda s: True, used) == 6
    assert sidecalls.choose_side_slot((7, 6), "c" * 16, owners, lambda s: True, used) == 7      # the older one
    assert sidecalls.choose_side_slot((7, 6), "c" * 16, owners, lambda s: s == 6, used) == 6    # 7 is busy
    assert sidecalls.choose_side_slot((7, 6), "c" * 16, owners, lambda s: False, used) in (7, 6)
