"""A new user's first hour on a real llama-server: the seconds saved are believable, a proxy started after another
exited finds a fresh server fresh, and the first request through `mitmdump -s addon.py` is as quick as the next."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import time

import httpx
import pytest

from bench.real.llama_server import LlamaServer
from bench.real.mitmdump import ROOT, MitmProxy
from slotkeeper.launch.mitmdump import free_port, mitm_argv
from tests.real_helpers import THREADS, conversation

pytestmark = pytest.mark.real


def post(base: str, msgs: list[dict[str, str]]) -> float:
    """One chat completion; the seconds it took, as the client waited for it."""
    t0 = time.monotonic()
    r = httpx.post(base + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, "temperature": 0},
                   timeout=120)
    r.raise_for_status()
    return time.monotonic() - t0


def test_seconds_saved_never_exceed_what_the_requests_took(tmp_path):
    """A one-token prompt (the same conversation sent again: the server prefills its last token only) measures a
    fraction of the server's prefill speed, since its time is mostly the request's fixed cost. Priced at that
    speed, its ~220 cached tokens were "saved" several seconds each, on requests of a tenth of a second."""
    opts = {"slots_state_dir": str(tmp_path / "state")}
    with LlamaServer(threads=THREADS, slots=2, ctx_per_slot=2048, log_path=str(tmp_path / "s.log")) as srv, \
            MitmProxy(srv.url, opts, log_path=str(tmp_path / "p.log")) as px:
        msgs = conversation("Task: count the saved seconds honestly.")
        took = [post(px.url, msgs) for _ in range(4)]
        time.sleep(0.3)
        sessions = httpx.get(px.url + "/_slots/status", timeout=10).json()["servers"][0]["sessions"]
    (s,) = sessions.values()
    print(f"\nrequests took {[round(t, 2) for t in took]} s; saved_s {s['saved_s']}, cached {s['cached_tokens']}")
    assert s["cached_tokens"] > 600 and s["requests"] == 4
    assert 0 < s["saved_s"] <= sum(took)


def test_a_proxy_started_after_another_exited_finds_a_fresh_server_fresh(tmp_path):
    """The state directory keeps the sessions of a proxy that has exited; the server it ran against is gone and a
    fresh one answers on the same port. The new proxy's first session takes an empty slot: nothing is evicted
    for sessions no process serves."""
    port, state = free_port(), str(tmp_path / "state")
    log = tmp_path / "p2.log"
    server = {"port": port, "threads": THREADS, "slots": 2, "ctx_per_slot": 2048}
    with LlamaServer(**server, log_path=str(tmp_path / "s1.log")) as srv, \
            MitmProxy(srv.url, {"slots_state_dir": state}, log_path=str(tmp_path / "p1.log")) as px:
        for first in ("Task A: the old proxy's first session.", "Task B: the old proxy's second session."):
            post(px.url, conversation(first))
    with LlamaServer(**server, log_path=str(tmp_path / "s2.log")) as srv, \
            MitmProxy(srv.url, {"slots_state_dir": state}, log_path=str(log)) as px:
        post(px.url, conversation("Task C: the new proxy's first session."))
        time.sleep(0.3)
    old = (tmp_path / "p1.log").read_text()
    first = next(line for line in log.read_text().splitlines() if "/v1/chat/completions" in line)
    assert "slot=0 why=free" in old and "slot=1 why=free" in old   # the old proxy's sessions held both slots
    assert "why=free-empty" in first, first


def test_the_first_request_through_mitmdump_s_addon_py_is_as_quick_as_the_next(tmp_path):
    """`mitmdump -s addon.py` on a server whose slots are empty, as a new user starts it: the proxy's start-up
    (its probes of the server, the model file's header) runs while the first request comes. It must not wait
    for module loading done on the event loop (httpx's transport and anyio's backend at the first call to the
    server, ~0.4 s; an SSL context for an http:// server, ~0.3 s)."""
    save = tmp_path / "slots"
    save.mkdir()
    with LlamaServer(threads=THREADS, slots=2, ctx_per_slot=2048, slot_save_path=str(save),
                     log_path=str(tmp_path / "s.log")) as srv:
        httpx.post(srv.url + "/completion", json={"prompt": "Warm up.", "n_predict": 1}, timeout=120)
        for slot in range(2):  # its first request done (llama.cpp's own first-request cost), its slots emptied
            httpx.post(srv.url + f"/slots/{slot}?action=erase", timeout=30).raise_for_status()
        port, log = free_port(), tmp_path / "p.log"
        argv = mitm_argv(srv.url, port, {"slots_state_dir": str(tmp_path / "state")}, addon=False,
                         extra=["-s", "addon.py"], quiet=False)
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, cwd=str(ROOT), stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
            try:
                deadline = time.monotonic() + 30
                while "listening at" not in log.read_text():   # what the user waits for before a client starts
                    assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
                    time.sleep(0.02)
                took = []
                for _ in range(6):  # a one-token prompt: the first request prefills no more than the next ones
                    t0 = time.monotonic()
                    httpx.post(f"http://127.0.0.1:{port}/completion", json={"prompt": "Hi", "n_predict": 1},
                               timeout=120).raise_for_status()
                    took.append(time.monotonic() - t0)
            finally:
                proc.send_signal(signal.SIGINT)
                proc.wait(15)
    print(f"\nrequests after start: {[round(t, 2) for t in took]} s")
    assert took[0] < statistics.median(took[1:]) + 0.3, took
