"""Per-flow bookkeeping between mitmproxy hooks, and the SSE stream tap.

Kept out of `addon.py` because mitmproxy loads scripts under a module name that is not in `sys.modules`,
which breaks dataclasses defined in the script itself; and because none of it needs mitmproxy.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slotlogic import core
from slotlogic.observe import StreamObserver

log = logging.getLogger("slotkeeper")


@dataclass
class FlowInfo:
    """Per-flow facts kept between hooks (live objects stay here, not in flow.metadata: pitfall P17)."""

    plan: core.Plan
    upstream: str
    started: float
    slot: int | None = None
    reason: str = ""
    stream: StreamObserver | None = None
    client_fields: dict[str, Any] = field(default_factory=dict)  # id_slot/cache_prompt as the client sent
    facts: dict[str, Any] | None = None  # server facts behind a new-session decision (replayed offline)


class SSETap:
    """The stream callable: observes SSE events and returns every chunk unchanged (never breaks a stream).

    With `keep` set, a copy of the body is handed to `keep` at the end of the stream, so `-w` recordings,
    mitmweb and server replay have it on mitmproxy 11 (12.x has `store_streamed_bodies` for this)."""

    def __init__(self, observer: StreamObserver, keep: Callable[[bytes], None] | None = None,
                 max_copy: int = 16 << 20) -> None:
        self.observer = observer
        self.failed = False
        self.keep = keep
        self.copy: bytearray | None = bytearray() if keep else None
        self.max_copy = max_copy

    def __call__(self, chunk: bytes) -> bytes:
        if not self.failed:
            try:
                self.observer.feed(chunk)
            except Exception as e:  # an exception here would drop the chunk (pitfall P2)
                self.failed = True
                log.warning("slotkeeper: SSE observer failed (%r); the stream continues unobserved", e)
        if self.copy is not None:
            try:
                if chunk:
                    if len(self.copy) + len(chunk) <= self.max_copy:
                        self.copy += chunk
                elif self.keep is not None:
                    self.keep(bytes(self.copy))
                    self.copy = None
            except Exception as e:
                self.copy = None
                log.warning("slotkeeper: could not keep a copy of the stream: %r", e)
        return chunk


class RequestLog:
    """The one line per request. `direct` writes it to stdout with mitmproxy's time prefix, skipping
    mitmproxy's log pipeline (a terminal handler plus a cross-thread event per record, ~0.15 ms a line),
    and flushes once per event-loop turn, after the response is on its way; `mitmproxy` sends it through
    `logging` like every other line (mitmweb's event log shows it); `off`."""

    SHOWN_AT = frozenset({"info", "debug"})

    def __init__(self, mode: str, verbosity: str) -> None:
        self.mode = mode
        self.quiet = verbosity not in self.SHOWN_AT
        self.pending: list[str] = []

    def emit(self, line: str) -> None:
        if self.mode == "mitmproxy":
            log.info(line)
        elif self.mode == "direct" and not self.quiet:
            now = time.time()
            stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
            self.pending.append(f"[{stamp}] {line}\n")
            if len(self.pending) == 1:
                try:
                    asyncio.get_running_loop().call_soon(self.flush)
                except RuntimeError:  # no loop (a test, shutdown): write now
                    self.flush()

    def flush(self) -> None:
        lines, self.pending = self.pending, []
        try:
            sys.stdout.write("".join(lines))
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
