"""A llama-swap URL in `slots_upstreams`: each model behind it is its own server, reached through
`/upstream/<model>/` for `/props`, `/slots` and save/restore, with a real llama-server as the model and a
faithful stand-in for llama-swap (tests/swap_stub.py: llama-swap itself installs from no registry here)."""

from __future__ import annotations

import time

import httpx
import pytest

from bench.real.mitmdump import MitmProxy
from tests.real_helpers import conversation, extend, jsonl
from tests.swap_stub import SwapStub

pytestmark = pytest.mark.real


def ask_model(base: str, msgs: list[dict[str, str]], model: str) -> tuple[int | None, dict]:
    r = httpx.post(base + "/v1/chat/completions", json={"model": model, "messages": msgs, "max_tokens": 4,
                                                        "temperature": 0}, timeout=120)
    r.raise_for_status()
    slot = r.headers.get("x-slot-id")
    return (int(slot) if slot is not None else None), r.json()["timings"]


def test_each_model_behind_llama_swap_is_a_server_and_an_unloaded_model_a_restarted_one(tmp_path):
    spec = {"slots": 2, "ctx_per_slot": 2048, "threads": 1, "log_path": str(tmp_path / "m1.llama.log")}
    log = tmp_path / "p.jsonl"
    with SwapStub({"m1": spec}) as swap:
        opts = {"slots_upstreams": [swap.url], "slots_state_dir": str(tmp_path / "state"),
                "slots_log_file": str(log), "slots_probe_interval": 1, "slots_prefix_cache": "off"}
        with MitmProxy(swap.url, opts, log_path=str(tmp_path / "p.log")) as px:
            swap.load("m1")  # loaded before the first request: a load slower than /props' 3 s leaves it unpinned
            conv = conversation("Task S: behind llama-swap.")
            slot1, _ = ask_model(px.url, conv, "m1")
            unlisted = httpx.post(px.url + "/v1/chat/completions", timeout=60, json={
                "model": "nope", "messages": conversation("Task U: a model llama-swap does not list.")})
            extend(conv, 1)
            slot2, t2 = ask_model(px.url, conv, "m1")
            # Unload between two probes (every 1 s): a probe already past its `/running` look when the model goes
            # would load it again, as llama-swap loads a model on any request; no proxy can close that window,
            # and under a loaded suite it was hit once (loads 2 where 1 was asserted).
            probes = swap.paths.count("GET /upstream/m1/props")
            deadline = time.monotonic() + 10
            while swap.paths.count("GET /upstream/m1/props") == probes and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.3)  # that probe's last call has come and gone
            swap.unload()
            deadline = time.monotonic() + 15
            while "unloaded by its model" not in (tmp_path / "p.log").read_text() and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(2.5)  # more probes pass: none may load the model again
            loads_while_unloaded = swap.loads
            extend(conv, 2)
            slot3, t3 = ask_model(px.url, conv, "m1")
        text = (tmp_path / "p.log").read_text()
    assert slot1 is not None and slot2 == slot1 and t2["cache_n"] > 0
    assert "GET /upstream/m1/props" in swap.paths and "GET /upstream/m1/slots" in swap.paths
    assert unlisted.status_code == 400 and "x-slot-id" not in unlisted.headers  # llama-swap's answer, unpinned
    assert not [p for p in swap.paths if "/upstream/nope" in p]  # no server made for it
    assert "GET /v1/models" in swap.paths
    assert loads_while_unloaded == 1 and swap.loads == 2  # probes never loaded it; the next request did
    assert f"{swap.url}/upstream/m1 was unloaded by its model swapper" in text
    assert slot3 is not None and t3["prompt_n"] > 0  # a new process: every slot empty
    recs = [r for r in jsonl(log) if r["kind"] == "request"]
    assert {r["upstream"] for r in recs} == {f"{swap.url}/upstream/m1"}
    assert recs[1]["reason"] == "known" and recs[2]["reason"] != "known", recs
