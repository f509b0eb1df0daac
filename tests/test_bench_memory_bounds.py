"""The memory-bounds class of `make reliability` (bench/memory_bounds.py): its stand-in answers like llama-swap and
llama-server, and its rows carry what the soak's table reads."""

from __future__ import annotations

from dataclasses import fields

import httpx

from bench import memory_bounds as mb
from bench.reliability import Row


def test_the_stand_in_lists_only_its_models_like_llama_swap():
    swap = mb.StandIn(models=("m0",))
    try:
        assert httpx.get(swap.url + "/v1/models").json()["data"][0]["id"] == "m0"
        assert httpx.get(swap.url + "/running").json() == {"running": [{"model": "m0", "state": "ready"}]}
        assert httpx.get(swap.url + "/upstream/m0/props").json()["total_slots"] == 4
        assert httpx.get(swap.url + "/upstream/other/props").status_code == 404
        chat = {"messages": [{"role": "user", "content": "x" * 100_000}], "max_tokens": 1}
        assert httpx.post(swap.url + "/v1/chat/completions", json={"model": "m0", **chat}).status_code == 200
        assert httpx.post(swap.url + "/v1/chat/completions", json={"model": "zz", **chat}).status_code == 400
    finally:
        swap.close()


def test_the_summary_row_has_every_field_of_the_soaks_rows_and_fails_with_its_attacks():
    assert {f.name for f in fields(Row)} <= {f.name for f in fields(mb.BoundsRow)}
    over = mb.Attack("x", "1", growth_mb=400.0, alive=True)
    over.check(over.growth_mb <= over.cap_mb, "over the cap")
    assert "| x      | 1    |" in mb.table([over]) and "| 400 " in mb.table([over]) and over.failed == ["over the cap"]
    empty = mb.run(object(), only=("no-such-attack",))
    assert empty.failed == [] and empty.faults == 0 and empty.check(False, "x") is False


def test_every_attack_of_the_issue_has_a_row_with_its_item():
    """Items 1-6, 15 and 16 of issue 20, and the eight of the server's numbers and a request's cost, each have
    at least one attack in the class."""
    names = mb.attack_names()
    assert len(names) == len(mb.attacks()) == len(set(names)) == 19
    assert {"props-slots", "infinite-speed", "responses-items", "body-items", "answer-nprobs", "marks-404",
            "prompts-1mb", "tool-input-deep"} <= set(names)
    assert names[:3] == ["total_slots", "swap_models", "fastpath_heads"]
    small, full = mb.Sizes.small(), mb.Sizes()
    assert small.stream_mb > 4 and small.json_mb > 64 and small.fast_prompt > 4 << 20   # past every cap
    assert (full.stream_mb, full.json_mb, full.swap_models, full.sparse_bytes) == (200, 1024, 1000, 1 << 30)
