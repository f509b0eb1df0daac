"""A side call behind a long request on its slot, on a real llama-server behind a real mitmdump: it waits in
the proxy at most `slots_client_patience` seconds, then goes out with `id_slot: -1` and runs on the idle slot
(`why=wait-bound`), answered while the long request still generates, where pinned it would have queued
behind that whole generation (slotlogic/wait.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from bench.real.llama_server import LlamaServer
from bench.real.mitmdump import MitmProxy
from tests.real_helpers import THREADS, jsonl

pytestmark = pytest.mark.real

TITLE = "You are a title generator. Reply with a short title for the conversation."


def side(text: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": TITLE}, {"role": "user", "content": text}],
            "temperature": 0, **extra}


class LongAnswer:
    """A streamed answer generating far longer than any wait bound, read in a thread; `stop` hangs up
    (llama-server cancels the rest). Started once its first bytes came."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        self.started, self.stopping, self.ended = threading.Event(), threading.Event(), False
        self.thread = threading.Thread(target=self._read, args=(url, body))
        self.thread.start()
        assert self.started.wait(120)

    def _read(self, url: str, body: dict[str, Any]) -> None:
        with httpx.stream("POST", url, json=body, timeout=300) as r:
            for _ in r.iter_raw():
                self.started.set()
                if self.stopping.is_set():
                    return
        self.ended = True

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(60)


def test_a_side_call_behind_a_long_one_runs_on_the_idle_slot_after_its_bound(tmp_path):
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_log_file": str(tmp_path / "req.jsonl"),
            "slots_client_patience": 6}
    with LlamaServer(slots=2, ctx_per_slot=4096, threads=THREADS, log_path=str(tmp_path / "s.log")) as srv, \
            MitmProxy(srv.url, opts, log_path=str(tmp_path / "p.log")) as px:
        long = LongAnswer(px.url + "/v1/chat/completions",
                          side("Count from one to one thousand.", max_tokens=2000, ignore_eos=True, stream=True))
        r = httpx.post(px.url + "/v1/chat/completions", json=side("Title for: fixing a flaky test.", max_tokens=4),
                       timeout=120)
        assert r.status_code == 200
        assert long.thread.is_alive() and not long.ended  # answered while the long one still generates
        long.stop()
        records = [x for x in jsonl(tmp_path / "req.jsonl") if "reason" in x]
    reasons = [x["reason"] for x in records]
    assert reasons.count("side-call") == 1 and reasons.count("wait-bound") == 1, reasons
    short = next(x for x in records if x["reason"] == "wait-bound")
    assert short.get("error") is None and short["prompt_n"] is not None


def test_a_client_that_gives_up_while_the_proxy_holds_its_request_is_logged_as_gone(tmp_path):
    """What `session=… why=free-empty … 0.00s error=transport` was: the client hung up while the proxy still
    held its request (mitmproxy ends such a flow right after the request hook), and the line's clock only
    started when the request left. Now it says who hung up and how long the proxy had it."""
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_log_file": str(tmp_path / "req.jsonl"),
            "slots_client_patience": 12}
    with LlamaServer(slots=2, ctx_per_slot=4096, threads=THREADS, log_path=str(tmp_path / "s.log")) as srv, \
            MitmProxy(srv.url, opts, log_path=str(tmp_path / "p.log")) as px:
        long = LongAnswer(px.url + "/v1/chat/completions",
                          side("Count from one to one thousand.", max_tokens=2000, ignore_eos=True, stream=True))
        with pytest.raises(httpx.ReadTimeout):  # the client's own timeout, shorter than the proxy's hold
            httpx.post(px.url + "/v1/chat/completions", json=side("Title for: a flaky test.", max_tokens=4),
                       timeout=httpx.Timeout(60, read=1.0))
        time.sleep(4)
        long.stop()
        records = [x for x in jsonl(tmp_path / "req.jsonl") if x.get("reason") == "wait-bound"]
    assert len(records) == 1 and records[0]["error"] == "client-gone" and records[0]["seconds"] >= 3.5, records


AGENT = "You are a coding agent. Answer in one short sentence. " * 8


def test_a_turn_sent_unpinned_after_its_wait_is_followed_to_the_slot_that_ran_it(tmp_path):
    """A session's turn waits behind a long request of its own on its slot while the other slot runs another
    session's long answer: held past its bound while every slot runs ours, it goes out with `id_slot: -1` once
    the other slot's answer ends, and runs there (`slotlogic.wait`, Rule 8).
    Its next turn is pinned where it ran (`known`, all of it cached), not back to the old slot, which holds the
    conversation as it was a turn before (mix-4 run K)."""
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_log_file": str(tmp_path / "req.jsonl"),
            "slots_client_patience": 6}

    def turns(*texts: str, **extra: Any) -> dict[str, Any]:
        msgs = [{"role": "system", "content": AGENT}]
        msgs += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]
        return {"messages": msgs, "temperature": 0, "max_tokens": 8, **extra}

    with LlamaServer(slots=2, ctx_per_slot=4096, threads=THREADS, log_path=str(tmp_path / "s.log")) as srv, \
            MitmProxy(srv.url, opts, log_path=str(tmp_path / "p.log")) as px:
        first = httpx.post(px.url + "/v1/chat/completions", json=turns("Fix the parser."), timeout=120).json()
        a1 = first["choices"][0]["message"]["content"]
        home = jsonl(tmp_path / "req.jsonl")[-1]["slot"]
        # the same session generating far longer than the bound; another session's long answer on the other slot
        long = LongAnswer(px.url + "/v1/chat/completions", turns(
            "Fix the parser.", a1, "Count from one to one thousand.", max_tokens=2000, ignore_eos=True, stream=True))
        other = LongAnswer(px.url + "/v1/chat/completions", {
            "messages": [{"role": "system", "content": "You count."}, {"role": "user", "content": "Count."}],
            "max_tokens": 4000, "ignore_eos": True, "stream": True})
        threading.Timer(6.0, other.stopping.set).start()  # past the turn's bound (2 s): the other slot frees first
        second = turns("Fix the parser.", a1, "Now add a test.")
        a2 = httpx.post(px.url + "/v1/chat/completions", json=second, timeout=300).json()["choices"][0]["message"]
        other.thread.join(300)
        time.sleep(1.0)  # where it ran is read from /slots after its answer
        third = httpx.post(px.url + "/v1/chat/completions",
                           json=turns("Fix the parser.", a1, "Now add a test.", a2["content"], "Thanks."), timeout=300)
        assert third.status_code == 200
        long.stop()
        records = [x for x in jsonl(tmp_path / "req.jsonl") if "reason" in x]
    held = next(x for x in records if x["reason"] == "wait-bound")
    last = [x for x in records if x.get("error") is None][-1]  # the third turn (the long ones were cut)
    assert held["error"] is None and last["reason"] == "known" and last["slot"] == 1 - home, records
    assert last["cache_n"] >= held["cache_n"] + held["prompt_n"] - 8, (held, last)
