"""The health of a pool's servers (`slotkeeper.drivers.pool`): a background task asks every server's `/health`
(`slots_health_interval`), a down one with back-off (`routing.Health`), and a connection that cannot be opened
marks the server down at once (`connect_failed`, `connect_check`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from slotkeeper.drivers.llama_http import LlamaClient
from slotlogic import routing
from slotlogic.events import Event, ServerDown, ServerUp
from slotlogic.routing import Health

CONNECT_CHECK_TIMEOUT = 1.0


@dataclass
class Member:
    """One URL of `slots_upstreams`: a llama-server, or a llama-swap in front of several."""

    url: str
    index: int
    client: LlamaClient
    health: Health = field(default_factory=Health)
    swap: bool | None = None   # None until asked: a model swapper (llama-swap, or llama-server's router mode)
    router: bool = False       # llama-server's router mode (`--models-dir`): models named by `?model=`
    max_loaded: int | None = None  # the router's `--models-max` (`max_instances` in its `/props`)
    checked: float = 0.0       # when `/health` was last asked
    models: frozenset[str] = frozenset()  # llama-swap: the models it lists (`/v1/models`, `/running`)
    models_asked: float | None = None     # when that list was last asked

    @property
    def address(self) -> tuple[str, int]:
        p = urlsplit(self.url)
        return p.hostname or "", p.port or (443 if p.scheme == "https" else 80)


class PoolHealth:
    """Owns the health task of a pool's `members`; `every_pass` runs after each pass (idle models forgotten)."""

    def __init__(self, members: list[Member], emit: Callable[[Event], None], interval: float = 5.0, *,
                 every_pass: Callable[[float], None] = lambda now: None) -> None:
        self.members = members
        self.emit = emit
        self.interval = interval
        self.every_pass = every_pass
        self._task: asyncio.Task[None] | None = None

    def connect_failed(self, member: Member, cause: str) -> None:
        self._mark(member, False, cause)

    def _mark(self, member: Member, ok: bool, cause: str = "") -> None:
        now = time.monotonic()
        if ok:
            since = member.health.down_since
            if member.health.ok(now) is routing.Change.CAME_BACK:
                self.emit(ServerUp(member.url, now - (since or now)))
        elif member.health.failed(now) is routing.Change.WENT_DOWN:
            self.emit(ServerDown(member.url, cause))

    async def check(self, member: Member) -> bool:
        """One `/health` look-up; marks the member up or down."""
        result = await member.client.health()
        self._mark(member, result == "ok", result)
        return result == "ok"

    async def connect_check(self, member: Member) -> bool:
        """Can a connection be opened now? (Before mitmproxy opens one: a refused server is marked down and
        the request goes elsewhere.)"""
        host, port = member.address
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_CHECK_TIMEOUT)
        except (TimeoutError, OSError) as e:
            self.connect_failed(member, "timeout" if isinstance(e, TimeoutError) else "refused")
            return False
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
        return True

    def kick(self) -> None:
        if self._task is None or self._task.done():
            with contextlib.suppress(RuntimeError):
                self._task = asyncio.get_running_loop().create_task(self._background())

    async def _background(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            while True:
                await asyncio.sleep(min(self.interval, routing.PROBE_MIN))
                now = time.monotonic()
                due = [m for m in self.members if m.health.due(now) or (
                    m.health.up and now - m.checked >= self.interval)]
                for m in due:
                    m.checked = now
                await asyncio.gather(*(self.check(m) for m in due), return_exceptions=True)
                self.every_pass(now)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def status(self) -> list[dict[str, Any]]:
        return [{"url": m.url, "up": m.health.up, "llama_swap": bool(m.swap),
                 "failures": m.health.failures} for m in self.members]
