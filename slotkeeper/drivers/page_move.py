"""One page move of one placement (`PageMove`): the slot's turn, one plan from the core once what that plan waits
on has settled, and that plan carried out, once.

Why apart from `SlotMover`: the mover owns one server's runners and what they share; a page move owns one
placement's step on one slot (its flow, its bound) from the lock to the fence it leaves behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from dataclasses import replace
from typing import TYPE_CHECKING

from slotkeeper.drivers.bounds import left, within
from slotkeeper.drivers.page_runner import PageOutcome
from slotkeeper.drivers.seed_pages import save_begun, seed_from_its_page, seed_from_peer_page
from slotkeeper.drivers.slot_gate import WAIT as QUIET_WAIT
from slotkeeper.drivers.source_wait import await_idle
from slotlogic import scheduler, shared
from slotlogic.costs import Move
from slotlogic.decisions import NeedSlot
from slotlogic.events import CostWeighed, Failed, Paged, Stage
from slotlogic.handover import Handover
from slotlogic.ledger import Cause, Fence, Holds
from slotlogic.paging import Moved, PageAsk, PagePlan
from slotlogic.restore_health import RestoreKind

if TYPE_CHECKING:
    from slotkeeper.drivers.slot_moves import SlotMover

REPLACED_GRACE = 60.0  # seconds a page file replaced by a newer page of its session stays (a restore planned)
REMOTE_SETTLE = 10.0   # seconds a pager waits for another proxy's page-out of its session (a shared store)
SEED_SLOT_WAIT = 30.0  # seconds a placement waits for the slot its own conversation is being paged out of


class PageMove:
    def __init__(self, mover: SlotMover, flow_id: str, by: float | None) -> None:
        self.m, self.flow_id, self.by = mover, flow_id, by  # `by`: the request's bound (monotonic; None: none)

    async def run(self, ask: PageAsk, fence: Fence | None, need: NeedSlot | None, own: int, arrived: float | None
                  ) -> tuple[Moved, Fence | None]:
        """Page the slot's holder out and this session in (or, with no page of its own, the conversation it
        shares the most with: a seed); what is in the slot for it now. Decided once the lock is held. Fails
        open: trouble only costs the prefill. `by`: when the request's wait bound ends (monotonic; None: none);
        past it nothing is moved (LATE) and the request goes as the client sent it, unless our request still
        running on the slot ends sooner than its own prompt (`own` characters) would take elsewhere (`stay`).
        `arrived`: while it waits for the slot, another slot that frees first ends the wait (FREED, nothing
        sent). The order: the slot's turn (`_turn`), one plan from the core once what it waits on has settled
        (`_settled_plan`), that plan carried out (`_carry_out`)."""
        assert self.m.pages is not None
        slot, key, flow_id, by = ask.slot, ask.session_key, self.flow_id, self.by
        turn = await self._turn(slot, flow_id, key, fence, by, (slot, flow_id, key, arrived, own))
        if isinstance(turn, Moved):
            return turn, fence
        fence, given = turn
        self.m.gate.moves(slot, flow_id)
        if need is not None and ask.elsewhere is None and self.m.elsewhere is not None and not self.m.store.remote:
            # Another server may hold the source by now: its session computed it while this one waited its turn.
            # Only a source there now: this slot's lock is held.
            ask = await self.m.elsewhere.find(need, ask, by, wait=False)
        ask = replace(ask, given=given, paging_out=frozenset(self.m.pages.saving), ring=self.m.pages.budget.ring_size())
        plan, ask = await self._settled_plan(ask, by)
        for choice in plan.choices:
            self.m.emit(CostWeighed(self.m.url, slot, choice.session[:8] or None, choice))
            if choice.move is Move.PAGE_OUT and not choice.worth:
                self.m.keeper.pager.let_go(choice.session)
        if plan.empty:
            return Moved.NOTHING, fence  # nothing to move, but our request must still go after the page-in before it
        if plan.restore_file is not None and not self.m.keeper.turns.fence_holds(fence):
            assert fence is not None
            # the slot moved on while the lock was awaited
            self.m.emit(self.m.keeper.turns.stale_plan(fence, "page", key))
            return Moved.STALE, fence
        return await self._carry_out(plan, ask, fence, by)

    async def _turn(self, slot: int, flow_id: str, key: str, fence: Fence | None, by: float | None,
                    watch: tuple[int, str, str, float | None, int]) -> Moved | tuple[Fence | None, Handover | None]:
        """The slot's turn for this placement: its paging lock, every request sent to it before at the server,
        the slot idle (with a bound), and the slot this process's to write. The fence after the turn and the
        hand-over it came with; or what ended the wait (LATE, FREED, STALE)."""
        assert self.m.pages is not None
        gave_up = Moved.NOTHING if by is None else Moved.LATE
        looking = None if by is None or watch[3] is None else watch
        # The lock is taken even with nothing to page: a placement on this slot that is still warming its
        # prefix, or whose request has not reached the server, must finish first (a second new session would
        # otherwise find the slot's prefix "there" before it is, and prefill its whole prompt).
        held = await self.unless_freed(self.m.pages.hold(slot, flow_id, key, within=left(by)), looking)
        if held is None:
            return Moved.FREED
        if not held:
            return gave_up
        # Its turn: every request sent to the slot before has reached the server (a save now writes what they
        # leave there). The moves are fenced by the slot's epoch as it is now.
        if not await self.m.gate.quiet(slot, within(QUIET_WAIT, by), warn=by is None):
            return gave_up
        if by is not None:
            idle = await self.unless_freed(await_idle(self.m, {slot}, self.m.stay(slot, watch[4], by)), looking)
            if idle is None:
                return Moved.FREED
            if not idle:
                return Moved.LATE  # still running a request at the server when the bound passed: nothing sent
        fence = self.m.keeper.turns.turn(fence) if fence is not None else None
        # The shared state as it is now (a file or Redis): the slot may be another proxy's to write (it is then
        # asked for it, `slotlogic.handover`), or that proxy may have paged this session out meanwhile.
        state = await self.fresh_pages(key)
        given, stale = await self.m.handovers.take(slot, key, fence, state)
        if given is not None:  # the other proxy may have paged this session out before it answered
            await self.fresh_pages(key)
        given = given or self.m.keeper.turns.handed_with(slot)  # handed over to an earlier plan that went stale
        if stale or not self.m.keeper.turns.fence_holds(fence):  # we handed the slot on since our claim: place it again
            assert fence is not None
            self.m.emit(self.m.keeper.turns.stale_plan(fence, "page", key))
            return Moved.STALE
        return fence, given

    async def _settled_plan(self, ask: PageAsk, by: float | None) -> tuple[PagePlan, PageAsk]:
        """The core's page plan, once what it would copy has settled. A plan may name a source that is about to
        become a page: the session's own conversation on a slot another placement is paging out, or a seed's
        source that a placement pages out. Each is waited for at most once, in that order, and the core plans
        again with the world as it is then; a live seed this slot's lock cannot make safe is dropped last."""
        assert self.m.pages is not None
        ask = self._now(ask)
        plan = self.m.keeper.pager.page_plan(ask)
        for settles in (self._own_page_settles, self._source_page_settles):
            if await settles(plan, ask, by):
                ask = self._now(ask)
                plan = self.m.keeper.pager.page_plan(ask)
        seed = plan.seed
        if seed is not None and seed.local_slot is not None and (
                self.m.store.remote or self.m.pages.placed(seed.local_slot)):
            # A live seed's slot is saved under its local lock only: never while another placement pages it, nor
            # when other proxies (a shared store) may be paging it. Its own live conversation: its page then.
            if seed.source != ask.session_key:
                return plan.without_seed(), ask
            plan = self.m.keeper.pager.page_plan(replace(self._now(ask), copy_live=False))
        return plan, ask

    def _now(self, ask: PageAsk) -> PageAsk:
        """The ask with what was last sent to and started on its slot, as of now."""
        assert self.m.pages is not None
        return replace(ask, sent=self.m.pages.last_sent.get(ask.slot), ours=self.m.gate.last_started.get(ask.slot))

    async def _own_page_settles(self, plan: PagePlan, ask: PageAsk, by: float | None) -> bool:
        """The session's own conversation is on a slot another placement is paging now: its page is recorded by
        the time that placement lets the slot go. Whether it was waited for."""
        assert self.m.pages is not None
        seed = plan.seed
        return (seed is not None and seed.source == ask.session_key and seed.local_slot is not None
                and not self.m.store.remote and self.m.pages.busy(seed.local_slot)
                and await self.m.pages.wait_free(seed.local_slot, ask.slot, within(SEED_SLOT_WAIT, by)))

    async def _source_page_settles(self, plan: PagePlan, ask: PageAsk, by: float | None) -> bool:
        """The seed's source is being paged out by the placement that took its slot: once its page is recorded
        the page is the seed (no save needed), instead of prefilling it all. Whether it was waited for."""
        assert self.m.pages is not None
        seed = plan.seed
        source = seed.source if seed is not None and seed.local_slot is not None and seed.source != ask.session_key \
            and self.m.pages.busy(seed.local_slot) else self.m.keeper.pager.page_coming(ask, seed)
        if source is None or self.m.store.remote or not await save_begun(self.m, source, ask.slot, by):
            return False
        await self.m.pages.settled(source, left(by))
        return True

    async def _carry_out(self, plan: PagePlan, ask: PageAsk, fence: Fence | None, by: float | None
                         ) -> tuple[Moved, Fence | None]:
        """The plan's saves recorded, then run; the page index after it; what the slot holds for the session."""
        assert self.m.pages is not None
        names = self.m.keeper.pager.names
        plan, writing = self.m.keeper.pager.claim_names(plan, self.m.pages.budget.ring_size())
        key = ask.session_key
        holder = plan.save_for
        saving = self.m.pages.save_starts(holder) if holder is not None else None
        # A live seed's save is its source's new page: others copying that source wait for it
        copy_source = plan.seed.source if plan.seed is not None and plan.seed.local_slot is not None \
            and plan.seed_file is not None and plan.seed.source not in (key, plan.save_for) else None
        copying = self.m.pages.save_starts(copy_source) if copy_source is not None else None
        reading = names.reads(plan)
        try:
            if plan.saves:  # the holder's page-out and a live seed's save: both recorded before they are written
                files, budget = await asyncio.to_thread(self.m.pages.files), self.m.pages.budget.bytes()
                async with self.m.store.transaction() as state:
                    room, fits = self.m.keeper.pager.page_room(state, plan, time.time(), budget, files)
                    plan = plan if fits else plan.without_saves()  # what it would write cannot fit the budget
                    replaced = self.m.keeper.pager.page_intent(state, plan, time.time())
                self.m.pages.delete(room)  # the budget holds while the saves are written
                # Another placement (of any proxy) may have planned its restore from the record just replaced:
                # a seed from this session's page, on a slot whose lock it holds, not this one. (Its file counts
                # against the budget meanwhile.)
                self.m.pages.delete_later(replaced, REPLACED_GRACE)
            out = await self.m.pages.run(plan)
            if plan.copy_file is not None:  # another server's slot, copied: nobody's page
                self.m.pages.delete([plan.copy_file])
            await self.m.record_pages(plan, out)
            await self.found_empty(plan, out)
            if plan.seed is not None and plan.seed.slot is not None and out.seed_tokens is None:
                plan, out = await (seed_from_its_page(self.m, ask, plan, out, fence, by) if plan.seed.server is None
                                   else seed_from_peer_page(self.m, plan, out, fence, by))
        except Exception as e:
            self.m.emit(Failed(self.m.url, Stage.PAGING, type(e).__name__, slot=plan.slot))
            return Moved.NOTHING, fence
        finally:
            names.read_done(reading)
            names.write_done(writing)
            if saving is not None:
                self.m.pages.save_ends(holder or "", saving)
            if copying is not None:
                self.m.pages.save_ends(copy_source or "", copying)
        return self._moved(plan, out, fence, key)

    def _moved(self, plan: PagePlan, out: PageOutcome, fence: Fence | None, key: str) -> tuple[Moved, Fence | None]:
        """What the run put in the slot for the session, reported, and the fence after it."""
        if out.missing_save_path:
            self.m.no_save_path()
        self.m.emit(Paged(self.m.url, plan.slot, plan.save_for[:8] if plan.save_for else None, out.saved_tokens,
                          plan.restore_for[:8] if plan.restore_for else None, out.restored_tokens, out.seconds,
                          out.server_ms, seed=plan.seed is not None))
        if out.restored_tokens is None:
            return Moved.NOTHING, fence
        if plan.seed is None or plan.seed.source == key:  # its own page (a fresh one, saved from its live slot)
            self.m.restored[plan.slot] = (RestoreKind.PAGE, out.restored_tokens)  # judged by the answer after it
            return Moved.OWN, self.m.keeper.turns.slot_written(fence, Holds.PAGE, key, out.restored_tokens)
        moved = Moved.PREFIX if plan.seed.prefix else Moved.SEED
        return moved, self.m.keeper.turns.slot_written(fence, Holds.SEED, key, 0, over=Cause.SEED_OVER_OWNER)


    async def found_empty(self, plan: PagePlan, out: PageOutcome) -> None:
        """The page-out found the slot empty where our session's conversation was: the server is asked why
        (`ServerProbe.explain_emptied`), so that loss is labelled so and not after the write that followed."""
        key, outcomes, saved = plan.save_for, self.m.keeper.outcomes, out.saved_tokens
        if key is None or saved is None or self.m.explain_emptied is None:
            return
        try:
            found = outcomes.found_empty(plan.slot, key, saved)
            if found is None:  # another proxy's session, as far as this ledger knows: the shared state says
                found = outcomes.found_empty(plan.slot, key, saved, await self.m.store.fresh(), time.time())
            if not found:
                return
            cause = await self.m.explain_emptied(plan.slot)
            outcomes.emptied(key, cause)
            async with self.m.store.transaction() as state:  # for the proxy whose session it may be
                shared.note_emptied(state, key, cause.value, time.time())
        except Exception as e:  # not asked: the loss keeps the cause the later writes give it
            self.m.emit(Failed(self.m.url, Stage.PAGING, type(e).__name__, slot=plan.slot))

    async def fresh_pages(self, key: str) -> shared.ServerState:
        """With the slot's lock held: the page index as the store has it now (another proxy, of this machine's
        state dir or of a shared store, may have paged this session out since its placement was decided),
        waiting a little while its page is being written (recorded, not saved yet: the other proxy may be saving
        it in the same moment). Returns the state last read (its epochs fence moves)."""
        deadline = time.monotonic() + REMOTE_SETTLE
        state = await self.m.store.fresh()
        while self.m.keeper.pager.pages_seen(state, key, time.time(), REMOTE_SETTLE) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            state = await self.m.store.fresh()
        self.m.keeper.outcomes.emptied_elsewhere(state, key)
        return state


    async def unless_freed(self, waiting: Awaitable[bool], watch: tuple[int, str, str, float, int] | None
                               ) -> bool | None:
        """`waiting`'s answer, unless another slot frees first (`SlotMover.freed`): None then, and `waiting`
        is called off (a paging lock it took meanwhile is let go with the placement: `SlotMover.stopped`). `watch`:
        the slot, flow, session, arrival and prompt characters of the placement. It moves once it has waited as long
        as prefilling its own prompt would take: before that, what its slot holds or will hold for it (a copy of a
        conversation it starts with) may still be worth the wait: moved at once, it warms that part up cold."""
        if watch is None or self.m.freed is None:
            return await waiting
        slot, flow_id, key, arrived, own = watch
        after = scheduler.seconds(own, self.m.keeper.prefill_estimate()) or 0.0
        mine = asyncio.ensure_future(waiting)
        other = asyncio.ensure_future(self.m.freed(slot, flow_id, key, arrived, after))
        try:
            await asyncio.wait({mine, other}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            other.cancel()
            if not mine.done():
                mine.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await mine
        return None if mine.cancelled() else mine.result()
