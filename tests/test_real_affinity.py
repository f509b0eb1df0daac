"""`slots_policy=affinity` on a real llama-server behind a real mitmdump: every route's first request goes out
with `id_slot: -1` (llama-server chooses: "selected slot by LRU / LCP similarity" in its log), the slot it
chose is learned without the client seeing anything different, and the session's next request rides that
slot ("selected slot by id") with its cache."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from bench.real.llama_server import LlamaServer
from bench.real.mitmdump import MitmProxy
from slotlogic import verbose
from tests.real_helpers import jsonl

pytestmark = pytest.mark.real

SYSTEM = "You are a careful coding agent. " + " ".join(f"Rule {i}: keep changes small." for i in range(12))


def post(base: str, path: str, body: dict[str, Any]) -> tuple[httpx.Response, bytes]:
    """The answer and its raw body (a stream's bytes as received)."""
    if not body.get("stream"):
        r = httpx.post(base + path, json=body, timeout=120)
        return r, r.content
    with httpx.stream("POST", base + path, json=body, timeout=120) as r:
        raw = b"".join(r.iter_raw())
    return r, raw


def keys(path: str, raw: bytes, stream: bool) -> list[list[str]]:
    """The top-level keys of the answer, or of each streamed event: what the client sees, minus the values."""
    if not stream:
        return [sorted(json.loads(raw))]
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            out.append(sorted(json.loads(line[6:])))
    return out


def wait_for_records(path: Any, count: int, within: float = 30.0) -> None:
    """Until the proxy has finished `count` requests (their JSONL records are written after the answer was
    learned from): a streamed answer's last bytes reach the client before the proxy's response hook runs."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        if path.exists() and sum(r["kind"] == "request" for r in jsonl(path)) >= count:
            return
        time.sleep(0.05)


def wait_for_line(log: Any, text: str, count: int, within: float = 30.0) -> None:
    """Until the proxy's log holds `count` lines with `text` (bounded: the assertions below say what was missing)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        if log.exists() and log.read_text().count(text) >= count:
            return
        time.sleep(0.05)


CASES = [
    ("/v1/chat/completions", False, lambda first: {"messages": [{"role": "system", "content": SYSTEM},
                                                                {"role": "user", "content": first}]}),
    ("/v1/chat/completions", True, lambda first: {"messages": [{"role": "system", "content": SYSTEM},
                                                               {"role": "user", "content": first}],
                                                  "stream_options": {"include_usage": True}}),
    ("/v1/completions", True, lambda first: {"prompt": SYSTEM + "\nTask: " + first}),
    ("/completion", False, lambda first: {"prompt": SYSTEM + "\nTask: " + first}),
    ("/v1/responses", False, lambda first: {"input": SYSTEM + "\nTask: " + first, "max_output_tokens": 4}),
]


def test_every_route_learns_the_slot_the_server_chose_and_the_client_sees_no_difference(tmp_path):
    log = tmp_path / "p.log"
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_policy": "affinity",
            "slots_log_file": str(tmp_path / "req.jsonl"), "slots_probe_interval": 0}
    with LlamaServer(slots=3, ctx_per_slot=2048, threads=1, log_path=str(tmp_path / "s.log")) as srv, \
            MitmProxy(srv.url, opts, log_path=str(log)) as px:
        for n, (path, stream, make) in enumerate(CASES):
            body = {**make(f"route case {n}, the first request."), "max_tokens": 4, "temperature": 0,
                    "stream": stream}
            direct, direct_raw = post(srv.url, path, {**body, "cache_prompt": False})
            first, first_raw = post(px.url, path, body)
            assert first.status_code == direct.status_code == 200, (path, first_raw[:200])
            assert b"__verbose" not in first_raw, path
            assert keys(path, first_raw, stream) == keys(path, direct_raw, stream), path
            # The slot is learned from the answer itself (for a stream, once its last bytes have passed the
            # proxy), or (/v1/responses) from `/slots` read right after it: a client's next turn can come before
            # either on a loaded machine, so the test waits for the proxy to have finished the first request.
            wait_for_records(tmp_path / "req.jsonl", 2 * n + 1)
            wait_for_line(log, "pinned to slot", n + 1)
            second, _ = post(px.url, path, body)   # the same session again: pinned to the learned slot
            assert second.status_code == 200
        time.sleep(0.5)
    # request lines only: a "waiting" line comes when a request waits 15 s (a loaded machine)
    records = [r for r in jsonl(tmp_path / "req.jsonl") if r["kind"] == "request"]
    assert len(records) == 2 * len(CASES), records
    for (path, _, _), first, second in zip(CASES, records[::2], records[1::2], strict=True):
        assert first["reason"] == "pending", (path, first)
        if path == "/v1/responses":  # no slot in the answer: learned from /slots right after it
            assert first["slot"] is None and isinstance(second["slot"], int)
        else:
            assert isinstance(first["slot"], int) and second["slot"] == first["slot"], (path, second)
        assert second["reason"] == "known", (path, first, second, log.read_text()[-3000:])
        assert second["cache_n"] > 50 and second["cache_n"] >= (first["prompt_n"] or 0) - 8, (path, first, second)
    server_log = (tmp_path / "s.log").read_text()
    chosen = server_log.count("selected slot by LRU") + server_log.count("selected slot by LCP similarity")
    assert chosen >= 2 * len(CASES)             # the direct requests and the pending ones
    assert server_log.count("selected slot by id") >= len(CASES)
    text = log.read_text()
    assert "(affinity; __verbose, stripped from the answer)" in text
    assert "(affinity; /slots after the answer)" in text and "(affinity; id_slot in the answer)" in text
    print("\n".join(line for line in text.splitlines() if "pinned to slot" in line))


def test_what_each_way_of_learning_costs(tmp_path):
    """The numbers behind slotlogic/affinity.py's choice: `verbose` costs bytes in one answer per session and a
    strip in the proxy; reading `/slots` costs one round trip after the answer (and hangs while a big prompt is
    prefilled, docs/llama-server.md)."""
    prompt = "Summarise: " + " ".join(f"line {i} of the log says ok." for i in range(40))  # ~420 tokens
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "temperature": 0}
    with LlamaServer(slots=2, ctx_per_slot=4096, threads=1, log_path=str(tmp_path / "s.log")) as srv:
        plain = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120).content
        with_verbose = httpx.post(srv.url + "/v1/chat/completions", json={**body, "verbose": True},
                                  timeout=120).content
        t0 = time.perf_counter()
        for _ in range(20):
            httpx.get(srv.url + "/slots", timeout=3)
        slots_ms = (time.perf_counter() - t0) / 20 * 1000
    t0 = time.perf_counter()
    for _ in range(200):
        stripped = verbose.strip(with_verbose)
    strip_us = (time.perf_counter() - t0) / 200 * 1e6
    assert set(json.loads(stripped)) == set(json.loads(plain))
    extra = len(with_verbose) - len(plain)
    print(f"verbose: +{extra} bytes on a {len(plain)}-byte answer ({len(prompt)}-char prompt), strip "
          f"{strip_us:.0f} us; /slots round trip {slots_ms:.1f} ms (idle server)")
    assert extra > len(prompt)                   # the member carries the prompt: worth stripping
