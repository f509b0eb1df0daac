"""Which requests this proxy sent to each slot of one server have reached it, and who moves what where.

Why: a slot runs one task at a time, in arrival order, and a save or restore sent to a busy slot waits behind
what is already there. So a page-out only keeps the conversation it stands for if every request sent to the
slot before it has reached the server (`quiet`), and a slot handed to another proxy (`slotlogic.handover`) is
only the other proxy's to write once that holds and no move of ours is under way (`still`). The response
headers say a request reached the server: a stream's come when the server starts it, a whole answer's when
it ends; either way after every task before it on the slot, so the order in which headers come is the order
in which the slot ran them (`last_started`).

Kept with or without slot files (the handover needs it either way). `sent` and `started` run on every pinned
request, the hot path included: a few dict operations, no I/O, no lock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from slotlogic.events import Event, PagingLockTimeout

WAIT = 300.0  # longer than any sane request: a leaked entry only delays, never blocks, a slot


class SlotGate:
    def __init__(self, upstream: str, emit: Callable[[Event], None]) -> None:
        self.upstream = upstream
        self.emit = emit
        self.unstarted: dict[int, dict[str, str]] = {}  # slot -> flows sent there whose headers have not come
        self.last_started: dict[int, tuple[str, float]] = {}  # slot -> (session, when) of its last that came
        self.moving: dict[int, str] = {}  # slot -> the flow whose placement writes it now
        self._flow_slot: dict[str, int] = {}
        self._quiet: dict[int, asyncio.Event] = {}

    def sent(self, slot: int, flow_id: str, session: str = "") -> None:
        """A request pinned to `slot` leaves the proxy; `session` is a side call's home for a side call."""
        self.started(flow_id)  # a retried flow's earlier slot
        self.unstarted.setdefault(slot, {})[flow_id] = session
        self._flow_slot[flow_id] = slot

    def stopped(self, flow_id: str) -> None:
        """The flow's placement writes nothing more (its request is about to go, or it is placed again)."""
        for slot in [s for s, f in self.moving.items() if f == flow_id] if self.moving else ():
            del self.moving[slot]

    def started(self, flow_id: str) -> None:
        """The flow's response headers came (the server has its request), or it ended or never went."""
        self.stopped(flow_id)
        slot = self._flow_slot.pop(flow_id, None)
        if slot is None:
            return
        flows = self.unstarted.get(slot)
        if flows is not None:
            if flow_id in flows:
                self.last_started[slot] = (flows.pop(flow_id), time.time())
            if not flows:
                del self.unstarted[slot]
                event = self._quiet.pop(slot, None)
                if event is not None:
                    event.set()

    async def quiet(self, slot: int, timeout: float = WAIT, *, warn: bool = True) -> bool:
        """Wait until every request sent to `slot` so far has reached the server; False when `timeout` ran out
        first (the caller moves nothing then; `warn`: logged as a lock that was never let go)."""
        deadline = time.monotonic() + timeout
        while slot in self.unstarted:
            event = self._quiet.setdefault(slot, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                if warn:
                    self.emit(PagingLockTimeout(self.upstream, slot, timeout))
                return False
        return True

    def moves(self, slot: int, flow_id: str) -> None:
        """A placement starts writing `slot` (until its flow's headers come or it ends): a handover of the slot
        to another proxy waits for that (a placement still waiting for an answer of its own writes nothing)."""
        self.moving[slot] = flow_id

    async def still(self, slot: int, timeout: float) -> bool:
        """Wait until no placement of ours writes `slot` and every request we sent there has reached the server
        (what a slot handed to another proxy needs first); False when `timeout` ran out."""
        deadline = time.monotonic() + timeout
        while slot in self.moving:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return await self.quiet(slot, max(0.0, deadline - time.monotonic()))
