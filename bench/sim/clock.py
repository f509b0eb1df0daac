"""One virtual clock for a simulated run: the asyncio loop's `time()`, `time.time()` and `time.monotonic()`.

The drivers read `time.time()` / `time.monotonic()` themselves (last use, TTLs, back-offs, waits), so the
simulation replaces those two functions of the `time` module for the length of a run (`VirtualClock.patched`),
and runs on an event loop whose selector, when nothing is ready and no worker thread is busy, moves the clock
forward to the next timer instead of sleeping. A request that prefills for 3 virtual seconds therefore costs
microseconds, timers and timeouts keep their order, and worker threads (the state file's I/O) are waited for
in real time without the virtual clock moving. Bench and test code only: nothing in the product imports this.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

_REAL_TIME = time.time
_REAL_MONOTONIC = time.monotonic
THREAD_POLL = 0.02  # real seconds a select waits for a worker thread before looking again


class VirtualClock:
    def __init__(self, wall: float = 1_800_000_000.0, mono: float = 10_000.0) -> None:
        self.offset = 0.0
        self.wall0, self.mono0 = wall, mono

    def time(self) -> float:
        return self.wall0 + self.offset

    def monotonic(self) -> float:
        return self.mono0 + self.offset

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            self.offset += seconds

    @property
    def now(self) -> float:
        """Virtual seconds since the run began."""
        return self.offset

    @contextlib.contextmanager
    def patched(self) -> Iterator[VirtualClock]:
        """`time.time` and `time.monotonic` read this clock while the block runs (one run at a time)."""
        saved = time.time, time.monotonic
        time.time, time.monotonic = self.time, self.monotonic  # type: ignore[assignment]
        try:
            yield self
        finally:
            time.time, time.monotonic = saved  # type: ignore[assignment]


class _CountingExecutor(ThreadPoolExecutor):
    """The loop's default executor, counting jobs in flight (the selector waits for them in real time)."""

    def __init__(self) -> None:
        super().__init__(max_workers=4, thread_name_prefix="sim")
        self.busy = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        with self._lock:
            self.busy += 1
        fut = super().submit(fn, *args, **kwargs)
        fut.add_done_callback(self._done)
        return fut

    def _done(self, _fut: Future[Any]) -> None:
        with self._lock:
            self.busy -= 1


class _VirtualSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    def __init__(self, clock: VirtualClock, executor: _CountingExecutor) -> None:
        super().__init__()
        self.clock = clock
        self.executor = executor

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if self.executor.busy > 0:  # a worker thread will wake the loop: wait for it, the clock stands still
            return super().select(THREAD_POLL)
        if timeout is None:  # nothing scheduled, nothing running: a stuck run; let the caller's guard see it
            return super().select(THREAD_POLL)
        self.clock.advance(timeout)
        return []


def new_loop(clock: VirtualClock) -> asyncio.AbstractEventLoop:
    """An event loop on `clock` (call inside `clock.patched()`: the loop's time is `time.monotonic`)."""
    executor = _CountingExecutor()
    loop = asyncio.SelectorEventLoop(_VirtualSelector(clock, executor))
    loop.set_default_executor(executor)
    return loop


def run(clock: VirtualClock, main: Callable[[], Any]) -> Any:
    """Run the coroutine `main()` to its end on a fresh virtual loop, `time` patched meanwhile."""
    with clock.patched():
        loop = new_loop(clock)
        try:
            asyncio.set_event_loop(loop)
            return loop.run_until_complete(main())
        finally:
            with contextlib.suppress(Exception):
                _cancel_all(loop)
            loop.run_until_complete(loop.shutdown_default_executor())
            asyncio.set_event_loop(None)
            loop.close()


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
