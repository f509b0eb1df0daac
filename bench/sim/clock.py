"""One virtual clock for a simulated run: the asyncio loop's `time()`, `time.time()` and `time.monotonic()`.

The drivers read `time.time()` / `time.monotonic()` themselves (last use, TTLs, back-offs, waits), so the
simulation replaces those two functions of the `time` module for the length of a run (`VirtualClock.patched`),
and runs on an event loop whose selector, when nothing is ready, moves the clock forward to the next timer
instead of sleeping. A request that prefills for 3 virtual seconds therefore costs microseconds, and timers and
timeouts keep their order. Jobs for worker threads (the state file's I/O) run inline, so a seed repeats
exactly. Bench and test code only: nothing in the product imports this.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

_REAL_TIME = time.time
_REAL_MONOTONIC = time.monotonic


class Stalled(Exception):
    """A run went on past its real-time budget: a loop that never ends (polling in virtual time, or spinning on
    work that is always ready) would otherwise hold a sweep's worker at 100% CPU for ever."""


class VirtualClock:
    """`budget`: real seconds a run may take before the loop raises `Stalled` (None: no limit)."""

    def __init__(self, wall: float = 1_800_000_000.0, mono: float = 10_000.0, budget: float | None = None) -> None:
        self.offset = 0.0
        self.wall0, self.mono0 = wall, mono
        self.budget = budget
        self.deadline: float | None = None   # real monotonic time the budget ends, set when a run starts

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


class _InlineExecutor(ThreadPoolExecutor):
    """The loop's default executor: runs each job at once on the calling thread. Worker threads would finish
    in real-time order, so runs would not repeat; the jobs here are short file operations."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:
            fut.set_exception(e)
        return fut


class _VirtualSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """Never sleeps: with nothing ready, the clock moves on to the next timer."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        deadline = self.clock.deadline
        if deadline is not None and _REAL_MONOTONIC() > deadline:
            self.clock.deadline = None   # raised once: the loop may still run to cancel its tasks
            raise Stalled(f"still running after {self.clock.budget:.0f} real seconds, "
                          f"{self.clock.now:.0f} virtual seconds in")
        ready = super().select(0)
        if ready or not timeout:
            return ready
        self.clock.advance(timeout)
        return []


class _VirtualLoop(asyncio.SelectorEventLoop):
    """Runs executor jobs at once (as `_InlineExecutor` does) and hands their result to the awaiting task one
    loop turn later, which is when a worker thread's result would come back through `call_soon_threadsafe`:
    the same order of callbacks, without a concurrent future, its chaining and a wake-up byte through the
    loop's self-pipe per job (about a tenth of a sweep's time went there)."""

    def run_in_executor(self, executor: Any, func: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        fut = self.create_future()
        try:
            result = func(*args)
        except BaseException as e:
            self.call_soon(_settle, fut, None, e)
        else:
            self.call_soon(_settle, fut, result, None)
        return fut


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.cancelled():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def new_loop(clock: VirtualClock) -> asyncio.AbstractEventLoop:
    """An event loop on `clock` (call inside `clock.patched()`: the loop's time is `time.monotonic`)."""
    loop = _VirtualLoop(_VirtualSelector(clock))
    loop.set_default_executor(_InlineExecutor())
    return loop


def run(clock: VirtualClock, main: Callable[[], Any]) -> Any:
    """Run the coroutine `main()` to its end on a fresh virtual loop, `time` patched meanwhile."""
    if clock.budget is not None:
        clock.deadline = _REAL_MONOTONIC() + clock.budget
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
