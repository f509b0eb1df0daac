"""The real addons (addon.py) in mitmproxy's test harness, in front of simulated servers, on a virtual clock.

Per client request, as mitmproxy would run it: the `request` hook rewrites the flow; the rewritten request goes
to the simulated server its destination names (the pool may have changed it); when the server starts the task,
a streamed answer's headers reach `responseheaders` (the page lock goes, the SSE tap is set) and its events
are fed through the tap; a whole JSON answer comes at the end; then `response` (or `error`, when a restart
dropped the connection). The drivers' own calls (`/props`, `/slots`, slot files, warm-ups) reach the same
simulated servers through `bench.sim.transport` (`LlamaClient(url, transport=...)` via `Runtime.make_client`).
Several requests run at once on the loop; nothing here waits in real time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import filelock
from mitmproxy import http
from mitmproxy.flow import Error as FlowError
from mitmproxy.test import taddons, tflow

from bench.sim.llama import Disk, Done, Down, SimServer, answer_body, chat_stream
from bench.sim.transport import transport
from slotkeeper import addon as addon_module
from slotkeeper.drivers import page_budget, page_runner, store_file
from slotkeeper.drivers.llama_http import LlamaClient
from slotlogic.events import CostWeighed

PORT0 = 8080
_FAST_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None  # tmpfs: no fsync cost


class _ProcessFileLock:
    """Stands in for `filelock.AsyncFileLock` on the state files while a rig runs: one asyncio lock per lock
    path, so the simulated proxies (all in this process, on one loop) still exclude each other, as two
    processes do on the real lock. filelock 4's acquire and release each hop to a worker thread and back
    (about a tenth of a sweep's time); the same hops, one loop turn each, keep the order of callbacks. The OS
    lock itself is exercised by the tests that run real mitmdump processes on one state dir."""

    def __init__(self, locks: dict[str, asyncio.Lock], path: str, timeout: float = -1, mode: int = 0o600) -> None:
        self.path, self.timeout = path, timeout
        self.lock = locks.setdefault(path, asyncio.Lock())  # the rig's own: one loop's locks

    async def __aenter__(self) -> _ProcessFileLock:
        await _hop()
        try:
            await asyncio.wait_for(self.lock.acquire(), None if self.timeout < 0 else self.timeout)
        except TimeoutError:
            raise filelock.Timeout(self.path) from None
        return self

    def _heard(self, event: Any) -> None:
        if isinstance(event, CostWeighed):
            self.weighed.append((SimServer.now(), event))

    async def __aexit__(self, *exc: Any) -> None:
        self.lock.release()
        await _hop()


async def _hop() -> None:
    """One round trip through the loop, as a worker thread's result takes (`clock._VirtualLoop`)."""
    await asyncio.get_running_loop().run_in_executor(None, lambda: None)


def server_url(i: int) -> str:
    return f"http://127.0.0.1:{PORT0 + i}"


@dataclass(frozen=True)
class Setup:
    """What the simulated deployment looks like (one seed's shape draws these)."""

    servers: int = 1
    slots: int = 4
    n_ctx: int = 16384
    paging: bool = False          # slots_save_dir set: session paging and prefix checkpoints on disk
    proxies: int = 1              # proxies sharing one state dir
    unified: bool = False         # unified KV with idle clearing
    ttl: int = 120
    prefill_speed: float = 2000.0
    options: tuple[tuple[str, Any], ...] = ()
    disk: Disk | None = None      # a modelled machine's slot-file costs (None: the small CPU model's)
    decode_speed: float = 100.0
    prefill_depth: float | None = None  # context depth at which a prefilled token costs twice (None: flat)
    restores_keep_nothing: bool = False  # the servers' restores answer and keep nothing (a broken build)
    remote_save: bool = False     # with paging: the proxies cannot read the servers' save dir (slots_save_remote)


@dataclass
class Outcome:
    """One client request as it went: who sent it, what the proxy decided, what the server did."""

    tag: str
    proxy: int
    server: str | None = None
    done: Done | None = None
    report: Any = None             # slotlogic.decisions.Report (its `loss` once the loss meter exists)
    meta: dict[str, Any] = field(default_factory=dict)
    content: str = ""
    error: str | None = None
    started: float = 0.0           # virtual time the client sent it


class Proxy:
    """One proxy: slotkeeper's addons in a `taddons` context."""

    def __init__(self, tctx: taddons.context, addons: list[Any]) -> None:
        self.tctx, self.addons, self.rt = tctx, addons, addons[0].rt

    async def hook(self, name: str, flow: http.HTTPFlow) -> None:
        for a in self.addons:
            fn = getattr(a, name, None)
            if fn is not None:
                result = fn(flow)
                if inspect.isawaitable(result):
                    await result

    def upstream(self, url: str) -> Any:
        return self.rt.upstreams.get(url)


class _SeenDeletes:
    """`os` for the pagers' driver, with each page file it deletes noted (name -> virtual time): the ground
    truth tells a page the budget dropped from one never written."""

    def __init__(self, deleted: dict[str, float]) -> None:
        self._deleted = deleted

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def unlink(self, path: Any) -> None:
        with contextlib.suppress(RuntimeError):  # no loop: a deletion at shutdown
            self._deleted.setdefault(Path(path).name, SimServer.now())
        os.unlink(path)


class Rig:
    """Simulated servers and 1-2 proxies on one state dir. Use `async with Rig(setup) as rig:` on a virtual loop
    (`bench.sim.clock.run`)."""

    def __init__(self, setup: Setup, workdir: str | Path | None = None) -> None:
        self.setup = setup
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="slotsim-", dir=_FAST_DIR)
        self.dir = Path(workdir or self._tmp.name)  # type: ignore[union-attr]
        self.state_dir = self.dir / "state"
        self.save_dir = self.dir / "slots"
        self.save_dir.mkdir(parents=True, exist_ok=True)
        left: dict[str, list[int]] = {}  # one ground truth across servers: a session may move between them
        self.servers = {server_url(i): SimServer(setup.slots, setup.n_ctx, save_dir=self.save_dir if setup.paging
                                                 else None, prefill_speed=setup.prefill_speed,
                                                 decode_speed=setup.decode_speed, disk=setup.disk,
                                                 prefill_depth=setup.prefill_depth,
                                                 unified_idle_clear=setup.unified, name=f"s{i}",
                                                 restores_keep_nothing=setup.restores_keep_nothing)
                        for i in range(setup.servers)}
        files: dict[str, Any] = {}  # one save dir for the pool: any server reads the files another wrote
        for s in self.servers.values():
            s.left = left
            s.files = files
        self.proxies: list[Proxy] = []
        self.outcomes: list[Outcome] = []
        self.weighed: list[tuple[float, CostWeighed]] = []  # every move the proxies weighed by its cost, and when
        self.deleted: dict[str, float] = {}  # page files the proxies deleted, and when
        self._stack = contextlib.ExitStack()

    async def __aenter__(self) -> Rig:
        lock = functools.partial(_ProcessFileLock, {})  # the rig's own locks, one per lock path
        self._stack.enter_context(mock.patch.object(store_file, "AsyncFileLock", lock))
        self._stack.enter_context(mock.patch.object(page_runner, "os", _SeenDeletes(self.deleted)))
        if self.setup.disk is not None:  # the modelled disk's free space, not the simulator's scratch file system
            free = self.setup.disk.free_bytes
            usage = shutil._ntuple_diskusage(free, 0, free)  # type: ignore[attr-defined]
            self._stack.enter_context(mock.patch.object(page_budget.shutil, "disk_usage", lambda path: usage))
        for _ in range(self.setup.proxies):
            addons = addon_module.make_addons()
            addons[0].rt.make_client = lambda url: LlamaClient(url, transport=transport(self.servers[url]))
            tctx = self._stack.enter_context(taddons.context(*addons))
            p = Proxy(tctx, addons)
            p.rt.listeners.append(self._heard)
            opts: dict[str, Any] = {"slots_state_dir": str(self.state_dir), "slots_log_requests": "off",
                                    "slots_ttl": self.setup.ttl, "mode": [f"reverse:{server_url(0)}@127.0.0.1:1"]}
            if self.setup.servers > 1:
                opts["slots_upstreams"] = [server_url(i) for i in range(1, self.setup.servers)]
            if self.setup.paging and self.setup.remote_save:  # the server's save dir, out of the proxy's reach
                opts["slots_save_remote"] = True
            elif self.setup.paging:
                opts["slots_save_dir"] = str(self.save_dir)
            opts.update(dict(self.setup.options))
            tctx.configure(addons[0], **opts)
            self.proxies.append(p)
        return self

    def _heard(self, event: Any) -> None:
        if isinstance(event, CostWeighed):
            self.weighed.append((SimServer.now(), event))

    async def __aexit__(self, *exc: Any) -> None:
        for p in self.proxies:
            for up in list(p.rt.upstreams.values()):
                with contextlib.suppress(Exception):
                    await up.settle()
            with contextlib.suppress(Exception):
                await p.tctx.master.done()  # the addons' `done` (the last flush), and mitmproxy's log handler goes
            for up in list(p.rt.upstreams.values()):
                with contextlib.suppress(Exception):
                    await up.aclose()
        self._stack.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    # ------------------------------------------------------------------------------------------- requests

    async def send(self, tag: str, body: dict[str, Any], *, proxy: int = 0, headers: dict[str, str] | None = None,
                   path: str = "/v1/chat/completions") -> Outcome:
        """One client request through proxy `proxy`, to its end."""
        p = self.proxies[proxy]
        stream = bool(body.get("stream"))
        req = http.Request.make("POST", server_url(0) + path, json.dumps(body).encode(),
                                {"content-type": "application/json", **(headers or {})})
        f = tflow.tflow(req=req)
        out = Outcome(tag, proxy, started=SimServer.now())
        self.outcomes.append(out)
        await p.hook("request", f)
        if f.response is not None:
            return out
        out.server = f"{f.request.scheme}://{f.request.host}:{f.request.port}"
        server = self.servers[out.server]
        sent = json.loads(f.request.get_content())
        task = server.completion(f.request.path, sent, tag=tag)
        try:
            if stream:
                await task.started
                f.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
                f.response.content = None
                await p.hook("responseheaders", f)
                result = await task.done
                events = ([b"data: " + json.dumps(result).encode() + b"\n\n"] if "error" in result
                          else chat_stream(result, sent))
                for chunk in [*events, b""]:
                    f.response.stream(chunk)
            else:
                result = await task.done
                status, data = answer_body(f.request.path, result, sent)
                f.response = http.Response.make(status, json.dumps(data).encode(),
                                                {"content-type": "application/json"})
                await p.hook("responseheaders", f)
            await p.hook("response", f)
        except Down:
            f.error = FlowError("Server connection closed")
            await p.hook("error", f)
            out.error = "restart"
            return out
        out.content = result.get("content", "") if "error" not in result else ""
        out.error = "error" if "error" in result else None
        out.done = next((d for d in reversed(server.done) if d.task == task.id), None)
        out.report = p.rt.reports.get(f.id)
        out.meta = f.metadata.get("slotkeeper", {})
        return out

    def restart(self, server: int = 0, *, new_build: bool = False) -> None:
        s = self.servers[server_url(server)]
        s.restart(build=f"b{s.generation + 2}-sim" if new_build else None)

    def stall(self, server: int, seconds: float) -> None:
        """`/props` and `/slots` of `server` time out for `seconds` from now (a loaded machine's server)."""
        s = self.servers[server_url(server)]
        s.meta_stalled_until = max(s.meta_stalled_until, s.now() + seconds)

    async def settle(self) -> None:
        for p in self.proxies:
            for up in list(p.rt.upstreams.values()):
                await up.settle()

    @property
    def prefill_tokens(self) -> int:
        return sum(s.prefill_tokens for s in self.servers.values())

