"""Run mitmdump (or mitmweb) with the slotkeeper addon as a child process, for `make run`, tests and bench.

The flags are the ones the README documents: reverse mode with an explicit `http://` scheme and a loopback
listen address (a bare `@port` binds every interface), `connection_strategy=lazy` so a dead upstream gives a
502 instead of a silently closed connection, and `flow_detail=0` plus `termlog_verbosity=alert` so only the
addon's own lines are printed: the addon logs at mitmproxy's ALERT level, one above the INFO of mitmproxy's
per-connection lines (docs/mitmproxy.md).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from slotkeeper.launch.llama_server import free_port

ROOT = Path(__file__).resolve().parents[2]  # the repository (the processes' cwd)
ADDON = Path(__file__).resolve().parents[1] / "addon.py"  # slotkeeper/addon.py: in a checkout and an installed wheel
WEB_COLUMNS = ("index", "icon", "method", "path", "status", "size", "time", "comment")


def mitm_binary(name: str = "mitmdump") -> str:
    """The mitmdump/mitmweb next to the running interpreter (the venv's), else the one on PATH."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not found next to {sys.executable} or on PATH")
    return found


def mitm_argv(upstream: str, port: int, options: dict[str, object] | None = None, *,
              addon: bool = True, web: bool = False, web_port: int | None = None,
              extra: list[str] | None = None, quiet: bool = True, host: str = "127.0.0.1") -> list[str]:
    """`quiet=False` keeps mitmproxy's own INFO lines (client/server connect, "Loading script") in the output;
    `host` is the listen address (`slotkeeper --listen`)."""
    argv = [mitm_binary("mitmweb" if web else "mitmdump")]
    if addon:
        argv += ["-s", str(ADDON)]
    argv += ["--mode", f"reverse:{upstream}@{host}:{port}",
             "--set", "connection_strategy=lazy", "--set", "flow_detail=0"]
    if quiet:
        argv += ["--set", "termlog_verbosity=alert"]
    if web:
        argv += ["--set", f"web_port={web_port or free_port()}", "--set", "web_open_browser=false",
                 *(a for c in WEB_COLUMNS for a in ("--set", f"web_columns={c}"))]  # a list option: one --set each
    for key, value in (options or {}).items():
        if isinstance(value, list | tuple):
            for item in value:
                argv += ["--set", f"{key}={item}"]
        elif isinstance(value, bool):
            argv += ["--set", f"{key}={'true' if value else 'false'}"]
        else:
            argv += ["--set", f"{key}={value}"]
    return argv + (extra or [])


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
