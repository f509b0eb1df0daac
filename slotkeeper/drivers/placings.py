"""Placing a request on one server: one placement of a session at a time (`Placings`), and the one loop where
a placement is planned again when the world overtook its plan (`Placing`).

Why: two requests of one session can arrive together (a client's retry, two windows that open with the same
prompt, so the same content key). Each would get its own placement from the core, and the core keeps only a
session's newest one (`slotlogic/placements.py`): the first one's pin would then be out of order, and both requests
went out unpinned through the fail-open path. So a session's second request waits here until the first one is
placed, then asks the core again, which now answers from memory (the session is on its slot, `Keeper.resume`),
or places it anew when the first went elsewhere or failed. Only the slow path passes here: a known session's turn
never takes this lock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from slotkeeper.drivers.bounds import left
from slotkeeper.drivers.server_probe import Facts
from slotlogic import server, shared, wait
from slotlogic.decisions import NeedSlot, Observe, RequestFacts
from slotlogic.events import FreedFirst, NoPrefixMarker, NoSlotsEndpoint
from slotlogic.keeper import Placement
from slotlogic.ledger import Fence
from slotlogic.paging import Moved
from slotlogic.server import ServerInfo

if TYPE_CHECKING:
    from slotkeeper.drivers.upstream import Accept, Upstream

T = TypeVar("T")


class Placings:
    def __init__(self) -> None:
        self._turns: dict[str, tuple[asyncio.Lock, int]] = {}  # session key -> its lock, the requests at it

    def __len__(self) -> int:
        return len(self._turns)

    async def one_at_a_time(self, need: NeedSlot, again: Callable[[NeedSlot], T | NeedSlot],
                            place: Callable[[NeedSlot, bool], Awaitable[T]]) -> T:
        """`place(need, waited)` with no other placement of the session under way; after a wait, `again(need)`
        first: the core's answer from memory, or the `NeedSlot` to place (`waited`: what was asked before is old)."""
        key = need.ticket.session.key
        lock, waiting = self._turns.get(key, (asyncio.Lock(), 0))
        self._turns[key] = (lock, waiting + 1)
        waited = lock.locked()
        try:
            async with lock:
                if waited:
                    answer = again(need)
                    if not isinstance(answer, NeedSlot):
                        return answer
                    need = answer
                return await place(need, waited)
        finally:
            lock, waiting = self._turns[key]
            if waiting > 1:
                self._turns[key] = (lock, waiting - 1)
            else:
                del self._turns[key]


@dataclass(frozen=True)
class Tries:
    """Where a request's placement on one server stands: stale plans it may still place again, its client's
    patience (`wait.hold_cap`), and whether an earlier try here claimed a slot (a refusal then lets that claim
    go)."""
    retries: int = 2
    cap: float | None = None
    claimed: bool = False
    last: bool = False  # placed again past its patience (`Placing.late`): past this try's bound it goes unpinned
    arrived: float | None = None  # when its request came (monotonic): placements held longer go first
    freed: int = 8  # how many more times a slot that freed elsewhere may place it again (`SlotWaits.freed`)

    def again(self) -> Tries:
        return replace(self, retries=self.retries - 1, claimed=True)

    def watch(self) -> float | None:
        """Its arrival while another slot freeing may still place it again (None: it waits for its slot)."""
        return self.arrived if self.freed > 0 else None


@dataclass(frozen=True)
class Again:
    """A placement's plan that the world overtook, back for a new plan: the request as placed, its bound, and
    where its tries stand."""
    need: NeedSlot
    by: float | None
    tries: Tries


