"""Placement that weighs the wait, on a real llama-server behind a real mitmdump: with every slot busy, a new
session queues on the slot whose work `/slots` shows ends first (its `n_remain` tokens at the measured decode
speed), not on the one whose owner was seen longest ago; it is answered while the long generation on the
other slot still runs (`why=all-busy-shortest-wait`, slotlogic/placement.py `waits`)."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from bench.real.llama_server import LlamaServer
from bench.real.mitmdump import MitmProxy
from tests.real_helpers import jsonl

pytestmark = pytest.mark.real


def chat(system: str, user: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "temperature": 0, **extra}


def decoding(url: str) -> set[int]:
    slots = httpx.get(url + "/slots", timeout=10).json()
    out = set()
    for s in slots:
        nt = s.get("next_token")
        first = nt[0] if isinstance(nt, list) and nt else nt
        if s.get("is_processing") and isinstance(first, dict) and first.get("n_decoded"):
            out.add(s["id"])
    return out


def both_generating(url: str, long: threading.Thread, short: threading.Thread) -> None:
    """Alpha is started, then Bravo once Alpha generates: both slots generate when this returns."""
    long.start()
    deadline = time.monotonic() + 120
    while not decoding(url) and time.monotonic() < deadline:
        time.sleep(0.2)
    short.start()
    while len(decoding(url)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(decoding(url)) == 2, "both slots should be generating"


def ask_charlie(proxy_url: str) -> float:
    """A new session's short request through the proxy; when its answer came."""
    r = httpx.post(proxy_url + "/v1/chat/completions", timeout=300,
                   json=chat("You are agent Charlie, new here.", "Name one colour.", max_tokens=4))
    assert r.status_code == 200
    return time.monotonic()


def test_with_every_slot_busy_a_new_session_waits_for_the_slot_that_frees_first(tmp_path):
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_log_file": str(tmp_path / "req.jsonl"),
            "slots_client_patience": 180}
    # One compute thread: with two, llama.cpp's spinning thread barrier stalls whenever anything else on the
    # machine runs (the proxy's start-up model read, a loaded CI runner), and two decoding slots then made ~1.5
    # tokens/s each: Bravo's 120 took 66 s, past the 60 s wait bound (seen twice on a loaded 2-core machine).
    with LlamaServer(slots=2, ctx_per_slot=4096, threads=1, log_path=str(tmp_path / "s.log")) as srv, \
            MitmProxy(srv.url, opts, log_path=str(tmp_path / "p.log")) as px:
        # one answer first: the proxy measures the prefill and decode speeds from its timings (a prompt long
        # enough to count for the prefill speed)
        warm = "You are a warm-up. " + " ".join(f"Rule {i}: answer briefly and stay on topic." for i in range(30))
        assert httpx.post(px.url + "/v1/chat/completions", timeout=120,
                          json=chat(warm, "Say hi.", max_tokens=8)).status_code == 200
        done: dict[str, float] = {}

        def run(name: str, system: str, tokens: int) -> None:
            body = chat(system, "Count from one to one thousand.", max_tokens=tokens, ignore_eos=True)
            r = httpx.post(px.url + "/v1/chat/completions", json=body, timeout=600)
            done[name] = time.monotonic() if r.status_code == 200 else -1.0

        # Alpha must outlast Bravo's 120 tokens and Charlie's answer after them: both slots decode in one batch,
        # at one speed, so Alpha runs ~150-200 tokens past its start by then (500: a margin of 2.5x whatever
        # the machine's speed; 1,500 only made the test wait ~15 s longer for Alpha's end)
        long = threading.Thread(target=run, args=("long", "You are agent Alpha, a careful counter.", 500))
        short = threading.Thread(target=run, args=("short", "You are agent Bravo, a quick counter.", 120))
        both_generating(srv.url, long, short)
        charlie = ask_charlie(px.url)
        assert "long" not in done, "answered only after the long generation: queued behind it"
        long.join(600)
        short.join(60)
        records = [x for x in jsonl(tmp_path / "req.jsonl") if "reason" in x]
    assert done["short"] <= charlie
    # answered in this order: the warm-up, Bravo, Charlie, Alpha
    reasons = [x["reason"] for x in records]
    assert len(records) == 4 and reasons[2] == "all-busy-shortest-wait", reasons
    assert records[2]["slot"] == records[1]["slot"] != records[3]["slot"]  # behind Bravo's 120, not Alpha's 1500


