"""The cost model on a real llama-server behind a real mitmdump: the speeds are measured from the start-up probe
and every slot save and restore, each page move is logged with both estimates, and a page saved under one KV
cache type is never restored under another."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from bench.real.llama_server import LlamaServer
from bench.real.mitmdump import MitmProxy
from slotlogic.costs import Move
from tests import tiny_models
from tests.real_helpers import THREADS, UPSTREAM_BINARY, ask, jsonl

pytestmark = pytest.mark.real


SYSTEM = "You are a careful coding agent. " + " ".join(f"Rule {i}: read files before editing them." for i in range(8))


def conversation(first: str) -> list[dict[str, str]]:
    """~120 tokens: worth a page (64 or more), short enough to prefill in a few seconds on a busy machine."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first}]


def extend(msgs: list[dict[str, str]], n: int) -> None:
    msgs.append({"role": "assistant", "content": f"Running step {n} now."})
    msgs.append({"role": "user", "content": f"Output of step {n}: " + " ".join(f"line{n}-{k} ok" for k in range(5))})


def three_sessions(px: str) -> dict[str, list[dict[str, str]]]:
    """A and B on the two slots, then C evicts B (B paged out); the caller brings B back."""
    convs = {c: conversation(f"Task {c}: cost model test, keep the whole conversation.") for c in "ABC"}
    for c in "AB":
        ask(px, convs[c])
    time.sleep(3.0)  # A calls again after a pause of its own: its turn gap is 3 s (`slotlogic.returns`)
    extend(convs["A"], 1)
    ask(px, convs["A"])
    time.sleep(3.5)  # A is due back about now, B has been idle 6.5 s: B is the owner least surely back
    ask(px, convs["C"])
    return convs


def test_speeds_are_measured_and_every_page_move_is_weighed_with_both_estimates(tmp_path):
    save = tmp_path / "slots"
    save.mkdir()
    log = tmp_path / "p.log"
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_log_file": str(tmp_path / "req.jsonl"),
            "slots_save_dir": str(save), "slots_prefix_cache": "off", "slots_throughput_probe": True}
    with LlamaServer(threads=THREADS, slots=2, ctx_per_slot=2048, slot_save_path=str(save),
                     log_path=str(tmp_path / "s.log")) as srv, \
            MitmProxy(srv.url, opts, log_path=str(log)) as px:
        deadline = time.monotonic() + 60
        while "slot restore speed" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.2)
        convs = three_sessions(px.url)
        extend(convs["B"], 2)
        back = ask(px.url, convs["B"])
        status: dict[str, Any] = httpx.get(px.url + "/_slots/status", timeout=10).json()["servers"][0]
        metrics = httpx.get(px.url + "/_slots/metrics", timeout=10).text
    text = log.read_text()
    speeds = status["speeds"]
    # SmolLM2: 30 layers × 3 KV heads × 64+64 dims in f16 = 23,040 bytes a token, plus a slot file's per-cell
    # metadata and token list (16 bytes a token)
    assert 23_040 <= speeds["kv_bytes_per_token"] <= 23_200, speeds
    assert speeds["save_mb_s"] > 0 and speeds["restore_mb_s"] > 0 and speeds["prefill_tok_s"] > 1, speeds
    assert "slot save speed" in text and "slot restore speed" in text and "KV 230" in text
    for name in ("slot_save_bytes_per_second", "slot_restore_bytes_per_second", "kv_bytes_per_token",
                 "prefill_tokens_per_second"):
        assert f'slotkeeper_{name}{{server="{srv.url}"}}' in metrics, name
    costs = [r for r in jsonl(tmp_path / "req.jsonl") if r["kind"] == "cost"]
    moves = {(r["move"], r["moved"]) for r in costs}
    # two CPU cores: a restore takes milliseconds, a prefill seconds, so every move is made as before
    assert ("page-out", True) in moves and ("page-in", True) in moves and all(m for _, m in moves), costs
    page_in = next(r for r in costs if r["move"] == "page-in")
    assert page_in["move_s"] * 10 < page_in["prefill_s"] and page_in["bytes"] > page_in["tokens"] * 23_000, page_in
    assert back.cache_n > 64                                             # and the page-in worked
    line = next(x for x in text.splitlines() if ": paged in session " in x)
    assert " tokens, " in line and " MB): restore ~" in line and " vs prefill ~" in line, line
    assert "Task" not in line and "cost model" not in text               # no prompt text in any line
    print(line)


