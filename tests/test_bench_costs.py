"""bench/costs.py: the cost model's choices against measured moves, and the flags that bring a server."""

from __future__ import annotations

import json

import pytest

from bench import costs as bench_costs
from bench.real.llama_server import LlamaServer
from tests.real_helpers import THREADS


def fake_move(tokens: int, prefill_s: float, restore_s: float, kv: int = 131_072) -> dict:
    n_bytes = tokens * kv
    return {"tokens": tokens, "prompt_per_second": tokens / prefill_s, "prefill_s": prefill_s,
            "save": {"n_saved": tokens, "n_written": n_bytes, "timings": {"save_ms": n_bytes / 2e6}},
            "save_s": n_bytes / 2e9, "restore": {"n_restored": tokens, "n_read": n_bytes,
                                                   "timings": {"restore_ms": restore_s * 1000}},
            "restore_s": restore_s, "resumed_cache_n": tokens - 1, "file": None}


def test_the_first_move_is_made_as_ever_and_the_later_ones_by_their_measured_costs():
    """GPU-like: 20,000 tok/s and 2 GB/s at 128 KiB a token: prefilling a few hundred tokens beats reading
    them back, and the bench's judge learns that from the first move on."""
    moves = [fake_move(n, n / 20_000, n * 131_072 / 2e9) for n in (500, 800, 300, 1000)]
    rows = bench_costs.weigh(moves)
    assert [r["picked"] for r in rows] == ["restore", "prefill", "prefill", "prefill"]
    assert [r["faster"] for r in rows] == ["prefill"] * 4 and sum(r["right"] for r in rows) == 3
    assert rows[1]["est_prefill_s"] == pytest.approx(0.04, rel=0.01) and all(r["resumed"] for r in rows)


@pytest.mark.real
def test_the_bench_measures_a_running_server_given_by_url(tmp_path):
    save = tmp_path / "slots"
    save.mkdir()
    out = tmp_path / "costs.json"
    with LlamaServer(threads=THREADS, slots=1, ctx_per_slot=1024, slot_save_path=str(save),
                     log_path=str(tmp_path / "s.log")) as srv:
        bench_costs.main(["--llama-url", srv.url, "--save-dir", str(save), "--words", "16,24", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["model"] and report["build"] and report["of"] == 2
    assert 23_040 <= report["kv_bytes_per_token"] <= 23_200         # SmolLM2's f16 KV, plus slot-file metadata
    assert report["save_gb_s"] > 0 and report["restore_gb_s"] > 0
    assert all(m["resumed"] for m in report["moves"]) and report["moves"][0]["picked"] == "restore"
    assert {c["codec"] for c in report["compression"]} >= {"zstd-1", "zstd-2", "zstd-3"}
    assert all(c["ratio"] > 1 for c in report["compression"] if c["codec"].startswith("zstd"))


def test_the_main_bench_takes_your_own_binary_model_and_flags_and_runs_the_agent_workloads(tmp_path):
    from bench import __main__ as bench_main
    from bench import configs

    a = bench_main.parse_args(["--llama-server", "/opt/llama/llama-server", "--model", "/m/qwen3-8b.gguf",
                               "--ngl", "99", "--ctk", "q8_0"])
    server = bench_main.server_of(a, tmp_path)
    assert a.own_server and a.workloads == bench_main.OWN_SERVER_WORKLOADS
    assert (server.binary, server.model, server.cache_type) == ("/opt/llama/llama-server", "/m/qwen3-8b.gguf", "q8_0")
    assert server.extra == ("-ngl", "99", "-ctk", "q8_0", "-ctv", "q8_0") and server.own
    opts = configs.proxy_options(configs.CONFIGS["costs"], tmp_path / "st", tmp_path, tmp_path / "l.jsonl")
    assert "slots_cache_type" not in opts                      # the default server: the proxy's default type
    assert not bench_main.parse_args(["--workloads", "agents"]).own_server
    with pytest.raises(SystemExit):
        bench_main.parse_args(["--llama-url", "http://x:8080", "--model", "/m.gguf"])


@pytest.mark.real
def test_the_main_bench_runs_a_workload_on_a_running_server_and_reports_its_speeds_and_choices(tmp_path):
    """`python -m bench --llama-url URL --save-dir DIR`: the server's numbers first, then the workload's rows
    with x limit and the cost model's choices; the slot files the bench wrote are gone afterwards."""
    from bench import __main__ as bench_main
    from bench import configs

    save = tmp_path / "slots"
    save.mkdir()
    out = tmp_path / "out"
    try:
        with LlamaServer(threads=THREADS, slots=4, ctx_per_slot=4096, slot_save_path=str(save),
                         log_path=str(tmp_path / "s.log")) as srv:
            assert bench_main.main(["--llama-url", srv.url, "--save-dir", str(save), "--workloads", "fits",
                                    "--sessions", "2", "--turns", "2", "--configs", "stock,costs",
                                    "--skip-overhead", "--speed-words", "16,24", "--out", str(out)]) == 0
    finally:
        configs.use_server(configs.Server())
    doc = json.loads((out / "latest.json").read_text())
    server = doc["meta"]["server"]
    assert server["model"] and server["build"] and 23_040 <= server["kv_bytes_per_token"] <= 23_200
    assert server["save_gb_s"] > 0 and server["restore_gb_s"] > 0 and server["of"] == 2
    rows = {r["config"]: r for r in doc["rows"]}
    assert set(rows) == {"limit", "stock", "costs"} and all(r["errors"] == 0 for r in rows.values())
    assert rows["costs"]["ratio_to_limit"] <= rows["stock"]["ratio_to_limit"]
    assert rows["costs"]["cost"] and "cost_choices" in rows["costs"] and rows["stock"]["cost"] is None
    assert "KV bytes per token" in (out / "latest.md").read_text()
    assert list(save.iterdir()) == []                          # the bench's slot files removed


@pytest.mark.real
def test_the_main_bench_starts_the_model_it_is_given_and_reports_its_kv_width(tmp_path):
    """`python -m bench --model GGUF`: the bench starts its server on that model (here the 8B-class KV layout of
    tests/tiny_models.py, with the embedded server standing in for the user's binary) and its report gives
    that model's KV bytes per token, measured, beside x limit and the cost model's choices."""
    from bench import __main__ as bench_main
    from bench import configs

    out = tmp_path / "out"
    try:
        # 2,048 tokens a slot hold the workload's longest prompt (~1,200 tokens); at the 8B layout's 128 KiB a
        # token the default 8,192 made the server allocate and clear 4 GiB of KV cache first (~11 s here)
        assert bench_main.main(["--model", "tiny:dense_8b_kv", "--workloads", "fits", "--sessions", "2",
                                "--turns", "2", "--configs", "costs", "--skip-overhead", "--speed-words", "16,24",
                                "--ctx-per-slot", "2048", "--threads", str(THREADS), "--out", str(out)]) == 0
    finally:
        configs.use_server(configs.Server())
    doc = json.loads((out / "latest.json").read_text())
    server = doc["meta"]["server"]
    assert 130_000 <= server["kv_bytes_per_token"] <= 132_000   # 32 layers x 8 KV heads x 128 dims x 2 x f16
    rows = {r["config"]: r for r in doc["rows"]}
    assert rows["costs"]["errors"] == 0 and rows["costs"]["ratio_to_limit"] > 0 and "cost_choices" in rows["costs"]
