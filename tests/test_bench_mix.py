"""The several-clients workload's numbers (bench/mix_workload.py), from requests as the saved flows give them."""

from __future__ import annotations

from bench import work
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
    assert "| mix-3 | auto | 5 | 1,030 | 0 | - | - | 1 | - | - | 42 | 2 | 2 | 120 | 6.0 | 1/2 | - | - |" in unmetered
    warmed = summary("auto", requests, turns, 42.0, None, warmup=[8_000, 826])  # the proxy's own warm-ups count too
    assert (warmed["prefill"], warmed["warmup"]) == (1030 + 8_826, 8_826)
    assert "| 9,856 | 8,826 |" in table([{"workload": "mix-3", **warmed}])
    metered = {**row, "proxy_lost": {"total": 1200, "unknown": 7, "by_cause": {}}}
    assert table([{"workload": "mix-3", **metered}]).endswith("| 1/2 | 1,200 | 7 |")


def test_every_mix_has_fewer_slots_than_sessions():
    for mix in MIXES.values():
        assert mix.slots < len(mix.clients) * mix.sessions and len(set(mix.clients)) > 1


def test_each_run_has_its_own_limit_from_its_rendered_prompts_and_none_when_one_is_missing():
    """Clients decide their requests as they go, so each configuration's limit comes from its own prompts: the
    tokens beyond the longest prefix any earlier request shared (a second session's copy of the system prompt
    is free, its own tail is not)."""
    requests = [req(0, 1, 100), req(1, 2, 100), req(2, 3, 20)]
    system = list(range(80))
    tokens = [system + [1000 + i for i in range(20)], system + [2000 + i for i in range(20)],
              system + [1000 + i for i in range(20)] + [3000, 3001]]
    row = summary("auto", requests, [], 10.0, None, tokens)
    assert (row["limit"], row["x_limit"], row["unrendered"]) == (100 + 20 + 2, round(220 / 122, 3), 0)
    assert "| 220 | 0 | 122 | 1.80 |" in table([{"workload": "mix-4", **row}])
    partial = summary("auto", requests, [], 10.0, None, [tokens[0], [], tokens[2]])
    assert (partial["limit"], partial["x_limit"], partial["unrendered"]) == (None, None, 1)


def test_work_weighs_each_prefilled_token_by_its_depth_and_so_does_the_limit():
    """A token deep in a context costs more than one at its start. Re-prefilling a displaced conversation
    repeats its cheap start, while its deep new tail costs the same with or without a hit: so the work a
    stock run wastes is a smaller share than its tokens say. A run at its token limit is at its work limit."""
    depth = 1000.0
    assert work.span(0, 1000, depth) == 1000 + 500 and work.span(500, 500, depth) == 0
    assert work.span(9000, 10_000, depth) == 1000 + (10_000**2 - 9000**2) / 2000  # 10.5x a token at the start
    turn1, turn2 = list(range(4000)), list(range(8000))  # one conversation: its second turn extends its first
    tokens = [turn1, turn2]
    at_limit = summary("auto", [req(0, 1, 4000, 0), req(1, 2, 4000, 4000)], [], 10.0, None, tokens, depth=depth)
    stock = summary("stock", [req(0, 1, 4000, 0), req(1, 2, 8000, 0)], [], 10.0, None, tokens, depth=depth)
    assert at_limit["x_limit_work"] == 1.0 and at_limit["work"] == at_limit["limit_work"] == 40_000
    assert (stock["x_limit"], stock["work"], stock["x_limit_work"]) == (1.5, 52_000, 1.3)
    warm = summary("auto", [req(0, 1, 4000, 0), req(1, 2, 4000, 4000)], [], 10.0, None, tokens, warmup=[2000],
                   depth=depth)
    assert warm["work"] == 40_000 + work.span(0, 2000, depth)  # the proxy's warm-ups from an erased slot


def test_a_turn_capped_at_the_answer_limit_is_not_a_failure_and_any_other_non_zero_exit_is():
    """Claude Code exits 1 when its answers stay cut at the bench's 16-token cap after three resumes (bench mix-4:
    2 of 4 turns on stock, 3 of 4 through the proxy, every answer a 200 with stop_reason max_tokens): counted
    as capped, beside the failures. Another client's exit 1 is a failure (it was hidden with Claude Code's)."""
    capped = "API Error: Claude's response exceeded the 16 output token maximum."
    turns = [TurnDone("claude-code", 0, 0, 30.0, 1, "", capped, True), TurnDone("claude-code", 0, 1, 9.0, 0, ""),
             TurnDone("claude-code", 1, 0, 30.0, 1, "", "API Error: 400 bad", False),
             TurnDone("opencode", 0, 0, 10.0, 1, "")]
    row = summary("stock", [req(0, 10, 900, 100)], turns, 42.0, None)
    assert (row["turns_failed"], row["turns_capped"], row["turns"]) == (2, 1, 4)
    assert "| 2/4 (1 capped) | - | - |" in table([{"workload": "mix-4", **row}])
