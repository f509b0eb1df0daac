"""The two-model workflow's figures (bench/model_swap.py): reuse after a swap back, prefill, saves and restores."""

from __future__ import annotations

import json

from bench import model_swap


def test_reuse_counts_what_a_sessions_previous_prompt_left_and_only_turns_after_a_swap(tmp_path):
    turns = [
        {"session": "s0", "turn": 0, "swapped_back": False, "prompt_n": 900, "cache_n": 0, "error": None},
        {"session": "helper", "turn": 0, "swapped_back": False, "prompt_n": 50, "cache_n": 0, "error": None},
        {"session": "s0", "turn": 1, "swapped_back": True, "prompt_n": 100, "cache_n": 900, "error": None},
        {"session": "s1", "turn": 0, "swapped_back": False, "prompt_n": 1000, "cache_n": 0, "error": None},
        {"session": "s1", "turn": 1, "swapped_back": True, "prompt_n": 850, "cache_n": 250, "error": None},
    ]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in [
        {"kind": "swap-out", "saved": 2, "lost": 1, "seconds": 0.5},
        {"kind": "page", "in": "aaaa", "seed": False, "seconds": 0.25},
        {"kind": "page", "in": "bbbb", "seed": True, "seconds": 9.0},  # a seed: nobody's page-in
        {"kind": "request"}]))
    row = model_swap._summary("auto", turns, ["main", "helper", "main"], jsonl)
    assert row["swap_backs"] == 2 and row["prefilled_after_swap"] == 950
    assert row["reuse_min_pct"] == 25.0 and row["reuse_mean_pct"] == 62.5
    assert (row["model_loads"], row["saves"], row["lost"], row["save_s"], row["restore_s"]) == (3, 2, 1, 0.5, 0.25)
    text = model_swap.text([{"swapper": "llama-swap", **row}])
    assert "62.5%" in text and "llama-swap" in text
