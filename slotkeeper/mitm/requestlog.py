"""The log addon: one line per request on the terminal, and the JSONL file.

`slots_log_requests=direct` (the default) writes the line straight to stdout with mitmproxy's time prefix,
skipping mitmproxy's log pipeline (a terminal handler plus a cross-thread event per record, ~0.15 ms a line),
once per event-loop turn, after the response is on its way; `mitmproxy` sends it through `logging` like every
other line (mitmweb's event log shows it); `off`. The JSONL file (`slots_log_file`) gets every request and
every paging and checkpoint step. At shutdown it prints each server's per-session summary.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

from mitmproxy import ctx, exceptions, http

from slotkeeper.drivers.jsonl_log import JsonlLog
from slotkeeper.mitm import options
from slotkeeper.mitm.options import Option
from slotkeeper.mitm.runtime import INFO, Runtime, guarded
from slotlogic import wording
from slotlogic.events import Event, Failed, Stage

log = logging.getLogger("slotkeeper")
MODES = ("direct", "mitmproxy", "off")
SHOWN_AT = frozenset({"alert", "info", "debug"})  # levels at which mitmdump prints our ALERT lines


class TerminalLines:
    """The `direct` writer: lines collected during one event-loop turn, written once after it."""

    def __init__(self) -> None:
        self.pending: list[str] = []

    def emit(self, line: str) -> None:
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


OPTIONS = (
    Option("slots_log_requests", str, "direct",
           "Where the per-request line goes: direct (straight to the terminal, cheap: mitmproxy's log pipeline "
           "costs ~0.15 ms a line), mitmproxy (through mitmproxy's log, e.g. to mitmweb's event log), off.",
           choices=list(MODES)),
    Option("slots_log_file", str, "",
           "Append one JSON line per completion request (and per paging/checkpoint step) to this file: hashes "
           "and counts, never prompt text."),
    Option("slots_log_file_max_mb", int, 64,
           "When the JSONL file passes this size it becomes <file>.1 and a new one starts."),
)


class RequestLog:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.mode = "direct"
        self.quiet = False
        self.terminal = TerminalLines()
        self.file: JsonlLog | None = None
        rt.listeners.append(self._on_event)

    def load(self, loader: Any) -> None:
        options.add_options(loader, OPTIONS)

    def configure(self, updated: set[str]) -> None:
        o = ctx.options
        if {"slots_log_requests", "termlog_verbosity"} & updated:
            if o.slots_log_requests not in MODES:
                raise exceptions.OptionsError(f"slots_log_requests must be one of {', '.join(MODES)}")
            self.mode = o.slots_log_requests
            self.quiet = getattr(o, "termlog_verbosity", "info") not in SHOWN_AT
        if {"slots_log_file", "slots_log_file_max_mb"} & updated:
            if o.slots_log_file_max_mb < 1:
                raise exceptions.OptionsError("slots_log_file_max_mb must be ≥ 1")
            if self.file is not None:
                self.file.flush()
            self.file = JsonlLog(o.slots_log_file, o.slots_log_file_max_mb << 20,
                                 self._file_failed) if o.slots_log_file else None

    @guarded(Stage.RESPONSE)
    def response(self, flow: http.HTTPFlow) -> None:
        self._log(flow)

    @guarded(Stage.RESPONSE)
    def error(self, flow: http.HTTPFlow) -> None:
        self._log(flow)

    def done(self) -> None:
        self.terminal.flush()
        for up in self.rt.upstreams.values():
            for line in wording.summary(up.url, up.keeper.outcomes.summary()):
                log.log(INFO, line)
        if self.file is not None:
            self.file.flush()

    def _log(self, flow: http.HTTPFlow) -> None:
        report = self.rt.reports.get(flow.id)
        if report is None:
            return
        if self.mode == "mitmproxy":
            log.log(INFO, wording.request_line(report))
        elif self.mode == "direct" and not self.quiet:
            self.terminal.emit(wording.request_line(report))
        if self.file is not None:
            self.file.write(wording.request_record(report))

    def _on_event(self, event: Event) -> None:
        if self.file is not None:
            record = wording.event_record(event)
            if record is not None:
                self.file.write(record)

    def _file_failed(self, kind: str) -> None:
        self.rt.emit(Failed("", Stage.LOG_FILE, kind))
