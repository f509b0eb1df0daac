"""Which llama-swap models get a server, and which are forgotten (slotlogic/swap_models.py)."""

from __future__ import annotations

from slotlogic import swap_models as sm


def test_listed_models_come_from_v1_models_and_running_and_nothing_else():
    models = {"object": "list", "data": [{"id": "a"}, {"id": 3}, "junk", {"id": "x" * 300}]}
    assert sm.listed(models, {"running": [{"model": "b", "state": "ready"}, {"model": None}]}) == {"a", "b"}
    assert sm.listed(None, {"error": 1}) is None and sm.listed({"data": []}, None) == frozenset()
    assert sm.accepts(frozenset({"a"}), "a") and not sm.accepts(frozenset({"a"}), "") and not sm.accepts(
        frozenset({"a"}), "b")


def test_the_list_is_asked_again_only_for_an_unknown_model_and_not_often():
    known = frozenset({"a"})
    assert not sm.due(known, "a", None, 0.0) and sm.due(known, "b", None, 0.0)
    assert not sm.due(known, "b", 100.0, 100.0 + sm.REFRESH_SECONDS - 1) and sm.due(known, "b", 100.0, 130.0)


def test_idle_ones_go_then_the_least_recently_used_never_one_in_flight():
    used = {"u1": 0.0, "u2": 50.0, "u3": 900.0}
    assert sm.to_forget(used, {}, 1000.0, cap=16) == ["u1", "u2"]          # idle past IDLE_SECONDS
    assert sm.to_forget(used, {"u1": 1}, 1000.0, cap=16) == ["u2"]         # in flight: kept
    assert sm.to_forget({"u1": 990.0, "u2": 995.0}, {}, 1000.0, cap=2, room_for=1) == ["u1"]
    assert sm.to_forget({"u1": 990.0, "u2": 995.0}, {"u1": 1, "u2": 2}, 1000.0, cap=2, room_for=1) == []
