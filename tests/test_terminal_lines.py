"""The terminal under `make run`'s command line: one slotkeeper line per request, none of mitmproxy's own
per-connection lines (`termlog_verbosity=alert`; the addon logs at mitmproxy's ALERT level)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from bench.real.mitmdump import ROOT, MitmProxy
from slotkeeper.launch.mitmdump import free_port, mitm_argv

BODY = {"model": "m", "messages": [{"role": "system", "content": "You are a coding agent."},
                                   {"role": "user", "content": "Fix the bug."}], "max_tokens": 4}


@pytest.fixture
def upstream() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.fake_upstream", "--port", str(port)], cwd=str(ROOT),
                            stdout=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.readline()  # listening
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(5)


def lines_per_request(upstream: str, tmp_path, *, quiet: bool, n: int = 4) -> tuple[list[str], list[str]]:
    log = tmp_path / f"quiet-{quiet}.log"
    with MitmProxy(upstream, {"slots_state_dir": str(tmp_path / f"state-{quiet}")}, log_path=str(log),
                   quiet=quiet) as px:
        time.sleep(1.0)  # start-up lines written
        start = log.read_text().splitlines()
        for _ in range(n):  # a new connection each time, as many agents do
            httpx.post(px.url + "/v1/chat/completions", json=BODY, timeout=10).raise_for_status()
        time.sleep(0.5)
        lines = log.read_text().splitlines()[len(start):]
    return start, lines


def test_make_runs_command_line_prints_exactly_one_line_per_request(upstream, tmp_path):
    assert "termlog_verbosity=alert" in mitm_argv("http://127.0.0.1:1", 2)
    start, lines = lines_per_request(upstream, tmp_path, quiet=True)
    assert len(lines) == 4 and all("slotkeeper: /v1/chat/completions session=" in line for line in lines), lines
    assert not any("client connect" in line or "Loading script" in line for line in start + lines)
    # without the option mitmproxy's own lines are back: client/server connect and disconnect for each request
    _, loud = lines_per_request(upstream, tmp_path, quiet=False)
    assert sum("client connect" in line for line in loud) == 4 and len(loud) > len(lines), loud
