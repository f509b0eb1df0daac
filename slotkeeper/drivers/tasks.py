"""Background tasks a server's driver starts and must be able to wait for or cancel (tests, shutdown)."""

from __future__ import annotations

import asyncio
from typing import Any


class Tasks:
    def __init__(self) -> None:
        self._running: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Any) -> None:
        """Run `coro` on the event loop in the background (no loop: it is closed, never run)."""
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:
            coro.close()
            return
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def settle(self) -> None:
        """Wait until every task started, and every task those started, has ended. An ended task leaves the set
        here, not only by its done callback: Python 3.12's `gather` of tasks that have all ended returns without
        yielding to the loop, so the callback would never run and this loop would spin."""
        while self._running:
            self._running.difference_update([t for t in self._running if t.done()])
            if self._running:
                await asyncio.gather(*list(self._running), return_exceptions=True)

    def cancel(self) -> None:
        for task in list(self._running):
            task.cancel()
