"""`python -m bench.real.llama_server` stops on Ctrl-C in every case: a terminal sends SIGINT to its whole
foreground process group, whether the server is still loading its model or already serving."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from bench.real.mitmdump import ROOT
from slotkeeper.launch.mitmdump import free_port

pytestmark = pytest.mark.real


def as_a_foreground_job() -> None:
    # A terminal's foreground job starts with SIGINT at its default action. A parent that ignores it (a shell's
    # background job, a CI runner) would pass SIG_IGN on through exec, and a signal sent before the launcher
    # blocks it would be dropped by the kernel: not the case under test.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def launcher(port: int) -> subprocess.Popen[bytes]:
    """The launcher as a terminal runs it: the leader of its own process group (the foreground group)."""
    return subprocess.Popen([sys.executable, "-m", "bench.real.llama_server", "--port", str(port),
                             "--slots", "1", "--ctx-per-slot", "512", "--threads", "1"],
                            cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=as_a_foreground_job)


def serving(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def stops_within(proc: subprocess.Popen[bytes], seconds: float) -> float | None:
    t0 = time.monotonic()
    try:
        proc.wait(seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        return None
    return time.monotonic() - t0


@pytest.mark.parametrize("when", ["just-started", "starting", "serving"])
@pytest.mark.parametrize("to", ["process", "group"])
def test_sigint_stops_the_launcher_within_5_s(when, to):
    port = free_port()
    proc = launcher(port)
    if when == "just-started":
        time.sleep(0.05)  # Python still starting: the launcher has not blocked its stop signals yet
    elif when == "starting":
        time.sleep(0.5)  # Python is up, the model not loaded yet
    else:
        deadline = time.monotonic() + 120
        while not serving(port):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    if to == "group":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGINT)
    took = stops_within(proc, 5.0)
    assert took is not None, f"alive 5 s after SIGINT ({when}, sent to the {to})"
    assert not serving(port)
