"""Our pinned requests open on each slot of one server, and the hold of a request whose slot they occupy.

Why: see `slotlogic.wait`. `entered` and `left` run for every pinned request, the hot path included (a few
dict operations, no I/O, no lock); a request only waits here when a request of ours is still open on its
slot, and then at most `slots_wait_bound` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from slotlogic import wait

Clock = Callable[[], float]


class SlotWaits:
    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock or (lambda: time.monotonic())  # read at each call: the simulator patches it
        self.open: dict[int, dict[str, tuple[int, str]]] = {}  # slot -> flow -> (body chars, session; "" side)
        self._slot_of: dict[str, int] = {}
        self._freed: dict[int, asyncio.Event] = {}

    def entered(self, slot: int, flow_id: str, chars: int, session: str = "") -> None:
        """A request pinned to `slot` leaves the proxy now."""
        self.left(flow_id)
        self.open.setdefault(slot, {})[flow_id] = (chars, session)
        self._slot_of[flow_id] = slot

    def left(self, flow_id: str) -> None:
        """Its answer ended (or it failed, or went elsewhere): whoever waits for the slot looks again."""
        slot = self._slot_of.pop(flow_id, None)
        if slot is None:
            return
        flows = self.open.get(slot)
        if flows is not None:
            flows.pop(flow_id, None)
            if not flows:
                del self.open[slot]
        event = self._freed.pop(slot, None)
        if event is not None:
            event.set()

    def ahead(self, slot: int, flow_id: str = "", session: str = "") -> wait.Ahead:
        """Our other requests open on `slot`; those of the same `session` do not count (its own work: on its
        own slot it finds its cache after them), side calls ("") always do."""
        flows = self.open.get(slot)
        if not flows:
            return wait.Ahead()
        others = [chars for fid, (chars, key) in flows.items() if fid != flow_id and not (session and key == session)]
        return wait.Ahead(len(others), sum(others))

    def holder(self, slot: int, flow_id: str = "") -> str | None:
        """The session of the last request of ours sent to `slot` and still open ("" a side call)."""
        flows = [session for fid, (_, session) in self.open.get(slot, {}).items() if fid != flow_id]
        return flows[-1] if flows else None

    async def hold(self, slot: int, flow_id: str, *, bound: float, side: bool, own_chars: int,
                   rate: Callable[[], float | None], session: str = "") -> wait.Plan:
        """Wait while our earlier requests occupy `slot`: GO once it is free, UNPIN when the rules say so."""
        started = self.clock()
        while True:
            p = wait.plan(self.ahead(slot, flow_id, session), self.clock() - started, bound, side=side,
                          own_chars=own_chars, rate=rate())
            if p.verdict is not wait.Verdict.WAIT:
                return p
            event = self._freed.setdefault(slot, asyncio.Event())
            left = bound - (self.clock() - started)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), max(0.0, left))
