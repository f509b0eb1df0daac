"""Our pinned requests open on each slot of one server, and the hold of a request whose slot they occupy.

Why: see `slotlogic.wait`. `entered` and `left` run for every pinned request, the hot path included (a few
dict operations, no I/O, no lock); a request only waits here when a request of ours is still open on its
slot, and then at most `slots_wait_bound` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from typing import Any

from slotlogic import wait
from slotlogic.affinity import slot_from_slots
from slotlogic.answers import Observation
from slotlogic.decisions import Pin, Ticket
from slotlogic.events import Event, Scheduled
from slotlogic.keeper import Keeper

Clock = Callable[[], float]
TOLD_FOR = 5.0  # seconds a slot a waiting placement was told of is left to it (it claims it within moments)
MAX_UNPLACED = 4096  # open flows of ours sent with `id_slot: -1` that are remembered (each ends with `left`)
TICK = 0.001  # seconds: a hold never waits less. A remainder under the clock's resolution (a virtual clock's float,
#               a coarse monotonic clock) leaves the clock where it was, and the hold would decide again for ever


class SlotWaits:
    """Our requests open on each slot of one server, and the hold of a pinned request behind them: with a
    `keeper` (the request's bookkeeping when it goes out unpinned), `bound` (`slots_wait_bound`, read at each
    call), `released` (the flow's slot locks let go when it goes elsewhere) and `slots` (`/slots`)."""

    def __init__(self, clock: Clock | None = None, *, keeper: Keeper | None = None,
                 bound: Callable[[], float] = lambda: 0.0, released: Callable[[str], None] = lambda flow_id: None,
                 slots: Callable[[], Awaitable[list[dict[str, Any]] | None]] | None = None,
                 take: Callable[[int], Awaitable[bool]] | None = None,
                 emit: Callable[[Event], None] = lambda e: None, url: str = "") -> None:
        self.clock: Clock = clock or (lambda: time.monotonic())  # read at each call: the simulator patches it
        self.open: dict[int, dict[str, tuple[int, str]]] = {}  # slot -> flow -> (body chars, session; "" side)
        self._slot_of: dict[str, int] = {}
        self._changed: asyncio.Event | None = None  # made by a waiter; set (and dropped) when a request ends
        self.unplaced: dict[str, None] = {}  # flows of ours sent with `id_slot: -1`, open (a slot each, somewhere)
        self.keeper, self.bound, self.released, self.slots = keeper, bound, released, slots
        self.take = take  # makes a free slot this process's to write (the shared state); None: it always is
        self.emit, self.url = emit, url  # the decision record of each request the hold decided
        self.placing: dict[str, float] = {}  # flow -> arrival (this clock): placements waiting for a slot
        self.told: dict[int, tuple[float, str]] = {}  # slot -> when, and which waiting placement, was told it freed

    def entered(self, slot: int, flow_id: str, chars: int, session: str = "") -> None:
        """A request pinned to `slot` leaves the proxy now."""
        self.left(flow_id)
        self.open.setdefault(slot, {})[flow_id] = (chars, session)
        self._slot_of[flow_id] = slot

    def any_open(self) -> bool:
        """Some request of ours is open at the server (pinned, or sent with `id_slot: -1`)."""
        return bool(self.open) or bool(self.unplaced)

    def queued_chars(self) -> dict[int, tuple[int, ...]]:
        """Slot -> the prompt characters of each request of ours open there, in the order they were sent (the
        first runs, the others queue behind it): a busy slot's known wait, for placement."""
        return {slot: tuple(chars for chars, _ in flows.values()) for slot, flows in self.open.items()}

    def left(self, flow_id: str) -> None:
        """Its answer ended (or it failed, or went elsewhere): whoever waits for the slot looks again."""
        slot = self._slot_of.pop(flow_id, None)
        if slot is None:
            if self.unplaced.pop(flow_id, 0) is None:  # an unpinned one of ours ended: a slot frees
                self._wake()
            return
        flows = self.open.get(slot)
        if flows is not None:
            flows.pop(flow_id, None)
            if not flows:
                del self.open[slot]
        self._wake()

    def _wake(self) -> None:
        """Whoever waits for a slot looks again (no waiter: nothing to do, nothing made)."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _change(self) -> asyncio.Event:
        """What a waiter awaits: set when one of our requests next ends, anywhere."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def ahead(self, slot: int, flow_id: str = "", session: str = "") -> wait.Ahead:
        """Our other requests open on `slot`; those of the same `session` do not count (its own work: on its
        own slot it finds its cache after them). A side call passes "": every request ahead counts, its own
        home's too (two side calls of one home are independent; the second need not wait for the first's
        generation when its bound says go elsewhere)."""
        flows = self.open.get(slot)
        if not flows:
            return wait.Ahead()
        others = [chars for fid, (chars, key) in flows.items() if fid != flow_id and not (session and key == session)]
        return wait.Ahead(len(others), sum(others))

    def holder(self, slot: int, flow_id: str = "") -> str | None:
        """The session of the last request of ours sent to `slot` and still open (a side call's: its home)."""
        flows = [session for fid, (_, session) in self.open.get(slot, {}).items() if fid != flow_id]
        return flows[-1] if flows else None

    async def hold(self, slot: int, flow_id: str, *, bound: float, side: bool, own_chars: int,
                   rate: Callable[[], float | None], session: str = "", waited: float = 0.0) -> wait.Plan:
        """Wait while our earlier requests occupy `slot`: GO once it is free, UNPIN when the rules say so.
        `waited`: the seconds the request spent in the proxy before (its placement), counted in the bound."""
        started = self.clock() - max(0.0, waited)
        removed: dict[tuple[Any, str], None] = {}  # what the filters removed while it was held, in order
        while True:
            p = wait.plan(self.ahead(slot, flow_id, session), self.clock() - started, bound, side=side,
                          own_chars=own_chars, rate=rate(),
                          where=wait.Elsewhere(self.free(slot), self.idle(slot), self.exposed(slot),
                                               self.soonest(slot, flow_id)))
            if p.pick is not None:
                removed.update(dict.fromkeys(p.pick.removed))
            if p.verdict is not wait.Verdict.WAIT:
                return p if p.pick is None else replace(p, pick=replace(p.pick, removed=tuple(removed)))
            event = self._change()  # any request of ours ending may free this slot or another
            left = p.until - (self.clock() - started)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), max(TICK, left))

    def free(self, slot: int) -> int | None:
        """A slot other than `slot` that a held request may move to (the core's rule; None: none, or no keeper)."""
        if self.keeper is None:
            return None
        return self.keeper.turns.free_slot(slot, self.open)

    def exposed(self, slot: int) -> int:
        """The promised tokens a request held on `slot` could write over if the server chose its slot (the
        core's count; 0 without a keeper)."""
        if self.keeper is None:
            return 0
        return self.keeper.turns.exposed(slot, self.open)

    def soonest(self, slot: int, flow_id: str) -> int | None:
        """Our work on the other slot expected to free first, in prompt characters (None: no other runs ours)."""
        loads = [sum(chars for fid, (chars, _) in flows.items() if fid != flow_id)
                 for s, flows in self.open.items() if s != slot and flows]
        return min(loads) if loads else None

    def idle(self, avoid: int | None = None, mine: str = "") -> bool:
        """Some slot other than `avoid` runs nothing of ours and no placement but `mine`'s, beyond those our
        requests sent with `id_slot: -1` will take (the scheduler's idle check), counted as a waiting placement
        counts them (`_idle_set`, `_spare`)."""
        return self._spare(self._idle_set(avoid, mine), "") > 0

    def sent_unplaced(self, flow_id: str) -> None:
        """A request of ours goes out with `id_slot: -1`: it takes the first slot that frees (until `left`)."""
        self.unplaced[flow_id] = None
        while len(self.unplaced) > MAX_UNPLACED:
            del self.unplaced[next(iter(self.unplaced))]

    async def until_idle(self, until: float, mine: str = "", flow_id: str = "", arrived: float | None = None) -> bool:
        """Wait until some slot runs nothing of ours and no placement but `mine`'s, at most until `until` (this
        clock): whether one does (a placement past its bound is then placed again, by the driver's one loop).
        `arrived`: when its request came (this clock); placements that came earlier and wait too go first
        (oldest first)."""
        with self._waiting(flow_id, arrived):
            while self._spare(self._idle_set(None, mine), flow_id) <= 0:
                left = until - self.clock()
                if left < TICK:
                    return False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._change().wait(), left)
        return True

    async def freed(self, slot: int, flow_id: str, mine: str, arrived: float, after: float = 0.0) -> int:
        """While a placement waits for `slot` (its paging lock, or the slot still running): returns a slot that
        freed elsewhere since this wait began (it runs nothing of ours and no placement but `mine`'s), once the
        placements that came earlier and wait too have had theirs, and not before `after` seconds from its
        arrival (oldest first). Never returns without a keeper."""
        with self._waiting(flow_id, arrived):
            seen = self._idle_set(slot, mine)
            early = arrived + after - self.clock()
            if early > 0:
                await asyncio.sleep(early)
            while True:
                now = self._idle_set(slot, mine)
                new = now - seen
                if new and self._spare(new, flow_id) > 0:
                    self.told[min(new)] = (self.clock(), flow_id)
                    return min(new)
                seen = now
                await self._change().wait()

    @contextlib.contextmanager
    def _waiting(self, flow_id: str, arrived: float | None) -> Iterator[None]:
        """The placement is one of those waiting for a slot while the block runs (by arrival)."""
        if not flow_id or arrived is None:
            yield
            return
        self.placing[flow_id] = arrived
        try:
            yield
        finally:
            self.placing.pop(flow_id, None)

    def _idle_set(self, avoid: int | None, mine: str) -> frozenset[int]:
        """Idle slots (`Turns.idle_set`) that this process writes, less those a placement was told of a moment
        ago: it is placed again there (its claim comes after a `/slots` look), and the next waiter must not be
        told of it too. A slot another live proxy writes runs requests this one does not see, so its looking
        idle here is no sign that it is: a placement placed again there could page a session in over that
        proxy's turn queued on it."""
        if self.keeper is None:
            return frozenset()
        now = self.clock()
        self.told = {s: (t, f) for s, (t, f) in self.told.items() if now - t < TOLD_FOR}
        idle = self.keeper.turns.idle_set(avoid, self.open, mine)
        return frozenset(s for s in idle if s not in self.told and self.keeper.turns.writes(s))

    def told_to(self, flow_id: str) -> int | None:
        """The slot this waiting placement was just told freed (oldest first), if any: our request there ended, so
        the server frees it at its next step even if `/slots` still shows it running a moment longer."""
        now = self.clock()
        return next((s for s, (t, f) in self.told.items() if f == flow_id and now - t < TOLD_FOR), None)

    def _spare(self, idle: frozenset[int], flow_id: str) -> int:
        """How many of the `idle` slots are left for this placement: less those our requests sent with
        `id_slot: -1` will take, and those of the placements that came before it and wait too. Without a keeper
        (a replay): one; an unknown slot count counts as one idle slot (the server may well have one)."""
        if self.keeper is None:
            return 1
        me = self.placing.get(flow_id)
        older = 0 if me is None else sum(1 for f, t in self.placing.items() if f != flow_id and t < me)
        return (len(idle) if self.keeper.total_slots else 1) - len(self.unplaced) - older

    def must_wait(self, decision: Pin) -> bool:
        """Our earlier requests run on the request's slot, and another slot could run it (one dict look-up)."""
        t = decision.ticket
        slot = t.slot
        return (slot is not None and bool(self.open.get(slot)) and self.keeper is not None
                and self.ahead(slot, session="" if t.side else t.session.key).count > 0
                and self.bound() > 0 and (self.keeper.total_slots or 0) > 1)

    async def held(self, decision: Pin, flow_id: str, content: bytes | None, waited: float = 0.0) -> Pin:
        """A request pinned to a slot where our earlier requests still run waits here rather than in the
        server's queue, at most `slots_wait_bound` seconds from its arrival in the proxy (`waited`: the time
        its placement took, paging included); then (or at once, for a side call behind longer work) it goes
        to a free slot the core chose, or else out with `id_slot: -1` (`slotlogic.wait`). A request whose
        slot is free costs one dict look-up."""
        t = decision.ticket
        if t.slot is None or not self.must_wait(decision):
            return decision
        assert self.keeper is not None
        raw = decision.body if decision.body is not None else content
        held_from = self.clock() - max(0.0, waited)
        plan = await self.hold(t.slot, flow_id, bound=self.bound(), side=t.side, own_chars=len(raw or b""),
                               rate=self.keeper.prefill_estimate, session="" if t.side else t.session.key,
                               waited=waited)
        if plan.pick is not None:
            self.emit(Scheduled(self.url, t.session.short, t.slot, plan.pick, self.clock() - held_from))
        if plan.verdict not in (wait.Verdict.UNPIN, wait.Verdict.MOVE) or not raw:
            return decision
        moved = plan.slot if plan.verdict is wait.Verdict.MOVE else None
        # another proxy may write it: made ours in the shared state first, unless a live proxy writes it
        if moved is not None and not self.keeper.turns.writes(moved) and (
                self.take is None or not await self.take(moved) or self.free(t.slot) != moved):
            if plan.why is not wait.WaitWhy.BOUND:
                return decision  # queued on its own slot: nothing of anyone's is written over
            moved = None
        body = wait.body_with_slot(raw, -1 if moved is None else moved)
        if body is None:
            return decision
        why, holder = plan.why or wait.WaitWhy.BOUND, self.holder(t.slot, flow_id)
        if moved is None:
            t = self.keeper.turns.unpin(t, why, holder)
            self.sent_unplaced(flow_id)
        else:
            t = self.keeper.turns.move_held(t, moved, why, holder, time.time())
        self.released(flow_id)
        return Pin(t, body)

    async def ran_unpinned(self, ticket: Ticket, obs: Observation) -> None:
        """A request the wait sent with `id_slot: -1`: which slot ran it, from `/slots` right after its answer."""
        if self.keeper is None or self.slots is None:
            return
        slot = slot_from_slots(await self.slots() or [], obs.tokens_total, self.keeper.total_slots)
        if slot is not None:
            self.keeper.outcomes.ran_unpinned(slot, ticket, time.time())