class Placing:
    """One request's placement on one server: the one loop where it is planned again. Each turn asks the core
    for a plan and carries it out (`try_once`); a turn whose plan the world overtook (a fence that moved, its
    bound passed before its slot was ours, another slot freed first) comes back as `Again`, with what it
    learned, for a new plan. No turn plans twice."""

    def __init__(self, up: Upstream, facts: RequestFacts, flow_id: str, accept: Accept | None) -> None:
        self.up, self.facts, self.flow_id, self.accept = up, facts, flow_id, accept

    async def run(self, need: NeedSlot, asked: Facts | None, by: float | None, tries: Tries) -> Any:
        while True:
            out = await self.try_once(need, asked, by, tries)
            if not isinstance(out, Again):
                return out
            need, by, tries, asked = out.need, out.by, out.tries, None

    async def try_once(self, need: NeedSlot, asked: Facts | None, by: float | None, tries: Tries) -> Any:
        """One plan for the placement, carried out: the slot claimed in the core, the moves the core planned for
        it, the prefix warmed; the decision, or `Again`."""
        up, key, now = self.up, need.ticket.session.key, self.facts.now
        if up.pages is not None:
            await up.pages.settled(key, left(by))  # its page-out is in flight: page it back in after
        info, props, live = await self.server_facts(asked, tries)
        if info is None:
            decision, event = up.keeper.fallback(need, now, await up.sync.last_known_total(), self.facts.path)
            up.emit(event)
            return decision
        if live is None and props is not None and not up.offline and "no-slots" not in up.warned:
            up.warned.add("no-slots")
            up.emit(NoSlotsEndpoint(up.url))
        async with up.store.transaction() as state:
            if self.accept is not None and not self.accept(state, info, live):
                return self.refused(state, need, claimed=tries.claimed)
            placement = up.keeper.assign(need, state, info, live, now, up.waits.queued_chars(),
                                         up.pages.locked() if up.pages is not None else ())
        for event in placement.events:
            up.emit(event)
        if up.pages is not None and placement.dropped_pages:
            up.pages.delete(placement.dropped_pages)
        if up.pages is None and not up.offline:  # no moves, but another proxy may write the slot: asked first
            _, stale = await up.handovers.take(placement.slot, key, placement.fence, await up.store.fresh())
            if stale and tries.retries > 0:
                return Again(placement.need or need, by, tries.again())
        return await self.carry_out(placement.need or need, placement, info, by, tries)

    async def carry_out(self, need: NeedSlot, placement: Placement, info: ServerInfo, by: float | None,
                        tries: Tries) -> Any:
        """The moves the core planned around the placement's slot, then the prefix, then the pin. A side call
        takes its turn on the slot too: a placement may be under way there (its holder is paged out first,
        once its request reached the server)."""
        up, key, now = self.up, need.ticket.session.key, self.facts.now
        moved, fence, holds = await up.mover.moves_for(need, placement, info, self.flow_id, by, tries.watch())
        if moved is Moved.FREED:  # another slot freed before this one was ours
            return self.freed(need, by, tries)
        if moved is Moved.LATE:  # its bound passed before this one was ours
            return await self.late(need, by, tries)
        if moved is Moved.STALE and tries.retries > 0:  # another claim of the slot came first: place it again
            up.mover.stopped(self.flow_id)
            return Again(need, by, tries.again())
        if moved is Moved.STALE:  # twice: it goes where it was placed, with nothing moved (fail open)
            moved = Moved.NOTHING
        if placement.side:  # no prefix of its own to warm (a side call whose page step went stale: placed again)
            return up.keeper.pin(placement, now)
        fence = await self.warm(need, placement, info, moved, fence, holds)
        restore = up.mover.restored.pop(placement.slot, None)  # judged by this request's answer
        if fence is not None and not up.keeper.turns.fence_holds(fence) and tries.retries > 0:
            # Another placement claimed the slot while this one's moves ran: plan this request again.
            up.emit(up.keeper.turns.stale_plan(fence, "pin", key))
            up.mover.stopped(self.flow_id)
            return Again(need, by, tries.again())
        return up.keeper.pin(placement, now, seeded=moved in (Moved.SEED, Moved.PREFIX), restore=restore)

    async def server_facts(self, asked: Facts | None, tries: Tries
                           ) -> tuple[ServerInfo | None, dict[str, Any] | None, list[dict[str, Any]] | None]:
        """The server's `/props` and `/slots` for a placement (a replay: as recorded with the flow)."""
        up, facts = self.up, self.facts
        if up.offline:
            recorded = (facts.replay.facts if facts.replay else None) or {}
            props = recorded.get("props") or {"total_slots": up.keeper.total_slots or 4}
            return up.prober.server_info(props), props, recorded.get("slots")
        up.auth.learn(facts.fields)
        info, props, live = await up.prober.facts_for(asked, tries.arrived, up.settings.wait_bound)
        if live is not None and (told := up.waits.told_to(self.flow_id)) is not None:  # a slot it was told freed
            live = server.ended_on(live, told)
        return info, props, live

    async def warm(self, need: NeedSlot, placement: Placement, info: ServerInfo, moved: Moved, fence: Fence | None,
                   holds: bool) -> Fence | None:
        """The shared prefix into the slot when nothing was paged in (or a prefix was copied); the fence after."""
        up = self.up
        if up.checkpoints is not None and need.stable is not None and moved in (Moved.NOTHING, Moved.PREFIX):
            return await up.mover.warm(placement.slot, need, info, holds and moved is Moved.NOTHING, fence=fence,
                                       copied=moved is Moved.PREFIX)
        if up.checkpoints is not None and need.stable is None and "no-marker" not in up.warned:
            up.warned.add("no-marker")
            up.emit(NoPrefixMarker(up.url, need.ticket.session.short, up.settings.markers))
        return fence

    def refused(self, state: shared.ServerState, need: NeedSlot, *, claimed: bool) -> None:
        """The pool's `accept` refused this server, and the request goes to another. A try made here before
        (placed again after its bound, or after a stale plan) claimed a slot and entered the session in the
        table: both go, or the session's next turn comes back here to an old copy instead of to its current
        conversation on the other server."""
        if claimed:
            shared.forget_session(state, need.ticket.session.key)
            self.up.abandon(need.ticket, self.flow_id)

    def freed(self, need: NeedSlot, by: float | None, tries: Tries) -> Again:
        """Another slot freed while the placement waited for its own, nothing moved: it lets go of its slot and
        is placed again now, within the same bound."""
        up = self.up
        up.emit(FreedFirst(up.url, need.ticket.session.short, up.waits.told_to(self.flow_id),
                           time.monotonic() - (tries.arrived or time.monotonic())))
        self.let_go(need.ticket.session.key)
        return Again(need, by, replace(tries, claimed=True, freed=tries.freed - 1))

    async def late(self, need: NeedSlot, by: float | None, tries: Tries) -> Again | Observe:
        """A placement whose bound passed before its slot was ours to write, nothing moved: it lets go of its
        slot (two waiting placements never keep the one slot that could run either from each other) and is
        placed again once a slot runs nothing of ours, within its client's patience (from its arrival); else it
        goes as the client sent it."""
        up = self.up
        bound, key, cap = up.settings.wait_bound, need.ticket.session.key, tries.cap
        cap = cap if cap is not None or by is None else by - bound + wait.hold_cap(bound)
        if by is not None and cap is not None and by < cap:
            self.let_go(key)  # its slot's lock and claim let go while it waits
            if await up.waits.until_idle(cap, mine=key, flow_id=self.flow_id, arrived=tries.arrived):
                return Again(need, cap, Tries(cap=cap, claimed=True, arrived=tries.arrived, freed=tries.freed))
        if up.pages is not None and by is not None and not tries.last and not need.ticket.side:
            # At its patience every slot still runs or awaits our work, so it waits in the server's queue
            # whichever way it goes. Sent with `id_slot: -1` it would prefill from nothing on a slot the server
            # chooses, over a promised conversation; placed again for one more patience, its moves wait their
            # turn on the slot the ranking finds soonest (never sent to a slot still running) and its page
            # comes back in.
            self.let_go(key)
            last = time.monotonic() + wait.hold_cap(bound)
            return Again(need, last, Tries(cap=last, claimed=True, last=True, arrived=tries.arrived,
                                           freed=tries.freed))
        up.waits.sent_unplaced(self.flow_id)
        return up.mover.give_up(need, self.flow_id)

    def let_go(self, key: str) -> None:
        """A placement to be placed again lets go of its slot: the lock, and its claim in the core."""
        self.up.mover.stopped(self.flow_id)
        self.up.keeper.withdraw(key)
