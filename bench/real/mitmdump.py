"""mitmdump in reverse mode with the slotkeeper addon as a child process, for tests, the bench and the tools."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx

from slotkeeper.launch.mitmdump import free_port, mitm_argv

ROOT = Path(__file__).resolve().parents[2]  # the repository (the processes' cwd)


class MitmProxy:
    """mitmdump in reverse mode in front of `upstream`; a context manager that waits until it listens."""

    def __init__(self, upstream: str, options: dict[str, object] | None = None, *, port: int | None = None,
                 log_path: str | None = None, addon: bool = True, extra: list[str] | None = None,
                 quiet: bool = True) -> None:
        self.upstream = upstream.rstrip("/")
        self.port = port or free_port()
        self.options = options or {}
        self.log_path = log_path
        self.addon = addon
        self.extra = extra or []
        self.quiet = quiet
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> MitmProxy:
        if self.proc is not None and self.proc.poll() is None:
            return self  # already running (entered twice): a second process would be left running on exit
        argv = mitm_argv(self.upstream, self.port, self.options, addon=self.addon, extra=self.extra,
                          quiet=self.quiet)
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=str(ROOT))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mitmdump exited with {self.proc.returncode} (log: {self.log_path})")
            try:
                # Served by the addon itself, or (no addon) any answer at all proves the listener is up.
                httpx.get(self.url + "/_slots/health", timeout=1.0)
                return self
            except httpx.HTTPError:
                time.sleep(0.1)
        self.stop()  # never left running when it did not come up
        raise TimeoutError(f"mitmdump on {self.url} not listening after {timeout}s")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> MitmProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
