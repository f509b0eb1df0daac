"""The timer of one open request: `/slots` polls while it waits for its first byte, and its deadline.

The watch addon's sweeper gives a `RequestWatch` only to a request still waiting after an interval: it polls
`/slots` (`LlamaClient.poll_slots`, the watch's own timeout), asks the pure `slotlogic.watch.Watch` what the
answer means, reports it, and arms the next wake.

Fails open: an error inside a wake is reported as its type and the watch stops; the request goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Protocol

from slotkeeper.drivers.llama_http import LlamaClient
from slotlogic.watch import End, Poll, Progress, Watch

Clock = Callable[[], float]


class WatchHost(Protocol):
    """What a request's watch tells, and asks of, the addon that made it."""

    def progress(self, progress: Progress) -> None: ...

    def ended(self, end: End) -> None: ...

    def failed(self, kind: str) -> None: ...

    def ahead(self) -> int: ...        # requests queued ahead of this one on its slot

    def first_byte(self) -> bool: ...  # asked before each poll: has the answer begun?

    def alive(self) -> bool: ...       # asked at each wake: is the request still open? (else the watch ends)


class RequestWatch:
    def __init__(self, watch: Watch, client: LlamaClient, host: WatchHost) -> None:
        self.watch = watch
        self.client = client
        self.host = host
        self.clock: Clock = time.monotonic
        self._handle: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self.stopped = False

    def wake_now(self) -> None:
        """Run one wake at once (the sweeper found the request still waiting)."""
        self._wake()

    def arm(self) -> None:
        """Schedule the next wake (none when the watch needs none)."""
        if self.stopped:
            return
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        wake = self.watch.next_wake()
        if wake is None:
            return
        with contextlib.suppress(RuntimeError):  # no running loop: nothing to arm
            self._handle = asyncio.get_running_loop().call_later(max(0.0, wake - self.clock()), self._wake)

    def stop(self) -> None:
        self.stopped = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def _wake(self) -> None:
        self._handle = None
        if not self.stopped:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            if not self.host.alive():
                self.stopped = True
                return
            if self.watch.due(self.clock()) is End.DEADLINE:
                self.stopped = True
                self.host.ended(End.DEADLINE)
                return
            if not self.watch.first_byte and self.host.first_byte():
                self.watch.got_first_byte()
            if self.watch.poll_due(self.clock()):
                timed_out, live = await self.client.poll_slots(self.watch.settings.poll_timeout)
                if self.stopped or not self.host.alive():
                    self.stopped = True
                    return
                if self.host.first_byte():
                    self.watch.got_first_byte()
                else:
                    progress, end = self.watch.polled(Poll.TIMEOUT if timed_out else live, self.clock(),
                                                      ahead=self.host.ahead())
                    if end is not None:  # the end's own line says it all: no last "waiting" line
                        self.stopped = True
                        self.host.ended(end)
                        return
                    self.host.progress(progress)
            self.arm()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the watch must never take the request down with it
            self.stopped = True
            with contextlib.suppress(Exception):
                self.host.failed(type(e).__name__)
