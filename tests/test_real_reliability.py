"""Reliability fixes against a real llama-server and real mitmdump processes: pages refused after a restart with
another n_ctx, two proxies that stop sharing a slot once one frees, an --api-key server."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from bench.real.llama_server import LlamaServer
from bench.real.mitmdump import MitmProxy
from slotkeeper.launch.mitmdump import free_port
from tests.real_helpers import ask, conversation, extend, jsonl

pytestmark = pytest.mark.real


def wait_for(path: Path, text: str, count: int = 1, timeout: float = 30.0, *, strict: bool = True) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().count(text) >= count:
            return True
        time.sleep(0.2)
    if strict:
        raise TimeoutError(f"{text!r} not seen {count}x in {path}")
    return False


def test_a_page_is_not_restored_after_a_restart_with_another_n_ctx(tmp_path):
    """One slot, sessions A and B: B's first request pages A out. The server restarts with the same settings:
    A comes back from its page. B pages A out again; the server restarts with n_ctx 8192 -> 2048 (the probe's
    case): A's page is from another configuration and is not restored (the old code restored it)."""
    save = tmp_path / "slots"
    save.mkdir()
    log = tmp_path / "p.log"
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_log_file": str(tmp_path / "req.jsonl"),
            "slots_save_dir": str(save), "slots_prefix_cache": "off", "slots_probe_interval": 1}
    port = free_port()
    a, b = conversation("Task A: keep this conversation."), conversation("Task B: another one.")
    srv = LlamaServer(port=port, slots=1, ctx_per_slot=8192, threads=1, slot_save_path=str(save),
                      log_path=str(tmp_path / "s.log"))
    try:
        srv.start()
        with MitmProxy(srv.url, opts, log_path=str(log)) as px:
            ask(px.url, a)
            ask(px.url, b)  # A is paged out
            srv.restart()
            wait_for(log, "restarted (new media_marker)", 1)
            extend(a, 1)
            same = ask(px.url, a)  # same configuration: A's page comes back
            extend(b, 2)
            ask(px.url, b)  # A is paged out again
            srv.stop()
            srv = LlamaServer(port=port, slots=1, ctx_per_slot=2048, threads=1, slot_save_path=str(save),
                              log_path=str(tmp_path / "s2.log"))
            srv.start()
            wait_for(log, "restarted (new media_marker)", 2)
            extend(a, 3)
            changed = ask(px.url, a)
    finally:
        srv.stop()
    reqs = [r for r in jsonl(tmp_path / "req.jsonl") if r["kind"] == "request"]
    assert reqs[2]["reason"].endswith("paged-in") and same.cache_n > 150, reqs  # A's ~225 tokens came back
    assert "paged-in" not in reqs[4]["reason"] and changed.cache_n < 50, (reqs, changed)
    pages_in = [r for r in jsonl(tmp_path / "req.jsonl") if r["kind"] == "page" and r["in"] is not None]
    assert len(pages_in) == 1, pages_in


def test_two_proxies_stop_sharing_a_slot_once_one_frees(tmp_path):
    """Two mitmdump processes, one state dir, a 2-slot server. A (proxy 1) is on slot 0; slot 1 is busy with a
    long request nobody pinned, so B (proxy 2) is placed onto slot 0 as well. Once slot 1 frees, proxy 2's
    background pass notices the shared slot and B's next request moves to slot 1; A stays on slot 0."""
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_probe_interval": 0}
    a, b = conversation("Task A: proxy one."), conversation("Task B: proxy two.")
    with LlamaServer(slots=2, ctx_per_slot=2048, threads=1, log_path=str(tmp_path / "s.log")) as srv, \
            MitmProxy(srv.url, {**opts, "slots_log_file": str(tmp_path / "p1.jsonl")}) as p1, \
            MitmProxy(srv.url, {**opts, "slots_log_file": str(tmp_path / "p2.jsonl")},
                      log_path=str(tmp_path / "p2.log")) as p2:
        first_a = ask(p1.url, a)
        # slot 1 only has to be busy when proxy 2 places B, right after it is seen processing: 200 tokens are
        # seconds of decoding at any speed (400 only made the test wait longer for them, and B's next turn)
        busy = threading.Thread(target=lambda: httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "count to a thousand"}], "id_slot": 1, "max_tokens": 200,
            "ignore_eos": True, "temperature": 0}))
        busy.start()
        deadline = time.monotonic() + 30
        while not httpx.get(srv.url + "/slots", timeout=5).json()[1]["is_processing"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        first_b = ask(p2.url, b)
        busy.join()
        noticed = wait_for(tmp_path / "p2.log", "shares slot", 1, timeout=15, strict=False)
        extend(b, 1)
        extend(a, 2)
        again_b = ask(p2.url, b)
        again_a = ask(p1.url, a)
    assert (first_a.slot, first_b.slot) == (0, 0)
    assert (again_b.slot, again_a.slot, noticed) == (1, 0, True)  # the old code left B on slot 0
    reasons = [r["reason"] for r in jsonl(tmp_path / "p2.jsonl") if r["kind"] == "request"]
    assert reasons[0] == "evict-cheapest" and reasons[1].startswith("displaced:free"), reasons


def test_an_api_key_server_works_and_the_key_is_never_logged(tmp_path):
    key = "sk-real-test-KEY-9f3e"
    state = tmp_path / "state"
    with LlamaServer(slots=2, ctx_per_slot=1024, threads=1, extra=["--api-key", key],
                     log_path=str(tmp_path / "s.log")) as srv:
        with MitmProxy(srv.url, {"slots_state_dir": str(state), "slots_log_file": str(tmp_path / "a.jsonl")},
                       log_path=str(tmp_path / "a.log")) as px:
            r = httpx.post(px.url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=60,
                           json={"messages": [{"role": "user", "content": "client key"}], "max_tokens": 1})
        with MitmProxy(srv.url, {"slots_state_dir": str(state), "slots_api_key": key,
                                 "slots_log_file": str(tmp_path / "b.jsonl")}, log_path=str(tmp_path / "b.log")) as px:
            s = httpx.post(px.url + "/v1/chat/completions", headers={"x-api-key": key}, timeout=60,
                           json={"messages": [{"role": "user", "content": "option key"}], "max_tokens": 1})
    # Without slots_api_key the client's key goes with its own request only: served, but the proxy's own
    # /props is refused, so it is not pinned (one line says to set the option); with the option it is pinned.
    assert r.status_code == 200 and s.status_code == 200
    assert s.headers.get("x-slot-id") is not None
    reasons = [rec["reason"] for rec in jsonl(tmp_path / "b.jsonl")]
    assert reasons and not any("unpinned" in x for x in reasons), reasons
    assert "slots_api_key" in (tmp_path / "a.log").read_text()
    outputs = [p for p in (*tmp_path.iterdir(), *state.iterdir()) if p.is_file() and p.name != "s.log"]
    assert outputs and all(key.encode() not in p.read_bytes() for p in outputs)
    assert json.loads(next(state.glob("state-*.json")).read_text())["total_slots"] == 2
