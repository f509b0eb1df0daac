"""The several-clients workload's numbers (bench/mix_workload.py), from requests as the saved flows give them."""

from __future__ import annotations

from bench.client_workloads import Request
from bench.mix_workload import MIXES, TurnDone, summary, table


def req(start: float, end: float, prompt_n: int | None, cache_n: int | None = 0, *, side: bool = False,
        status: int | None = 200, error: str | None = None) -> Request:
    return Request(start, end, "/v1/chat/completions", None, status, cache_n, prompt_n, side, "k", error)


def test_the_summary_counts_prefill_errors_and_side_calls():
    requests = [req(0, 10, 900, 100), req(1, 2, 50, 500, side=True), req(2, 8, 70, 0, side=True),
                req(3, 4, None, None, error="client-gone"), req(5, 6, 10, 0, status=500)]
    turns = [TurnDone("opencode", 0, 0, 10.0, 0, ""), TurnDone("qwen-code", 0, 0, 12.0, 2, "x")]
    row = summary("auto", requests, turns, 42.0, None)
    assert (row["prefill"], row["cached"], row["errors"], row["side_calls"], row["side_prefill"]) == (
        1030, 600, 2, 2, 120)
    assert row["side_p95_s"] == 6 and row["turns_failed"] == 1 and row["error_kinds"] == ["client-gone", "http-500"]
    unmetered = table([{"workload": "mix-3", **row}])
    assert "| mix-3 | auto | 5 | 1,030 | 42 | 2 | 2 | 120 | 6.0 | 1/2 | - | - |" in unmetered
    metered = {**row, "proxy_lost": {"total": 1200, "unknown": 7, "by_cause": {}}}
    assert table([{"workload": "mix-3", **metered}]).endswith("| 1/2 | 1,200 | 7 |")


def test_every_mix_has_fewer_slots_than_sessions():
    for mix in MIXES.values():
        assert mix.slots < len(mix.clients) * mix.sessions and len(set(mix.clients)) > 1
