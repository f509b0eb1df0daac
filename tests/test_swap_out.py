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

    async def fails() -> dict[str, bool] | None:
        raise OSError("refused")

    async def silent() -> dict[str, bool] | None:
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

    async def running() -> dict[str, bool] | None:
        asked.append(1)
        return {"main": True}

    async def run() -> Swapper:
        sw = Swapper()
        guard = SwapGuard(lambda e: None)
        await guard.before(sw, "main", running, lambda name: None)  # asked once: not known yet
        await guard.before(sw, "main", running, lambda name: None)
        return sw

    sw = asyncio.run(run())
    assert asked == [1] and sw.loaded == {"main"} and sw.recency == ["main"]
    assert swap_out.HOLD_SECONDS > 0


def test_a_swap_under_way_is_not_learned_as_two_models_loaded_together():
    sw = Swapper()
    sw.seen({"main": True, "helper": False})  # helper starting while main is still listed: a swap, not a pair
    assert sw.loaded == {"main", "helper"} and sw.together == frozenset()
    sw.seen({"main": True, "embed": True})
    assert sw.together == {frozenset({"main", "embed"})}


class FakeClient:
    def __init__(self, answers: dict[str, object]) -> None:
        self.answers = answers

    async def get_json(self, path: str) -> object:
        return self.answers.get(path)


def test_what_each_swapper_says_it_holds():
    from slotkeeper.drivers.llama_http import LlamaClient, ModelClient, client_for
    from slotkeeper.drivers.pool_health import Member
    from slotkeeper.drivers.swappers import loaded, model_url

    swap = Member("http://s:1", 0, FakeClient({"/running": {"running": [
        {"model": "main", "state": "ready"}, {"model": "helper", "state": "starting"},
        {"model": "old", "state": "stopping"}, {"model": 3, "state": "ready"}, "junk"]}}), swap=True)
    router = Member("http://r:1", 1, FakeClient({"/models": {"data": [
        {"id": "main", "status": {"value": "loaded"}}, {"id": "helper", "status": {"value": "unloaded"}},
        {"id": "x", "status": {"value": "loading"}}, {"id": "y", "status": "loaded"}]}}), swap=True, router=True)
    plain = Member("http://p:1", 2, FakeClient({}), swap=False)
    assert asyncio.run(loaded(swap)) == {"main": True, "helper": False}
    assert asyncio.run(loaded(router)) == {"main": True, "x": False}
    assert asyncio.run(loaded(Member("http://r:1", 1, FakeClient({}), swap=True, router=True))) is None
    assert model_url(swap, "a b") == "http://s:1/upstream/a%20b"
    assert model_url(router, "a/b") == "http://r:1?model=a%2Fb"
    assert model_url(plain, "main") == "http://p:1"
    client = client_for(model_url(router, "a/b"))  # the router's model is named in each call of the proxy's
    assert isinstance(client, ModelClient) and client.model == "a/b" and client.base_url == "http://r:1"
    assert type(client_for("http://s:1/upstream/main")) is LlamaClient
