"""The subscriber side of claim notices (`slotlogic/notices.py`): one background task per proxy process that
listens, through Redis pub/sub, to the claim channel of every server this proxy fronts and hands other
proxies' notices to that server's callback.

Off every request's path, on its own connection (a subscribed one can do nothing else) with a short read
time-out so new channels and a stop are noticed. Fail open: a lost connection is one line and a retry with
back-off; pub/sub never replays, so what was missed meanwhile is found by the background flush.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import redis.asyncio as aredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from slotlogic import notices
from slotlogic.events import Event, Failed, NoticesBack, NoticesLost, Stage
from slotlogic.notices import ClaimNotice

READ_SECONDS = 0.5     # one wait for a message; new channels are subscribed between waits
CONNECT_TIMEOUT = 2.0
HEALTH_SECONDS = 5     # a PING on an idle subscribed connection: a silently dead one is noticed
RETRY_MIN = 0.1
RETRY_MAX = 5.0
ERRORS = (RedisError, OSError, TimeoutError)
Emit = Callable[[Event], None]
OnClaim = Callable[[ClaimNotice], None]


def retry_after(failures: int) -> float:
    return min(RETRY_MAX, RETRY_MIN * 2 ** max(0, failures - 1))


class NoticeListener:
    """Channel -> callback, and the task that delivers to them (one per event loop)."""

    def __init__(self, url: str, shown: str, instance: str, emit: Emit) -> None:
        self.url = url
        self.shown = shown
        self.instance = instance   # notices of this process are its own claims: not delivered
        self.emit = emit
        self.channels: dict[str, OnClaim] = {}
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.connected = False
        self.lost = False          # logged as lost, not back yet

    def watch(self, channel: str, on_claim: OnClaim) -> None:
        """Deliver `channel`'s notices to `on_claim` (the newest callback for a channel wins)."""
        self.channels[channel] = on_claim
        self.ensure()

    def ensure(self) -> None:
        """Start the task in the running loop, once (no loop yet: the next store operation starts it)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = self.tasks.get(id(loop))
        if (task is None or task.done()) and self.channels:
            self.tasks[id(loop)] = loop.create_task(self._run())

    def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        self.tasks.clear()

    async def _run(self) -> None:
        failures = 0
        while True:
            client = aredis.Redis.from_url(self.url, socket_connect_timeout=CONNECT_TIMEOUT,
                                           socket_timeout=CONNECT_TIMEOUT, health_check_interval=HEALTH_SECONDS,
                                           retry=Retry(NoBackoff(), 0))
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                await self._listen(pubsub)
            except asyncio.CancelledError:
                raise
            except (*ERRORS, RuntimeError) as e:
                failures += 1
                self.connected = False
                if not self.lost:
                    self.lost = True
                    self.emit(NoticesLost("", self.shown, type(e).__name__))
                await asyncio.sleep(retry_after(failures))
            else:
                failures = 0
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
                with contextlib.suppress(Exception):
                    await client.aclose()

    async def _listen(self, pubsub: Any) -> None:
        subscribed: set[str] = set()
        while True:
            new = [c for c in self.channels if c not in subscribed]
            if new:
                await pubsub.subscribe(*new)
                subscribed.update(new)
                if not self.connected:
                    self.connected = True
                    if self.lost:
                        self.lost = False
                        self.emit(NoticesBack("", self.shown))
            if not subscribed:
                await asyncio.sleep(READ_SECONDS)
                continue
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=READ_SECONDS)
            if message is not None and message.get("type") == "message":
                self._deliver(message.get("channel"), message.get("data"))

    def _deliver(self, channel: Any, data: Any) -> None:
        name = channel.decode("latin-1") if isinstance(channel, bytes) else channel
        on_claim = self.channels.get(name) if isinstance(name, str) else None
        notice = notices.decode(data) if on_claim is not None else None
        if notice is None or on_claim is None or notice.instance == self.instance:
            return
        try:
            on_claim(notice)
        except Exception as e:  # the listener must outlive a bad callback
            self.emit(Failed("", Stage.BACKGROUND, type(e).__name__))
