"""The mitmdump (or mitmweb) command line of the `slotkeeper` command and `make run`.

The flags are the ones the README documents: reverse mode with an explicit `http://` scheme and a loopback
listen address (a bare `@port` binds every interface), `connection_strategy=lazy` so a dead upstream gives a
502 instead of a silently closed connection, and `flow_detail=0` plus `termlog_verbosity=alert` so only the
addon's own lines are printed: the addon logs at mitmproxy's ALERT level, one above the INFO of mitmproxy's
per-connection lines (docs/mitmproxy.md).
"""

from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path

ADDON = Path(__file__).resolve().parents[1] / "addon.py"  # slotkeeper/addon.py: in a checkout and an installed wheel
WEB_COLUMNS = ("index", "icon", "method", "path", "status", "size", "time", "comment")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
