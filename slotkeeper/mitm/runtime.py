"""What slotkeeper's mitmproxy addons share, the way mitmproxy's own addons share the master.

One `Runtime` object is handed to every addon in `addon.py`: the settings (rebuilt whole when an option
changes), one `slotkeeper.drivers.upstream.Upstream` per llama-server, the open requests (their tickets, between the
request hook and the end of the answer), the finished reports (for the views that render them), and the
event sink through which every log line leaves (`slotlogic.wording` words it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from mitmproxy.log import ALERT

from slotkeeper.drivers.llama_http import LlamaClient, client_for
from slotkeeper.drivers.one_server import OneServer
from slotkeeper.drivers.pool import Pool, base_of
from slotkeeper.drivers.store import Stores
from slotkeeper.drivers.store_file import default_state_dir
from slotkeeper.drivers.upstream import Shared, Upstream
from slotlogic import wording
from slotlogic.answers import StreamObserver
from slotlogic.board import Board
from slotlogic.decisions import Report, Ticket
from slotlogic.events import Event, Failed, Stage
from slotlogic.intake import Recognition
from slotlogic.settings import Settings
from slotlogic.tally import Tally

log = logging.getLogger("slotkeeper")
SHARED_FLUSH_INTERVAL = 0.5  # seconds between flushes to a Redis store (the file store: Settings.flush_interval)
MAX_REPORTS = 1024  # finished reports kept for the views of the same flow (they read them at once)
# Our informational lines go out at mitmproxy's ALERT (INFO + 1): `termlog_verbosity=alert` then shows them and
# hides mitmproxy's own per-connection INFO lines (docs/mitmproxy.md). Any handler at INFO still gets them.
INFO = ALERT
LEVELS = {wording.Level.INFO: INFO, wording.Level.WARNING: logging.WARNING}


@dataclass(slots=True)
class Open:
    """A request between its request hook and the end of its answer (live objects: never in metadata)."""

    ticket: Ticket
    upstream: Upstream
    started: float
    path: str                          # as the client sent it (a translated request goes elsewhere)
    stream: StreamObserver | None = None
    ended: str | None = None   # the proxy ended it: "deadline", "first-token-timeout", "wedged" (watchdog), "too-large"
    flow: Any = None           # the live flow (slotkeeper/mitm/watchdog.py ends or annotates it while it waits)
    original: tuple[bytes | None, Any, str] | None = None  # body, headers, path as sent (a pool may re-route it)


@dataclass
class Runtime:
    settings: Settings = field(default_factory=Settings)
    state_dir: Path = field(default_factory=default_state_dir)
    fronted: frozenset[str] = frozenset()
    upstreams: dict[str, Upstream] = field(default_factory=dict)
    replays: dict[str, Upstream] = field(default_factory=dict)
    open: dict[str, Open] = field(default_factory=dict)
    reports: OrderedDict[str, Report] = field(default_factory=OrderedDict)
    waiting: dict[str, dict[str, Any]] = field(default_factory=dict)  # flow id -> what its watch saw last
    listeners: list[Callable[[Event], None]] = field(default_factory=list)
    make_client: Callable[[str], LlamaClient] = client_for  # the seam for fault injection in tests
    stores: Stores | None = None                 # where the shared state lives (`slots_state_url`)
    pool: Pool | None = None                     # several servers (`slots_upstreams`)
    pending: dict[str, Any] = field(default_factory=dict)  # client connection id -> its flow being sent
    _store_key: tuple[str, Path] | None = None
    tally: Tally = field(default_factory=Tally)   # the counters behind /_slots/metrics
    board: Board = field(default_factory=Board)   # the recent history the slot page draws (GET /_slots/)
    _closing: set[Any] = field(default_factory=set)  # clients of forgotten servers being closed
    recognition: Recognition = field(default_factory=Recognition)  # known sessions' requests, every live server

    def configure(self, settings: Settings, state_dir: Path, fronted: frozenset[str], *, state_url: str = "",
                  servers: list[str] | None = None, health_interval: float = 5.0, swap_max_models: int = 16) -> None:
        replaced = self.stores is None or self._store_key != (state_url, state_dir)
        if replaced:
            if self.stores is not None:
                self.stores.close_sync()  # its notice listener stops; the new store's servers watch anew
            self.stores = Stores(state_url, state_dir, self.emit)
            self._store_key = (state_url, state_dir)
        assert self.stores is not None
        if self.stores.kind == "redis":  # other proxies learn our slots' use sooner (a round trip is cheap)
            settings = replace(settings, flush_interval=SHARED_FLUSH_INTERVAL)
        self.settings, self.state_dir = settings, self.stores.state_dir
        self.fronted = fronted | frozenset(servers or ())
        for url, up in self.upstreams.items():
            up.reconfigure(self.settings_for(url), self.state_dir,
                           self.stores.for_server(url) if replaced else None, self.stores.builds)
        wanted = list(servers or [])
        if not wanted:
            if self.pool is not None:
                self.pool.health.close()
            self.pool = None
        elif self.pool is None or [m.url for m in self.pool.members] != [base_of(u) for u in wanted]:
            if self.pool is not None:
                self.pool.health.close()
            self.pool = Pool(wanted, lambda url, loaded: self.upstream(url, loaded=loaded), self.emit,
                             self.make_client, health_interval, drop=self.drop_upstream,
                             recognition=self.recognition)
        if self.pool is not None:
            self.pool.health.interval = health_interval
            self.pool.max_models = swap_max_models

    def settings_for(self, url: str) -> Settings:
        return self.settings.for_upstream(url in self.fronted or base_of(url) in self.fronted)

    def upstream(self, url: str, *, live: bool = True, loaded: Callable[[], Any] | None = None) -> Upstream:
        """The driver for one server; saved flows get an offline one of their own."""
        pool = self.upstreams if live else self.replays
        up = pool.get(url)
        if up is None:
            settings = self.settings_for(url)
            if self.stores is None:
                self.stores = Stores("", self.state_dir, self.emit)
            shared_with = Shared(self.stores.for_server(url), self.stores.builds, self.recognition)
            up = (Upstream(url, settings, self.state_dir, self.emit, client=self.make_client(url),
                           shared_with=shared_with, loaded=loaded) if live
                  else Upstream.for_replay(url, settings, self.emit))
            pool[url] = up
        return up

    def router(self, url: str, live: bool) -> Pool | OneServer:
        """Who decides where a request to `url` goes: the pool for a live request to a server it fronts, else
        the request's own server (one driver path either way: `decide`, then the chosen server performs)."""
        if live and self.pool is not None and self.pool.fronts(url):
            return self.pool
        return OneServer(self.upstream(url, live=live))

    def drop_upstream(self, url: str) -> None:
        """A llama-swap model's server the pool forgot: its last touches written, its tasks and client closed."""
        up = self.upstreams.pop(url, None)
        if up is None:
            return
        up.close_sync()
        with contextlib.suppress(RuntimeError):
            task = asyncio.get_running_loop().create_task(up.aclose())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def all_upstreams(self) -> list[Upstream]:
        return [*self.upstreams.values(), *self.replays.values()]

    def finished(self, flow_id: str, report: Report) -> None:
        self.tally.report(report)
        self.board.report(report, time.time())
        if self.pool is not None:
            self.pool.ended_url(report.upstream)
        self.reports[flow_id] = report
        while len(self.reports) > MAX_REPORTS:
            self.reports.popitem(last=False)

    def emit(self, event: Event) -> None:
        """Every event is logged (if it has a line) and handed to the listeners (the JSONL log)."""
        warning = None
        if wording.logged(event):
            level, text = wording.event_line(event)
            log.log(LEVELS[level], text)
            warning = text if level is wording.Level.WARNING else None
        self.tally.event(event)
        self.board.event(event, time.time(), warning)
        for listener in self.listeners:
            listener(event)

    def status(self, upstreams: list[dict[str, Any]]) -> dict[str, Any]:
        now = time.time()
        for server in upstreams:  # the slot page's part: recent holders, marks, extras, warnings
            server["recent"] = self.board.view(server.get("upstream", ""), now)
        general = self.board.view("", now)["warnings"]  # warnings that name no server
        out = {"policy": self.settings.policy.value, "ttl": self.settings.ttl, "servers": upstreams,
               "warnings": general,
               "waiting": [w for fid, w in self.waiting.items() if fid in self.open]}
        if self.pool is not None:
            out["health"] = self.pool.health.status()
        if self.stores is not None:
            out["state"] = self.stores.kind if self.stores.redis is None else {
                "store": self.stores.redis.shown, "reachable": self.stores.redis.available}
        return out


class _HasRuntime(Protocol):
    rt: Runtime


def guarded(stage: Stage) -> Callable[[Callable[[Any, Any], None]], Callable[[Any, Any], None]]:
    """A synchronous hook that never raises: a failure is one line naming the exception's type. (mitmproxy's
    own "Addon error" would print the exception's message, and a message can quote a prompt.)"""
    def wrap(hook: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
        @functools.wraps(hook)
        def guard(self: _HasRuntime, flow: Any) -> None:
            try:
                hook(self, flow)
            except Exception as e:
                self.rt.emit(Failed("", stage, type(e).__name__, path=flow.request.path))
        return guard
    return wrap
