"""Slot handovers between proxies sharing one state (`slotlogic.handover`): the giver's side, the beat, and the
taker's (`take`: a placement's moves wait for the slot's writer to hand it over).

One background task per server this proxy fronts (started with the first placement or flush): it looks at the
shared state for handovers other proxies ask of this one, and answers each once this proxy's sessions are off
the slot, its requests there have reached the server and no move of its own is under way; and, while this
proxy has live sessions on the server, it says it is alive (`handover.beat`) every `handover.BEAT` seconds.

Cost: the file store is looked at only when its file changed (one `stat` every `FILE_POLL` seconds); a shared
store (Redis) is read every `REMOTE_POLL` seconds, and at once when a claim notice arrives (`poke`). Nothing
here is on a request's path. Fail open: a store that cannot be read or written leaves the taker to wait out its
bound (`handover.WAIT`), then move in anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable

from slotkeeper.drivers.slot_gate import SlotGate
from slotkeeper.drivers.store import StateStore
from slotlogic import handover, shared
from slotlogic.events import Event, Failed, HandedOver, Stage
from slotlogic.handover import Handover
from slotlogic.keeper import Keeper
from slotlogic.ledger import Fence

FILE_POLL = 0.05
IDLE_POLL = 1.0   # no other proxy alive in the state: nobody can ask us (a new one beats before it asks)
REMOTE_POLL = 0.5
HANDOVER_POLL = 0.025  # seconds between looks at the store while a taker waits for the giver's answer


class Handovers:
    def __init__(self, url: str, keeper: Keeper, store: StateStore, emit: Callable[[Event], None],
                 gate: SlotGate) -> None:
        self.url = url
        self.keeper = keeper
        self.store = store
        self.emit = emit
        self.gate = gate
        self._task: asyncio.Task[None] | None = None
        self._giving: set[tuple[int, str]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._seen: int | None = None       # the state file's mtime at the last look
        self._beat = 0.0                    # monotonic time of the last beat written
        self._wake: asyncio.Future[None] | None = None
        self._others = True  # another live proxy was in the state last seen (until the first look says)

    def start(self) -> None:
        if self._task is None or self._task.done():
            with contextlib.suppress(RuntimeError):
                self._task = asyncio.get_running_loop().create_task(self._run())

    def poke(self) -> None:
        """A claim notice came: look now."""
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def _pause(self) -> None:
        """Until the next look: FILE_POLL while another proxy is alive in the state last seen (it may ask us
        for a slot), IDLE_POLL while none is; a shared store every REMOTE_POLL, or at once on a notice."""
        loop = asyncio.get_running_loop()
        interval = REMOTE_POLL if self.store.remote else FILE_POLL if self._others else IDLE_POLL
        self._wake = loop.create_future()
        handle = loop.call_later(interval, lambda f=self._wake: f.done() or f.set_result(None))
        try:
            await self._wake
        finally:
            handle.cancel()

    def stop(self) -> None:
        for task in (self._task, *self._tasks):
            if task is not None and not task.done():
                task.cancel()

    async def _run(self) -> None:
        try:
            while True:
                await self._pause()
                try:
                    await self._look()
                except Exception as e:  # fail open: the taker's wait is bounded
                    self.emit(Failed(self.url, Stage.BACKGROUND, type(e).__name__))
                    await asyncio.sleep(1.0)
        except asyncio.CancelledError:
            raise

    async def _look(self) -> None:
        now = time.monotonic()
        due = now - self._beat >= handover.BEAT and self.keeper.turns.holds_conversations()
        if not due and not self._changed():
            return
        state = await self.store.fresh()  # the state this process last wrote or read is not parsed again
        if due:
            age = self.keeper.turns.beat_age(state, time.time())  # a placement's transaction beats too
            if age < handover.BEAT:
                self._beat = now - age
            else:
                self._beat = now
                async with self.store.transaction() as state:
                    self.keeper.turns.beat(state, time.time())
        self._others = self.keeper.turns.others_alive(state, time.time())
        asked = self.keeper.turns.asked_of_us(state)
        for h in asked:
            if (h.slot, h.taker) not in self._giving:
                self._giving.add((h.slot, h.taker))
                task = asyncio.get_running_loop().create_task(self._give(h))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    def _changed(self) -> bool:
        """The shared state may hold something new for us (a file: its mtime moved on; Redis: always)."""
        if self.store.remote:
            return True
        path = getattr(self.store, "path", None)
        try:
            mtime = os.stat(path).st_mtime_ns if path is not None else None
        except OSError:
            return False
        changed, self._seen = mtime != self._seen, mtime
        return changed

    async def _give(self, h: Handover) -> None:
        started = time.monotonic()
        try:
            self.keeper.turns.hand_over_begins(h)  # our sessions stay off the slot from now on
            await self.gate.still(h.slot, handover.WAIT)
            last = self.keeper.turns.hand_over_ends(h)
            ran = self.gate.last_started.get(h.slot)
            if ran is not None:  # the last of our requests there to reach the server: what the slot holds
                last = ran[0] or None
            async with self.store.transaction() as state:
                answered = handover.acknowledge(state.writers, state.handovers, h, last, ran[1] if ran else None,
                                                time.time())
            if answered:
                self.emit(HandedOver(self.url, h.slot, time.monotonic() - started, True, giver=True,
                                     session=last[:8] if last else None))
        except Exception as e:
            self.emit(Failed(self.url, Stage.BACKGROUND, type(e).__name__, slot=h.slot))
        finally:
            self.keeper.turns.hand_over_cleared(h)
            self._giving.discard((h.slot, h.taker))

    async def take(self, slot: int, key: str, fence: Fence | None,
                   state: shared.ServerState) -> tuple[Handover | None, bool]:
        """Make this process the slot's writer before its moves (`slotlogic.handover`): at once when it is
        already, nobody's or its writer is gone; else the writer is asked and its answer awaited (read from the
        store every HANDOVER_POLL seconds, at most `handover.WAIT`; without it the slot is taken anyway). The
        answer (None: none needed or none came), and whether this placement went stale meanwhile (we handed
        the slot on to another proxy since its claim)."""
        started = time.monotonic()
        while True:
            # Never decided while this process is handing the slot to another proxy (a state read before that
            # answer is written is stale): wait for the answer to be out, then ask for the slot back. What is
            # decided here and `gate.moves` after it run without a pause between (nothing else runs between).
            while self.keeper.turns.handing_over(slot) and time.monotonic() - started < handover.WAIT:
                await asyncio.sleep(HANDOVER_POLL)
                state = await self.store.fresh()
            if self.keeper.turns.may_write(state, slot):
                return self.keeper.turns.late_answer(state, slot), False
            async with self.store.transaction() as state:
                asked = self.keeper.turns.writer_turn(state, slot, key or "side-call", time.time())
            if asked is not None:
                break
            if not self.keeper.turns.handing_over(slot):
                return None, False
            state = await self.store.fresh()
        answer, stale = None, False
        while time.monotonic() - started < handover.WAIT:
            await asyncio.sleep(HANDOVER_POLL)
            state = await self.store.fresh()
            answer = self.keeper.turns.handover_answer(state, asked)
            if answer is not None:
                self.keeper.turns.writer_given(answer)
                break
            if not handover.alive(state.beats, asked.giver, time.time()):
                break
            if not self.keeper.turns.fence_holds(fence):
                stale = True
                break
        if answer is None and not stale:
            async with self.store.transaction() as state:
                self.keeper.turns.writer_forced(state, asked, time.time())
        self.emit(HandedOver(self.url, slot, time.monotonic() - started, answer is not None, giver=False))
        return answer, stale