def test_a_page_saved_under_q8_0_is_not_restored_after_a_restart_with_f16(tmp_path):
    """The server runs -ctk/-ctv q8_0 while slots_cache_type says f16: the probe save's size shows it, and the
    pages written are recorded under q8_0. Restarted with f16, the session that comes back prefills: its
    q8_0 page is never sent to the server (llama.cpp would refuse it and wipe the slot)."""
    save = tmp_path / "slots"
    save.mkdir()
    log = tmp_path / "p.log"
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_log_file": str(tmp_path / "req.jsonl"),
            "slots_save_dir": str(save), "slots_prefix_cache": "off", "slots_throughput_probe": True}
    with LlamaServer(threads=THREADS, slots=2, ctx_per_slot=2048, slot_save_path=str(save),
                     log_path=str(tmp_path / "s.log"),
                     extra=["-ctk", "q8_0", "-ctv", "q8_0"]) as srv, \
            MitmProxy(srv.url, opts, log_path=str(log)) as px:
        deadline = time.monotonic() + 60
        while "runs with KV cache" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.2)
        convs = three_sessions(px.url)                                  # a session paged out under q8_0
        q8 = httpx.get(px.url + "/_slots/status", timeout=10).json()["servers"][0]["speeds"]["kv_bytes_per_token"]
        records = jsonl(tmp_path / "req.jsonl")
        order = list(dict.fromkeys(r["session"][:8] for r in records if r["kind"] == "request"))  # A, B, C
        out = [r["out"] for r in records if r["kind"] == "page" and r["out"] is not None and r["out_tokens"]]
        assert out, records
        comes_back = "ABC"[order.index(out[-1])]                      # the last one paged out under q8_0
        srv.cfg.extra = []
        restarted = time.time()
        srv.restart()
        time.sleep(1.0)
        extend(convs[comes_back], 2)
        back = ask(px.url, convs[comes_back])
        f16 = httpx.get(px.url + "/_slots/status", timeout=10).json()["servers"][0]["speeds"]["kv_bytes_per_token"]
    text = log.read_text()
    assert "runs with KV cache q8_0/q8_0 (a slot save's size says so), not f16/f16" in text
    assert 12_000 < q8 < 12_800, q8                        # 34/64 of f16's 23,040 bytes, plus the metadata
    pages = [r for r in jsonl(tmp_path / "req.jsonl") if r["kind"] == "page" and r["t"] > restarted]
    assert [p for p in pages if p["in"] is not None and not p["seed"]] == [], pages   # its q8_0 page stays out
    assert "failed (HTTP" not in text and "page restored into slot" not in text
    assert back.cache_n < 20, (back, f16)

# dense_8b_kv passes too (run by hand for docs/model-capability.md: ~90 s on a busy 2-core machine, so not here)
@pytest.mark.parametrize("make", ["qwen3moe", "lfm2"])
def test_other_architectures_are_checked_pinned_paged_and_resume(tmp_path, monkeypatch, make):
    """Tiny models (tests/tiny_models.py): a Qwen3-MoE (its KV cache is a plain attention cache) and a hybrid
    LFM2 (short-convolution + attention layers: this build appends context checkpoints to slot files, the
    probe save shows it): the model check keeps slot files on, and an evicted session is paged back in and
    resumes."""
    model = getattr(tiny_models, make)(tmp_path / f"{make}.gguf")
    monkeypatch.setenv("SLOTKEEPER_MODEL", str(model))
    save = tmp_path / "slots"
    save.mkdir()
    log = tmp_path / "p.log"
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_log_file": str(tmp_path / "req.jsonl"),
            "slots_save_dir": str(save), "slots_prefix_cache": "off", "slots_throughput_probe": True}
    with LlamaServer(threads=THREADS, slots=2, ctx_per_slot=2048, slot_save_path=str(save),
                     log_path=str(tmp_path / "s.log")) as srv, \
            MitmProxy(srv.url, opts, log_path=str(log)) as px:
        deadline = time.monotonic() + 60
        while "slot restore speed" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.2)
        convs = three_sessions(px.url)
        extend(convs["B"], 2)
        back = ask(px.url, convs["B"])
        status = httpx.get(px.url + "/_slots/status", timeout=10).json()["servers"][0]
    text = log.read_text()
    arch, verdict = {"qwen3moe": ("qwen3moe", "prefixes reusable"), "dense_8b_kv": ("llama", "prefixes reusable"),
                     "lfm2": ("lfm2", "slot files carry context checkpoints")}[make]
    if make == "lfm2" and UPSTREAM_BINARY:  # b11434 writes no checkpoints into slot files: a restore cannot resume
        assert "slot files carry no context checkpoints" in text and "page files stay off" in text, text
        assert status["model"]["slot_files"] == "off"
        return
    assert f"model: {arch}, " in text and verdict in text, text
    assert status["model"]["slot_files"] == "on" and status["speeds"]["kv_bytes_per_token"] > 0
    records = jsonl(tmp_path / "req.jsonl")
    reqs = [r for r in records if r["kind"] == "request"]
    # B's page comes back, unless the cost model measured that prefilling it is quicker on this machine (a tiny
    # model on a quiet machine: seen once in CI): then it is prefilled, as that decision's record says.
    moves = (Move.PAGE_IN.value, Move.PAGE_OUT.value)  # its page-in, or its page-out before it, was not worth it
    recompute = [r for r in records if r["kind"] == "cost" and r["move"] in moves and not r["moved"]
                 and r["session"] == reqs[-1]["session"][:8]]
    if recompute:
        assert not reqs[-1]["reason"].endswith("+paged-in") and recompute[-1]["prefill_s"] <= recompute[-1]["move_s"]
    else:
        assert reqs[-1]["reason"].endswith("+paged-in") and back.cache_n > 64, (reqs[-1], back)
    print(next(x for x in text.splitlines() if f"model: {arch}" in x), reqs[-1]["reason"], back)
    print("\n".join(x for x in text.splitlines() if "paged in" in x or "paged out" in x or "speed" in x))
