"""The watch addon: a request that waits for its first byte is watched; a stalled or overdue one is ended.

`slotlogic.watch` decides, `slotkeeper.drivers.watcher` polls `/slots`, `slotkeeper/mitm/abort.py` ends a
request (docs/behaviour.md). No hook runs per request: a timer per request cost microseconds on the hot path,
so one sweeper task gives a `RequestWatch` only to the open requests (`Runtime.open`) that have waited an
interval or reached their deadline; nearly all are answered sooner and cost the watch nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

from mitmproxy import ctx, hooks, http

from slotkeeper.drivers.watcher import RequestWatch
from slotkeeper.mitm import abort, options
from slotkeeper.mitm.options import Option
from slotkeeper.mitm.runtime import Open, Runtime
from slotkeeper.mitm.sse_tap import SSETap
from slotlogic import wording
from slotlogic.endpoints import Route
from slotlogic.events import Failed, RequestEnded, Stage, Waiting
from slotlogic.watch import End, Progress, Watch, WatchSettings

OPTIONS = (
    Option("slots_watch_interval_ms", int, 15000,
           "While a request waits for its first byte, poll /slots this often and log what it shows (queued, "
           "prefilling, stalled); 0 = off."),
    Option("slots_watch_timeout_ms", int, 3000,
           "Timeout of one /slots poll of the first-token watch; a poll that times out means busy (llama-server "
           "holds /slots while it evaluates a long prompt)."),
    Option("slots_first_token_timeout", int, 0,
           "Seconds every slot may stay idle, with nothing moving, while a request waits for its first byte; then "
           "it gets a 504 and its upstream request is closed. 0 = off."),
    Option("slots_wedged_timeout", int, 60,
           "Seconds a request's own slot may show no progress at all (same task, same prompt tokens processed, "
           "none decoded) while it waits for its first byte, or three prompt batches at the measured speed if "
           "longer; then it is ended like a stall, so llama-server cancels the task and frees the slot. 0 = off."),
    Option("slots_request_deadline", int, 0,
           "Seconds a request may run at all; then it is ended with an error and its upstream request is closed "
           "(llama-server cancels it). 0 = off."),
)
PROMPT_BATCH = 2048  # llama-server's default n_batch: the prompt tokens one step of its loop evaluates at most
UNMEASURED_BATCH = 100.0  # seconds one batch may take before any prefill speed is measured (a wedge: 300 s)
MINIMUMS = {**{o.name: (0, "≥ 0 (0 = off)") for o in OPTIONS}, "slots_watch_timeout_ms": (1, "≥ 1")}


class Watchdog:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.settings = WatchSettings()
        self.watches: dict[str, RequestWatch] = {}      # requests still going after the first interval
        self._sweeper: asyncio.Task[None] | None = None

    def load(self, loader: Any) -> None:
        options.add_options(loader, OPTIONS)

    def configure(self, updated: set[str]) -> None:
        if not {opt.name for opt in OPTIONS} & updated:
            return
        o = ctx.options
        options.check_minimums(o, MINIMUMS)
        self.settings = WatchSettings(interval=o.slots_watch_interval_ms / 1000,
                                      poll_timeout=o.slots_watch_timeout_ms / 1000,
                                      first_token_timeout=float(o.slots_first_token_timeout),
                                      deadline=float(o.slots_request_deadline),
                                      wedged_timeout=float(o.slots_wedged_timeout))

    # ------------------------------------------------------------------------------------------- hooks

    # No hook runs per request: the sweeper finds waiting requests in `Runtime.open` (an answered request costs
    # the watch nothing), and a started watch ends itself once its request has left it.

    def running(self) -> None:
        """Start the sweeper (sync hook: it runs as a task)."""
        self.start()

    def start(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            with contextlib.suppress(RuntimeError):  # no running loop: started by `running` later
                self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    def done(self) -> None:
        for flow_id in list(self.watches):
            self._stop(flow_id)
        if self._sweeper is not None:
            self._sweeper.cancel()

    # ------------------------------------------------------------------------------------------- helpers

    async def _sweep(self) -> None:
        """Every tick (a quarter of the first interval, at most 1 s), start the watch of each open request that
        has waited its first interval (or reached its deadline), and end the watches of answered ones."""
        try:
            while True:
                s = self.settings
                first = min((x for x in (s.interval, s.deadline) if x > 0), default=0.0)
                await asyncio.sleep(min(1.0, first / 4) if first > 0 else 1.0)
                for flow_id in [f for f in self.watches if f not in self.rt.open]:
                    self._stop(flow_id)   # answered or failed: its watch ends
                if first <= 0:
                    continue
                now = time.monotonic()
                for flow_id, req in list(self.rt.open.items()):
                    if flow_id not in self.watches and now - req.started >= first and req.flow is not None \
                            and req.flow.live:
                        self._fire(req.flow, req)   # the watch itself reads whether its answer has begun
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never silently: one line, and the next `start` runs a new sweeper
            self.rt.emit(Failed("", Stage.WATCH, type(e).__name__))
        finally:
            self._sweeper = None

    def _fire(self, flow: http.HTTPFlow, req: Open) -> None:
        """A request is still going after its first interval: build its watch and run the first wake."""
        try:
            raw = flow.request.raw_content or b""
            rate = req.upstream.keeper.prefill_estimate()
            watch = Watch(self.settings, req.started, req.ticket.slot,
                          stream=b'"stream":true' in raw or b'"stream": true' in raw,
                          batch_seconds=PROMPT_BATCH / rate if rate else UNMEASURED_BATCH)
            rw = RequestWatch(watch, req.upstream.client, _FlowWatch(self, flow, req))
            self.watches[flow.id] = rw
            rw.wake_now()
        except Exception as e:  # fail open: the request goes on unwatched
            self.rt.emit(Failed(req.upstream.url, Stage.WATCH, type(e).__name__, path=flow.request.path))

    def _stop(self, flow_id: str) -> None:
        rw = self.watches.pop(flow_id, None)
        if rw is not None:
            rw.stop()
        self.rt.waiting.pop(flow_id, None)

    def _ahead(self, flow_id: str, req: Open) -> int:
        """Requests this proxy sent to the same slot of the same server before this one, still open."""
        slot = req.ticket.slot
        if slot is None:
            return 0
        return sum(1 for fid, o in self.rt.open.items() if fid != flow_id and o.upstream is req.upstream
                   and o.ticket.slot == slot and o.started < req.started)

    def _progress(self, flow: http.HTTPFlow, req: Open, p: Progress) -> None:
        event = Waiting(req.upstream.url, req.path, req.ticket.session.short, p.state, p.waited, p.slot,
                        p.processed, p.total, p.decoded, p.idle_for)
        self.rt.emit(event)
        self.rt.waiting[flow.id] = wording.event_record(event) or {}
        flow.comment = wording.waiting_comment(event)
        flow.marked = ":hourglass_flowing_sand:"
        self._update(flow)

    def _end(self, flow: http.HTTPFlow, req: Open, end: End) -> None:
        s = self.settings
        watch = self.watches.get(flow.id)
        limit = {End.STALLED: s.first_token_timeout, End.DEADLINE: s.deadline,
                 End.WEDGED: watch.watch.wedge_limit if watch is not None else s.wedged_timeout}[end]
        streaming = flow.response is not None and callable(flow.response.stream)
        # a native Anthropic stream gets Anthropic's error event, and so does a translated one (its tap's)
        anthropic = req.ticket.route is Route.ANTHROPIC and not req.ticket.translated
        req.ended = {End.STALLED: "first-token-timeout", End.DEADLINE: "deadline", End.WEDGED: "wedged"}[end]
        message = wording.client_message(end, limit)
        event = wording.stream_error_event(end, limit, anthropic=anthropic) if streaming else None
        tap = flow.response.stream if streaming and flow.response is not None else None
        if event is not None and isinstance(tap, SSETap):
            event = tap.closing(event, message)  # its own event: never glued onto an unfinished one
        # the 504 of a request with no answer yet: JSON in the shape its client reads (a translated one too)
        body = wording.client_error_body(end, limit, anthropic=req.ticket.route is Route.ANTHROPIC)
        closed = abort.end_flow(flow, 504, message, event, body)
        self.rt.emit(RequestEnded(req.upstream.url, req.path, req.ticket.session.short, end,
                                  time.monotonic() - req.started, limit, streaming, closed))
        self.rt.waiting.pop(flow.id, None)

    @staticmethod
    def _update(flow: http.HTTPFlow) -> None:
        """Tell mitmweb the flow changed outside a hook (its comment)."""
        with contextlib.suppress(Exception):
            ctx.master.addons.trigger(hooks.UpdateHook([flow]))


def _began(flow: http.HTTPFlow, req: Open) -> bool:
    """The answer has begun: a buffered answer is here, or a stream's observer has seen part of its body
    (llama-server sends a stream's headers when its slot starts, before the prompt is evaluated)."""
    if flow.response is None:
        return False
    return req.stream is None or req.stream.started


@dataclass(frozen=True)
class _FlowWatch:
    """One flow's side of its watch (`slotkeeper.drivers.watcher.WatchHost`)."""

    dog: Watchdog
    flow: http.HTTPFlow
    req: Open

    def progress(self, progress: Progress) -> None:
        self.dog._progress(self.flow, self.req, progress)

    def ended(self, end: End) -> None:
        self.dog._end(self.flow, self.req, end)

    def failed(self, kind: str) -> None:
        self.dog.rt.emit(Failed(self.req.upstream.url, Stage.WATCH, kind, path=self.flow.request.path))

    def ahead(self) -> int:
        return self.dog._ahead(self.flow.id, self.req)

    def first_byte(self) -> bool:
        return _began(self.flow, self.req)

    def alive(self) -> bool:
        return self.flow.id in self.dog.rt.open
