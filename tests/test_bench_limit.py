"""The physical prefill limit on literal token lists, and the report rows built from it."""

from __future__ import annotations

from bench.client import RequestRecord
from bench.limit import new_tokens
from bench.report import limit_row, run_row


def test_first_request_pays_everything() -> None:
    assert new_tokens([[1, 2, 3, 4]]) == [4]


def test_growing_conversation_pays_only_the_suffix() -> None:
    assert new_tokens([[1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]]) == [3, 2, 1]


def test_identical_prompt_still_costs_one_token() -> None:
    assert new_tokens([[1, 2, 3], [1, 2, 3]]) == [3, 1]
    assert new_tokens([[7], [7], []]) == [1, 1, 1]


def test_longest_prefix_over_any_earlier_request() -> None:
    sys_a, sys_b = [9, 9, 9, 9], [8, 8]
    lists = [[*sys_a, 1, 1], [*sys_b, 5], [*sys_a, 2, 2, 2], [*sys_a, 1, 1, 3], [*sys_b, 5, 6]]
    assert new_tokens(lists) == [6, 3, 3, 1, 1]


def test_prefix_of_an_earlier_request_is_cached() -> None:
    # a shorter prompt fully contained in an earlier one: only the mandatory re-evaluated token
    assert new_tokens([[1, 2, 3, 4, 5], [1, 2, 3]]) == [5, 1]


def test_divergence_in_the_middle() -> None:
    assert new_tokens([[1, 2, 3, 4], [1, 2, 9, 4]]) == [4, 2]


def test_rows() -> None:
    recs = [RequestRecord("stock", "w", "s0", 0, 0.0, 0.1, 0.2, 200, prompt_n=10, cache_n=0),
            RequestRecord("stock", "w", "s0", 1, 1.0, 0.3, 0.4, 200, prompt_n=2, cache_n=10),
            RequestRecord("stock", "w", "s1", 0, 1.5, None, 0.1, 500, error="HTTP 500")]
    row = run_row("w", "stock", recs, 3.0, limit_tokens=8)
    assert row["prefill"] == 12 and row["cached"] == 10 and row["errors"] == 1 and row["requests"] == 3
    assert abs(row["reuse_pct"] - 100 * 10 / 22) < 1e-9
    assert row["ratio_to_limit"] == 1.5
    assert row["ttft_p50_ms"] is not None
    lim = limit_row("w", {"requests": 3, "prompt_tokens": 24, "limit_tokens": 8})
    assert lim["cached"] == 16 and lim["ratio_to_limit"] == 1.0
