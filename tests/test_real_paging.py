"""Session paging end to end: real llama-server with --slot-save-path, real mitmdump with the addon."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from bench.real.llama_server import LlamaServer
from bench.real.mitmdump import MitmProxy
from slotlogic import paging
from tests.real_helpers import THREADS, ask, conversation, extend, jsonl

pytestmark = pytest.mark.real


def test_an_evicted_session_is_paged_back_in_instead_of_prefilled(tmp_path):
    """Two slots, three sessions. C must evict the coldest owner, B: B's conversation is saved first. B
    returns: it shares its slot with C (nothing is free), C is paged out and B paged in, so B prefills only
    its new turn. Then C returns and gets its own conversation back the same way."""
    save = tmp_path / "slots"
    save.mkdir()
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_log_file": str(tmp_path / "req.jsonl"),
            "slots_save_dir": str(save), "slots_prefix_cache": "off"}
    convs = {c: conversation(f"Task {c}: paging test, keep the whole conversation.") for c in "ABC"}
    with LlamaServer(threads=THREADS, slots=2, ctx_per_slot=2048, slot_save_path=str(save),
                     log_path=str(tmp_path / "s.log")) as srv, \
            MitmProxy(srv.url, opts, log_path=str(tmp_path / "p.log")) as px:
        first = {c: ask(px.url, convs[c]) for c in "AB"}
        time.sleep(3.0)  # A calls again after a pause of its own: its turn gap is 3 s (`slotlogic.returns`)
        extend(convs["A"], 1)
        ask(px.url, convs["A"])
        time.sleep(3.5)  # A's answer is no longer "just now": C is nobody's subagent; A is due back about now,
        #                  B has been idle 6.5 s: B is the owner least surely back
        first["C"] = ask(px.url, convs["C"])
        extend(convs["B"], 2)
        back_b = ask(px.url, convs["B"])
        extend(convs["C"], 3)
        back_c = ask(px.url, convs["C"])
    records = jsonl(tmp_path / "req.jsonl")
    reqs = [(r["session"][:8], r["slot"], r["reason"]) for r in records if r["kind"] == "request"]
    pages = [r for r in records if r["kind"] == "page"]
    assert first["C"].slot == first["B"].slot and reqs[3][2] == "evict-cheapest", reqs
    b_before = first["B"].cache_n + first["B"].prompt_n
    assert back_b.slot == first["B"].slot and reqs[4][2] == "displaced:shared+paged-in", reqs
    assert back_b.cache_n >= b_before - 2, (back_b, b_before)  # its whole first turn came back from the file
    c_before = first["C"].cache_n + first["C"].prompt_n
    assert reqs[5][2] == "displaced:shared+paged-in" and back_c.cache_n >= c_before - 2, (reqs, back_c)
    # B's first request starts from a copy of A's conversation (they share the system prompt): a seed
    seed, pages = pages[0], pages[1:]
    assert seed["seed"] and seed["in"] == reqs[0][0] and seed["out"] is None and seed["in_tokens"], seed
    assert first["B"].cache_n >= seed["in_tokens"] // 2, (first["B"], seed)
    assert [(p["out"] is not None, p["in"] is not None, p["seed"]) for p in pages] == [
        (True, False, False), (True, True, False), (True, True, False)], pages
    state = json.loads(next((tmp_path / "state").glob("state-*.json")).read_text())
    files = sorted(p.name for p in save.iterdir())
    # B's and C's pages, and A's: the seed save of A's slot is A's page, recorded like any page-out. A page
    # replaced by a newer one of its session stays a minute (a restore planned from it still finds it).
    recorded = sorted(p["file"] for p in state["pages"].values())
    assert len(recorded) == 3 and set(recorded) <= set(files) and len(files) <= 3 + len(pages), (recorded, files)
    assert all(paging.FILE_RE.match(f) for f in files)
    assert all((save / f).stat().st_mode & 0o777 == 0o600 for f in files)  # a page holds a conversation


def test_a_page_out_that_finds_its_slot_emptied_labels_the_loss_idle_clearing(tmp_path):
    """Unified KV with idle clearing, two slots, a save dir, and a cache mode the start-up probe could not tell
    (another client's requests ran on both slots while the proxy started), so sessions are pinned. B's launch
    empties A's idle slot; C, a new session, then takes the coldest slot, A's, and our page-out of A saves
    nothing. That save is the evidence: the server is asked (no restart), A's loss is labelled idle clearing,
    not after C's write (`evicted`), and no page of 0 tokens is recorded (it read as a page still being written,
    and A's placement waited for it)."""
    save = tmp_path / "slots"
    save.mkdir()
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_log_file": str(tmp_path / "req.jsonl"),
            "slots_save_dir": str(save), "slots_prefix_cache": "off", "slots_probe_interval": 0}
    log = tmp_path / "p.log"
    # each its own system prompt: no session starts from a copy of another's (a seed would hide A's loss)
    convs = {c: [{"role": "system", "content": f"Agent {c}. " + msgs[0]["content"]}, *msgs[1:]]
             for c, msgs in ((c, conversation(f"Task {c}: idle clearing under paging.")) for c in "ABC")}
    with LlamaServer(threads=THREADS, slots=2, ctx_per_slot=2048, kv_unified=True, slot_save_path=str(save),
                     cache_ram_mib=8,  # room for one conversation: A's is pushed out of the RAM cache by B's
                     log_path=str(tmp_path / "s.log")) as srv, contextlib.ExitStack() as proxies:
        with _busy(srv.url, 2):  # another client's requests run on every slot while the proxy starts
            px = proxies.enter_context(MitmProxy(srv.url, opts, log_path=str(log)))
            time.sleep(1.5)
        first_a, c, back_a = _emptied_under_paging(px.url, convs, log)
    records = jsonl(tmp_path / "req.jsonl")
    a_key = next(r["session"] for r in records if r["kind"] == "request")
    out_a = [r for r in records if r["kind"] == "page" and r["out"] == a_key[:8]]
    assert c.slot == first_a.slot and out_a and out_a[0]["out_tokens"] == 0, (records, c, first_a)
    assert back_a.cache_n < first_a.cache_n + first_a.prompt_n - 16, back_a
    line = next(x for x in log.read_text().splitlines() if " lost " in x)
    assert f"session={a_key[:8]}" in line and "the server emptied its idle slot" in line, line
    state = json.loads(next((tmp_path / "state").glob("state-*.json")).read_text())
    assert all(p["n_tokens"] > 0 for p in state["pages"].values()), state["pages"]


@contextlib.contextmanager
def _busy(url: str, slots: int) -> Iterator[None]:
    """Long streamed completions on every slot until the block ends (closing a stream ends its task)."""
    stop = threading.Event()

    def run(slot: int) -> None:
        body = {"prompt": "Count.", "n_predict": 4000, "ignore_eos": True, "stream": True, "id_slot": slot}
        with httpx.stream("POST", url + "/completion", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return
    threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in range(slots)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while sum(e.get("is_processing") is True for e in httpx.get(url + "/slots", timeout=10).json()) < slots:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        while any(e.get("is_processing") for e in httpx.get(url + "/slots", timeout=10).json()):
            time.sleep(0.1)


def _emptied_under_paging(url: str, convs: dict, log) -> tuple:
    first_a = ask(url, convs["A"])
    ask(url, convs["B"])  # its launch empties A's idle slot
    time.sleep(3.5)  # A is the coldest owner
    c = ask(url, convs["C"])
    extend(convs["A"], 1)
    back_a = ask(url, convs["A"])
    deadline = time.monotonic() + 15
    while " lost " not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    return first_a, c, back_a