def test_a_new_session_waiting_for_one_slot_takes_the_other_when_that_frees_first(tmp_path):
    """`slotlogic.wait` Rule 10 on a real server: by `/slots`, Alpha's slot frees first (under 2,000 tokens left
    against Bravo's 3,000), but Bravo's client gives up after a few seconds and the server drops its task.
    Charlie, placed on Alpha's slot and waiting for it to go idle (with a save dir no slot action is sent to a
    running slot), is placed again on Bravo's slot as soon as that one frees, and is answered while Alpha still
    runs (before Rule 10 it waited for Alpha's whole generation)."""
    save = tmp_path / "save"
    save.mkdir()
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_log_file": str(tmp_path / "req.jsonl"),
            "slots_client_patience": 900, "slots_save_dir": str(save), "slots_prefix_cache": "off"}
    with LlamaServer(slots=2, ctx_per_slot=4096, threads=1, slot_save_path=str(save),
                     log_path=str(tmp_path / "s.log")) as srv, \
            MitmProxy(srv.url, opts, log_path=str(tmp_path / "p.log")) as px:
        warm = "You are a warm-up. " + " ".join(f"Rule {i}: answer briefly and stay on topic." for i in range(30))
        assert httpx.post(px.url + "/v1/chat/completions", timeout=120,
                          json=chat(warm, "Say hi.", max_tokens=8)).status_code == 200
        done: dict[str, float] = {}

        def run(name: str, system: str, tokens: int, give_up: float | None = None) -> None:
            body = chat(system, "Count from one to one thousand.", max_tokens=tokens, ignore_eos=True)
            if give_up is None:
                r = httpx.post(px.url + "/v1/chat/completions", json=body, timeout=600)
                done[name] = time.monotonic() if r.status_code == 200 else -1.0
                return
            # streamed, so the server notices at its next chunk when the client has gone, and drops the task (a
            # request that is not streamed runs to its end)
            until = time.monotonic() + give_up
            with httpx.stream("POST", px.url + "/v1/chat/completions", json=body | {"stream": True},
                              timeout=60) as r:
                for _ in r.iter_lines():
                    if time.monotonic() > until:
                        break
            done[name] = -time.monotonic()

        long = threading.Thread(target=run, args=("long", "You are agent Alpha, a careful counter.", 2000))
        short = threading.Thread(target=run, args=("short", "You are agent Bravo, a quick counter.", 3000, 8.0))
        both_generating(srv.url, long, short)
        charlie = ask_charlie(px.url)
        short.join(60)
        alpha_running = "long" not in done
        long.join(600)
        records = [x for x in jsonl(tmp_path / "req.jsonl") if "reason" in x]
    assert done["short"] < 0 and -done["short"] <= charlie  # Bravo's client gave up before Charlie's answer
    assert alpha_running, "Charlie was answered only after Alpha's generation: it waited for Alpha's slot"
    freed = [x for x in jsonl(tmp_path / "req.jsonl") if x.get("kind") == "freed-first"]
    assert [x["slot"] for x in freed] == [1 - records[-1]["slot"]]  # placed again once, on the slot that freed
    answered = [x for x in records if x.get("error") is None]  # the warm-up, Charlie, Alpha, in the order they ended
    assert len(answered) == 3 and answered[1]["slot"] != answered[2]["slot"], \
        [(x["reason"], x["slot"], x.get("error")) for x in records]
