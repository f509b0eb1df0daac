"""Which models a request unloads, and which slots are paged out before (slotlogic/swap_out.py)."""

from __future__ import annotations

import asyncio

from slotkeeper.drivers.swap_guard import SwapGuard, Swapper
from slotlogic import swap_out
from slotlogic.paging import PageRecord
from slotlogic.swap_out import Held, SwapFacts, learn, to_save, unloads


def test_llama_swap_default_group_unloads_every_loaded_model_for_one_not_loaded():
    assert unloads(SwapFacts("helper", frozenset({"main"}))) == {"main"}
    assert unloads(SwapFacts("main", frozenset({"main"}))) == frozenset()  # loaded: nothing moves
    assert unloads(SwapFacts("main", frozenset())) == frozenset()
    assert unloads(SwapFacts("", frozenset({"main"}))) == frozenset()


def test_models_seen_loaded_together_stay_loaded():
    together = learn(frozenset(), ["main", "embed"])
    f = SwapFacts("embed", frozenset({"main", "other"}), together=together)
    assert unloads(f) == {"other"}  # another group's model: swapped; main was seen beside embed
    assert learn(together, ["a"]) == together


def test_learned_pairs_are_bounded():
    many = learn(frozenset(), [f"m{i}" for i in range(30)])  # 435 pairs: past the bound, nothing learned
    assert many == frozenset()


def test_router_unloads_the_least_recently_used_only_at_its_cap():
    loaded = frozenset({"a", "b"})
    assert unloads(SwapFacts("c", loaded, max_loaded=3)) == frozenset()  # room left
    assert unloads(SwapFacts("c", loaded, max_loaded=2, recency=("b", "a"))) == {"b"}
    assert unloads(SwapFacts("c", loaded, max_loaded=1, recency=("b", "a"))) == {"a", "b"}
    assert unloads(SwapFacts("c", loaded, max_loaded=0)) == frozenset()  # 0: no cap


def test_slots_to_save_are_conversations_without_a_whole_page():
    ident = "p1:x"
    held = [Held(0, "a", 500), Held(1, "b", 500), Held(2, None, 900), Held(3, "c", 10), Held(4, "d", 500)]
    pages = {"a": PageRecord("f-a", 500, 1.0, model=ident),   # whole: not written again
             "b": PageRecord("f-b", 200, 1.0, model=ident),   # older than its conversation
             "d": PageRecord("f-d", 500, 1.0, model="p1:other")}  # another model's: no page here
    assert [h.slot for h in to_save(held, pages, ident)] == [1, 4]


def test_a_guard_whose_swapper_does_not_answer_lets_the_request_go():
    events = []

    async def fails() -> frozenset[str] | None:
        raise OSError("refused")

    async def silent() -> frozenset[str] | None:
        return None

    async def run() -> Swapper:
        sw = Swapper()
        guard = SwapGuard(events.append)
        await guard.before(sw, "helper", silent, lambda name: None)
        assert sw.loaded is None and not events
        await guard.before(sw, "helper", fails, lambda name: None)
        return sw

    sw = asyncio.run(run())
    assert sw.loaded is None and [type(e).__name__ for e in events] == ["Failed"]


def test_a_model_known_loaded_asks_nothing():
    asked = []

    async def running() -> frozenset[str] | None:
        asked.append(1)
        return frozenset({"main"})

    async def run() -> Swapper:
        sw = Swapper()
        guard = SwapGuard(lambda e: None)
        await guard.before(sw, "main", running, lambda name: None)  # asked once: not known yet
        await guard.before(sw, "main", running, lambda name: None)
        return sw

    sw = asyncio.run(run())
    assert asked == [1] and sw.loaded == {"main"} and sw.recency == ["main"]
    assert swap_out.HOLD_SECONDS > 0
