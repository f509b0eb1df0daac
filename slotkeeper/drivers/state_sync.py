"""One server's sessions kept in step with the shared state (a file of this machine, or Redis for several).

Why apart: the driver places requests; this part writes and reads what other proxies see. It flushes the
coalesced `last_used` touches (at most one write per `flush_interval`, none on the hot path), looks for a slot
this process shares with another (`Turns.reconcile`) and for our sessions another proxy's ran over
(`Turns.displaced_by_others`, or at once from a claim notice), writes the last touches at shutdown, and carries
the operator's commands (release, move) into the state in the background. What each change means is the core's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Protocol

from slotkeeper.drivers.store import StateStore
from slotkeeper.drivers.tasks import Tasks
from slotlogic import shared
from slotlogic.events import CacheModeFound, DisplacedElsewhere, Event, Failed, SlotShared, Stage, Via
from slotlogic.keeper import Keeper
from slotlogic.notices import ClaimNotice
from slotlogic.server import CacheMode
from slotlogic.settings import Settings


class Prober(Protocol):
    """The server's background `/props` probe (`slotkeeper.drivers.server_probe.ServerProbe`)."""

    last_probe: float

    async def probe(self) -> None: ...


class StateSync:
    def __init__(self, url: str, keeper: Keeper, store: StateStore, emit: Callable[[Event], None], tasks: Tasks, *,
                 delete_pages: Callable[[list[str]], None], poke: Callable[[], None],
                 settings: Callable[[], Settings]) -> None:
        self.url = url
        self.keeper = keeper
        self.store = store
        self.emit = emit
        self.tasks = tasks
        self.delete_pages = delete_pages  # page files nothing refers to any more (the page runner's, if any)
        self.poke = poke                  # another proxy's notice came: a handover may be asked of us
        self.last_reconcile = 0.0
        self._file_total: int | None = None
        self._file_total_read = False
        self.settings = settings  # read at each pass: the flush and probe intervals
        self._task: asyncio.Task[None] | None = None

    def kick(self, reconcile_every: float, prober: Prober) -> None:
        """Make sure the background flusher/prober runs (no I/O here)."""
        if self._task is None or self._task.done():
            with contextlib.suppress(RuntimeError):
                self._task = asyncio.get_running_loop().create_task(self._background(reconcile_every, prober))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _background(self, reconcile_every: float, prober: Prober) -> None:
        """Every `flush_interval`: the touches flushed, else a look for a shared slot now and then; the server's
        `/props` probed every `probe_interval`."""
        try:
            while True:
                await asyncio.sleep(self.settings().flush_interval)
                if not await self.flush() and time.monotonic() - self.last_reconcile >= reconcile_every:
                    await self.reconcile()
                every = self.settings().probe_interval
                if every > 0 and time.monotonic() - prober.last_probe >= every:
                    await prober.probe()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the background task must never die silently
            self.emit(Failed(self.url, Stage.BACKGROUND, type(e).__name__))

    async def flush(self) -> bool:
        """Write the coalesced touches (and look for a slot shared with another process in what was written);
        False when there was nothing to write."""
        table = self.keeper.table
        touches = table.drain()
        if not touches:
            return False
        try:
            async with self.store.transaction() as state:
                for key, a in touches.items():
                    shared.touch(state, key, a.slot, a.last_used, requests=a.requests, prefix=a.prefix,
                                 proxy=self.keeper.instance)
                self.keeper.turns.beat(state, time.time())
                self.note_displaced(state)
        except Exception as e:
            self.emit(Failed(self.url, Stage.STATE_WRITE, type(e).__name__))
            table.retouch(touches)
            return True
        self._reconciled(state)
        return True

    async def take_free(self, slot: int) -> bool:
        """A held request's move to `slot`: the slot made this process's to write in the shared state, unless a
        live proxy writes it (`Turns.take_free`); False also when the store cannot be written (fail open)."""
        try:
            async with self.store.transaction() as state:
                return self.keeper.turns.take_free(state, slot, time.time())
        except Exception as e:
            self.emit(Failed(self.url, Stage.STATE_WRITE, type(e).__name__))
            return False

    async def reconcile(self) -> None:
        """With nothing to flush: read the state (no lock, a worker thread) and look for a shared slot."""
        if not self.keeper.table.keys():
            return
        state = await self.store.aread()  # a worker thread for the file, one GET for Redis
        self.note_displaced(state)
        self._reconciled(state)

    def _reconciled(self, state: shared.ServerState) -> None:
        self.last_reconcile = time.monotonic()
        marker = self.keeper.server.media_marker if self.keeper.server else None
        if shared.clears_idle_slots(state, marker) and self.keeper.facts.cache_mode_found(CacheMode.IDLE_CLEARED):
            self.emit(CacheModeFound(self.url, CacheMode.IDLE_CLEARED, seen="state"))  # another proxy probed it
        for key in self.keeper.turns.reconcile(state, time.time()):
            self.emit(SlotShared(self.url, key[:8], self.keeper.table.slot_of(key)))

    def note_displaced(self, state: shared.ServerState) -> None:
        """Our sessions another proxy's session ran over (memory only; the hot path reads it)."""
        if not self.store.remote:  # proxies on one machine: the file store's own reconcile covers them
            return
        for slot, ours, other in self.keeper.turns.displaced_by_others(state):
            self.emit(DisplacedElsewhere(self.url, slot, ours[:8], other[:8], Via.FLUSH))

    def claimed_elsewhere(self, notice: ClaimNotice) -> None:
        """Another proxy claimed a slot of this server (its notice, pushed through the store): the session of
        ours that believed it held the slot is displaced now, not at the next flush, so its next request is
        placed again (and paged in) instead of prefilling on a slot that holds another conversation. Memory
        only; the listener's task calls it, never a request."""
        self.poke()
        key = self.keeper.turns.claimed_elsewhere(notice.slot, notice.claimant, notice.at if notice.sent else None)
        if key is not None:
            self.emit(DisplacedElsewhere(self.url, notice.slot, key[:8], notice.claimant[:8], Via.NOTICE))

    def flush_sync(self) -> None:
        """The last flush at shutdown (`done` must stay sync): the last touches written, and this process's
        claims released (`shared.leave`): a proxy started next finds the slots free, not held by sessions of a
        process that is gone. The sessions' records stay: one that comes back to the next proxy resumes its slot
        while nobody else has taken it."""
        touches = self.keeper.table.drain()
        me = self.keeper.instance
        last = self.store.last
        claims = bool(me) and (me in last.beats or any(r.proxy == me for r in last.slots.values()))
        if not touches and not claims:
            return
        try:
            with self.store.transaction_sync() as state:
                for key, a in touches.items():
                    shared.touch(state, key, a.slot, a.last_used, requests=a.requests, prefix=a.prefix, proxy=me)
                if me:
                    shared.leave(state, me)
        except Exception as e:
            self.emit(Failed(self.url, Stage.FINAL_FLUSH, type(e).__name__))

    async def last_known_total(self) -> int | None:
        """The slot count in the state file, for the hash fallback after a proxy restart (read once)."""
        if not self._file_total_read:
            self._file_total_read = True
            self._file_total = (await self.store.aread()).total_slots
        return self._file_total

    # ------------------------------------------------------------------------------------------- commands

    def _matching(self, wanted: str) -> list[str]:
        return shared.match_sessions(list({*self.store.last.sessions, *self.keeper.table.keys()}), wanted)

    def release(self, wanted: str) -> list[str]:
        """Forget the sessions whose key starts with `wanted`: their slots are free for the next new session.
        This process forgets them at once; the state follows in the background (never a blocking lock on the
        event loop)."""
        keys = self._matching(wanted)
        if not keys:
            return []
        table = self.keeper.table
        slots = {k: (table.slot_of(k) if table.slot_of(k) is not None else self.store.last.sessions[k].slot)
                 for k in keys}
        self.keeper.turns.forget(keys)
        self.tasks.spawn(self._release_in_file(keys))
        return [f"{k[:8]} (slot {slots[k]}) on {self.url}" for k in keys]

    async def _release_in_file(self, keys: list[str]) -> None:
        doomed = []
        async with self.store.transaction() as state:
            for key in keys:
                shared.forget_session(state, key)
                page = state.pages.pop(key, None)
                if page is not None:
                    doomed.append(page.file)
        self.delete_pages(doomed)

    def move(self, wanted: str, slot: int) -> list[str]:
        """Move the sessions whose key starts with `wanted` to `slot` from their next request on (the state
        follows in the background)."""
        keys = self._matching(wanted)
        now = time.time()
        moved = {key: self.keeper.turns.move(key, slot, now) for key in keys}
        if moved:
            self.tasks.spawn(self._claim_in_file(moved, slot, now))
        return [f"{k[:8]} → slot {slot} on {self.url}" for k in keys]

    async def _claim_in_file(self, moved: dict[str, str | None], slot: int, now: float) -> None:
        async with self.store.transaction() as state:
            for key, prefix in moved.items():
                shared.claim(state, key, slot, now, prefix=prefix)
