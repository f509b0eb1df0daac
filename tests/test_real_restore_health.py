"""Restore health end to end: a real llama-server (behind a stand-in of a broken build where the fault needs one),
real mitmdump with the addon. Two sessions take turns on one slot, so every turn after the first two pages the
other out and its own conversation in."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from bench.real.llama_server import LlamaServer
from bench.real.mitmdump import MitmProxy
from bench.restore_faults import RestoreFault
from tests import tiny_models
from tests.real_helpers import SYSTEM, THREADS, ask, conversation, extend, jsonl
from tests.test_real_model_check import wait_for_line

pytestmark = pytest.mark.real
TURNS = 8
BROKEN = "restores answer but do not take"


def take_turns(url: str, turns: int = TURNS) -> list[tuple[str, int, int]]:
    convs = {c: conversation(f"Task {c}: restore health, keep the whole conversation.") for c in "AB"}
    seen = []
    for turn in range(turns):
        c = "AB"[turn % 2]
        if turn >= 2:
            extend(convs[c], turn)
        t = ask(url, convs[c])
        seen.append((c, t.cache_n, t.prompt_n))
    return seen


def run(tmp_path: Path, mode: str | None, ready: str = "", **more: object
        ) -> tuple[list[dict], str, RestoreFault | None, dict]:
    save = tmp_path / "slots"
    save.mkdir()
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_log_file": str(tmp_path / "req.jsonl"),
            "slots_save_dir": str(save), "slots_prefix_cache": "off", **more}
    log = tmp_path / "p.log"
    with LlamaServer(threads=THREADS, slots=1, ctx_per_slot=4096, slot_save_path=str(save),
                     log_path=str(tmp_path / "s.log")) as srv:
        fault = RestoreFault(srv.url, mode, save) if mode else None
        if fault is not None:
            fault.__enter__()
        try:
            with MitmProxy(fault.url if fault else srv.url, opts, log_path=str(log)) as px:
                if ready:  # the model check has read the model's header: the line names its fix
                    wait_for_line(log, ready)
                take_turns(px.url)
                status = httpx.get(px.url + "/_slots/status", timeout=10).json()["servers"][0]
        finally:
            if fault is not None:
                fault.__exit__()
    return jsonl(tmp_path / "req.jsonl"), log.read_text(), fault, status


def after_verdict(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """The page-ins and the judged restores logged after the verdict."""
    at = next(i for i, r in enumerate(records) if r["kind"] == "restores-broken")
    rest = records[at + 1:]
    return ([r for r in rest if r["kind"] == "page" and r["in"] is not None],
            [r for r in rest if r["kind"] == "restore-judged"])


def check_broken(records: list[dict], text: str, fault: RestoreFault, status: dict) -> list[dict]:
    judged = [r for r in records if r["kind"] == "restore-judged"]
    assert [j["took"] for j in judged] == [False, False], judged     # detected at the second restore
    assert len(fault.restores) == 2, fault.restores                   # and none sent after it
    assert after_verdict(records) == ([], [])                         # so no token or second lost to it
    assert text.count(BROKEN) == 1 and status["restores"]["health"] == "broken"
    return judged


def test_a_restore_that_answers_and_keeps_nothing_is_detected_at_the_second(tmp_path):
    """llama.cpp #26676: the restore answers `n_restored`, the next request prefills everything. Without the
    verdict every turn after the second paged in for nothing (6 restores in 8 turns)."""
    records, text, fault, status = run(tmp_path, "noop")
    assert fault is not None
    judged = check_broken(records, text, fault, status)
    assert all(j["restored"] >= 200 and j["cached"] <= 5 for j in judged), judged
    assert "--swa-full" in text.split(BROKEN)[1].splitlines()[0]   # a model not known to need it: both named
    print("\n".join(line for line in text.splitlines() if BROKEN in line))


@pytest.mark.slow
def test_a_sliding_window_restore_without_checkpoints_is_detected_at_the_second(tmp_path, monkeypatch):
    """PRs #24956/#26004: the slot file restored without its context checkpoints; the real server (gemma3,
    window 32) then prefills the next prompt from zero. The line names --swa-full (the model check read the
    model's header). The tiny model prefills ~8,000 tokens a second, faster than a save and a restore: without
    `slots_cost_model=false` the cost model stops paging after the first restore anyway (a model of this size
    never pays for paging; the bug costs where it does)."""
    monkeypatch.setenv("SLOTKEEPER_MODEL", str(tiny_models.gemma3(tmp_path / "gemma3.gguf")))
    records, text, fault, status = run(tmp_path, "no_checkpoints", "model: gemma3", slots_cost_model=False)
    assert fault is not None
    check_broken(records, text, fault, status)
    line = text.split(BROKEN)[1].splitlines()[0]
    assert "start llama-server with --swa-full" in line, line
    print("\n".join(line for line in text.splitlines() if BROKEN in line))


def test_restores_on_the_real_server_take_and_paging_goes_on(tmp_path):
    """The path that works: every page-in is judged to have taken, and paging goes on to the last turn."""
    records, text, _, status = run(tmp_path, None)
    judged = [r for r in records if r["kind"] == "restore-judged"]
    assert len(judged) == TURNS - 2 and all(j["took"] for j in judged), judged
    assert BROKEN not in text and status["restores"]["health"] == "takes"


@pytest.mark.slow
def test_prefix_restores_that_keep_nothing_stop_after_two(tmp_path):
    """The same no-op restore under prefix checkpoints: each new session's prefix file is restored and its
    verification finds nothing cached. Two such restores, then new sessions warm their prefix in memory with
    no restore sent (the proxy restored and rebuilt the file for every new session before)."""
    save = tmp_path / "slots"
    save.mkdir()
    log = tmp_path / "p.log"
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_save_dir": str(save),
            "slots_log_file": str(tmp_path / "req.jsonl"), "slots_probe_interval": 0}
    with LlamaServer(threads=THREADS, slots=4, ctx_per_slot=4096, slot_save_path=str(save),
                     log_path=str(tmp_path / "s.log")) as srv, RestoreFault(srv.url, "noop", save) as fault, \
            MitmProxy(fault.url, opts, log_path=str(log)) as px:
        for i in range(4):
            ask(px.url, [{"role": "system", "content": SYSTEM + f"\n<cwd>/srv/p{i}</cwd>"},
                         {"role": "user", "content": f"Task {i}: a new window."}])
        status = httpx.get(px.url + "/_slots/status", timeout=10).json()["servers"][0]
    records = jsonl(tmp_path / "req.jsonl")
    judged = [(r["move"], r["took"]) for r in records if r["kind"] == "restore-judged"]
    assert judged == [("prefix", False), ("prefix", False)], judged
    assert len(fault.restores) == 2 and after_verdict(records) == ([], [])
    outcomes = [r["outcome"] for r in records if r["kind"] == "checkpoint"]
    assert outcomes[-1] == "warmed", outcomes          # after the verdict: warmed in memory, nothing restored
    assert log.read_text().count(BROKEN) == 1 and status["restores"]["health"] == "broken"
