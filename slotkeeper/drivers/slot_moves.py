"""The slot moves of one server (`SlotMover`): paging a slot's holder out and a session (or its seed) in, and
the prefix checkpoint step, performed once the slot's paging lock is held.

Why apart: `slotkeeper.drivers.upstream.Upstream` answers requests; this part owns the runners and moves conversations
between slots and files, on the slow path only (new, displaced and paged sessions). What to move is decided by the core
(`slotlogic.pager`), performed by `slotkeeper.drivers.page_runner` and `slotkeeper.drivers.checkpoint_runner`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path

from slotkeeper.drivers.bounds import left, within
from slotkeeper.drivers.build_claims import BuildClaims
from slotkeeper.drivers.checkpoint_runner import CheckpointRunner, PrefixRegistry
from slotkeeper.drivers.handovers import Handovers
from slotkeeper.drivers.llama_http import LlamaClient
from slotkeeper.drivers.page_runner import PageOutcome, PageRunner
from slotkeeper.drivers.pool_seeds import PoolSeeds
from slotkeeper.drivers.seed_pages import save_begun, seed_from_its_page, seed_from_peer_page
from slotkeeper.drivers.slot_gate import WAIT as QUIET_WAIT
from slotkeeper.drivers.slot_gate import SlotGate
from slotkeeper.drivers.source_wait import await_idle, await_source
from slotkeeper.drivers.store import StateStore
from slotlogic import prefix as pfx
from slotlogic import shared, wait
from slotlogic.checkpoint_machine import Outcome
from slotlogic.costs import SlotFileAnswer
from slotlogic.decisions import NeedSlot, Observe
from slotlogic.events import (
    CheckpointDone,
    CostWeighed,
    Event,
    Failed,
    NoSavePath,
    Paged,
    Stage,
)
from slotlogic.keeper import Keeper, Placement
from slotlogic.ledger import Cause, Fence, Holds
from slotlogic.paging import Moved, PageAsk, PageDone, PagePlan
from slotlogic.server import ServerInfo
from slotlogic.settings import CheckpointMode, Settings

REPLACED_GRACE = 60.0  # seconds a page file replaced by a newer page of its session stays (a restore planned)
REMOTE_SETTLE = 10.0   # seconds a pager waits for another proxy's page-out of its session (a shared store)
SEED_SLOT_WAIT = 30.0  # seconds a placement waits for the slot its own conversation is being paged out of


class SlotMover:
    """The slot moves of one server: owns the page runner and the checkpoint runner (made for the settings at
    hand), the gate that says which of our requests reached each slot, and the build claims of a shared store."""

    def __init__(self, url: str, client: LlamaClient, keeper: Keeper, store: StateStore, emit: Callable[[Event], None],
                 gate: SlotGate, state_dir: Path, handovers: Handovers) -> None:
        self.url = url
        self.client = client
        self.keeper = keeper
        self.store = store
        self.emit = emit
        self.gate = gate
        self.handovers = handovers  # the slot asked of its writer before our moves, when another proxy writes it
        self.state_dir = state_dir
        self.builds: BuildClaims | None = None  # a shared store's build markers: one prefix build for all (None: local)
        self.registry = PrefixRegistry()  # this server's own, until it joins a pool (`share`)
        self.pages: PageRunner | None = None
        self.checkpoints: CheckpointRunner | None = None
        self.on_answer: Callable[[SlotFileAnswer], None] = lambda a: None  # each save/restore (slot_speeds.py)
        self.server_busy: Callable[[], bool] = lambda: False  # a request of ours runs at the server (PageRunner)
        self._told_no_save_path = False
        self.elsewhere: PoolSeeds | None = None  # in a pool: seeds from its other servers' slots (`join`)
        self.explain_emptied: Callable[[int], Awaitable[Cause]] | None = None  # the probe's: what emptied a slot
        self.stay: Callable[[int, int, float], float] = lambda slot, chars, by: by  # Rule 3 past the bound (waits)
        # Rule 10 (`slotlogic.wait`): a slot that freed elsewhere while a placement waits for its own (waits)
        self.freed: Callable[[int, str, str, float, float], Awaitable[int]] | None = None

    def join(self, peers: Callable[[], Sequence[SlotMover]]) -> None:
        """The server is one of a pool's: a new session here may start from a copy of another server's slot."""
        self.elsewhere = PoolSeeds(self, peers)
        if self.pages is not None:
            self.pages.copy_from = self.elsewhere.copy

    def share(self, registry: PrefixRegistry) -> None:
        """The server joined a pool: its prefix builds and known prefixes are the pool's from now on."""
        self.registry = registry
        if self.checkpoints is not None:
            self.checkpoints.building, self.checkpoints.known = registry.building, registry.known
            self.checkpoints.registry = registry

    def configure(self, s: Settings, *, files_blocked: bool) -> None:
        """Paging and checkpoint runners for these settings (a runner whose settings stay is kept: its slot
        locks may be held). Where the model check found that a restore cannot resume (`files_blocked`), no
        slot files: no paging, and prefix checkpoints only in memory."""
        if files_blocked:
            s = replace(s, paging=False, checkpoints=CheckpointMode.MEMORY
                        if s.checkpoints is CheckpointMode.DISK else s.checkpoints)
        if s.paging and s.save_dir:
            if self.pages is None or self.pages.save_dir != Path(s.save_dir):
                self.pages = PageRunner(self.client, s.save_dir, s.page_max_bytes, self.emit, self.url)
                self.pages.gate = self.gate
            self.pages.on_answer, self.pages.server_busy = self.on_answer, self.server_busy
            self.pages.holds = lambda slot, key: self.keeper.turns.holds_conversation_of(slot, key)
            if self.elsewhere is not None:
                self.pages.copy_from = self.elsewhere.copy
            self.pages.max_bytes = s.page_max_bytes
            self.pages.shared = self.store.slot_locks
        else:
            self.pages = None
        if s.checkpoints is CheckpointMode.OFF:
            self.checkpoints = None
        elif self.checkpoints is None or self.checkpoints.settings != s or self.checkpoints.index.dir != self.state_dir:
            self.checkpoints = CheckpointRunner(self.client, self.state_dir, s, self.emit, self.url, self.registry)
            self.checkpoints.on_answer = self.on_answer
            self.checkpoints.rates = self.keeper.rates

    def stopped(self, flow_id: str) -> None:
        """A placement planned again: its request did not go; the next pager of its slot may go."""
        self.gate.stopped(flow_id)
        if self.pages is not None:
            self.pages.unlock(flow_id, sent=False)

    def unsent(self, flow_id: str) -> None:
        """The flow's pinned request goes out unpinned after its wait: nothing of ours reaches its slot."""
        self.gate.started(flow_id)
        if self.pages is not None:
            self.pages.unlock(flow_id, sent=False)

    def delete_pages(self, files: list[str]) -> None:
        if self.pages is not None:
            self.pages.delete(files)

    async def moves_for(self, need: NeedSlot, placement: Placement, info: ServerInfo, flow_id: str,
                        by: float | None = None, arrived: float | None = None) -> tuple[Moved, Fence | None, bool]:
        """What the core planned around the new owner of `placement.slot`, performed: the holder paged out and
        this session (or a seed) paged in, waited for until `by` (monotonic; None: no bound) at most. Returns what
        the slot holds for it now (LATE: nothing moved, the bound passed first), the fence after the moves, and
        whether the slot holds the session's stable prefix already (FREED: nothing moved, another slot freed while
        it waited for this one; `arrived`: when its request came, None: it never looks elsewhere). A side call:
        its slot's holder paged out and its home's page in (`side`)."""
        if placement.side:
            return (await self.side(placement, flow_id, by) if self.pages is not None else Moved.NOTHING), None, False
        key = need.ticket.session.key
        holds = self.keeper.pager.holds_prefix(need, placement.view)
        if self.pages is None:
            return Moved.NOTHING, placement.fence, holds
        stable_chars = len(need.stable.text) if need.stable is not None and self.checkpoints is not None else 0
        base = await unbuilt(self.checkpoints, need, info) if not holds else None
        cold = need.stable if base is not None else None
        ask = PageAsk(placement.slot, key, placement.view, views=placement.views, stable_chars=stable_chars, cold=cold,
                      base_chars=base or 0)
        ask = await await_source(self, ask, by)
        if self.elsewhere is not None and not self.store.remote:  # a shared store: only pages are seeds
            ask = await self.elsewhere.find(need, ask, by)
        moved, fence = await self.page(ask, flow_id, fence=placement.fence, by=by, need=need, own=len(need.content),
                                       arrived=arrived)
        if moved is Moved.NOTHING:  # its turn: what was placed there before went out, so judge the slot now
            holds = self.keeper.pager.holds_prefix(need, placement.view)  # (subagents seed 15, docs/paging.md)
        return moved, fence, holds

    async def side(self, placement: Placement, flow_id: str, by: float | None) -> Moved:
        """A side call's turn on the slot it is placed on: the slot's holder paged out (it may be a session's
        conversation, placed there before side calls came: it pages back in whole), its home's page in; waited
        for until `by` (monotonic; None: no bound) at most, else LATE with nothing moved."""
        assert placement.need is not None
        ask = PageAsk(placement.slot, placement.need.ticket.session.key, placement.view)
        moved, _ = await self.page(ask, flow_id, fence=placement.fence, by=by, own=len(placement.need.content))
        return moved

    def give_up(self, need: NeedSlot, flow_id: str) -> Observe:
        """The placement waited out the request's bound with nothing moved (`slotlogic.wait`, Rule 7): the core
        gives it up and the request goes as the client sent it; its slot lock is let go."""
        decision = wait.past_bound(self.keeper.abandon(need.ticket))
        self.unsent(flow_id)
        return decision

    async def page(self, ask: PageAsk, flow_id: str, fence: Fence | None = None, by: float | None = None,
                   need: NeedSlot | None = None, own: int = 0, arrived: float | None = None
                   ) -> tuple[Moved, Fence | None]:
        """Page the slot's holder out and this session in (or, with no page of its own, the conversation it
        shares the most with: a seed); what is in the slot for it now. Decided once the lock is held. Fails
        open: trouble only costs the prefill. `by`: when the request's wait bound ends (monotonic; None: none);
        past it nothing is moved (LATE) and the request goes as the client sent it (`slotlogic.wait`, Rule 7),
        unless our request still running on the slot ends sooner than its own prompt (`own` characters) would
        take elsewhere (Rule 3, `stay`). `arrived`: while it waits for the slot, another slot that frees first
        ends the wait (FREED, nothing sent: Rule 10)."""
        assert self.pages is not None
        slot, key = ask.slot, ask.session_key
        gave_up = Moved.NOTHING if by is None else Moved.LATE
        watch = None if by is None or arrived is None else (slot, flow_id, key, arrived, own)
        # The lock is taken even with nothing to page: a placement on this slot that is still warming its
        # prefix, or whose request has not reached the server, must finish first (a second new session would
        # otherwise find the slot's prefix "there" before it is, and prefill its whole prompt).
        held = await unless_freed(self, self.pages.hold(slot, flow_id, key, within=left(by)), watch)
        if held is None:
            return Moved.FREED, fence
        if not held:
            return gave_up, fence
        # Its turn: every request sent to the slot before has reached the server (a save now writes what
        # they leave there). The moves are fenced by the slot's epoch as it is now.
        if not await self.gate.quiet(slot, within(QUIET_WAIT, by), warn=by is None):
            return gave_up, fence
        if by is not None:
            idle = await unless_freed(self, await_idle(self, {slot}, self.stay(slot, own, by)), watch)
            if idle is None:
                return Moved.FREED, fence
            if not idle:
                return Moved.LATE, fence  # still running a request at the server when the bound passed: nothing sent
        fence = self.keeper.turns.turn(fence) if fence is not None else None
        # The shared state as it is now (a file or Redis): the slot may be another proxy's to write (it is then
        # asked for it, `slotlogic.handover`), or that proxy may have paged this session out meanwhile.
        state = await fresh_pages(self, key)
        given, stale = await self.handovers.take(slot, key, fence, state)
        if given is not None:  # the other proxy may have paged this session out before it answered (sim seed 986)
            await fresh_pages(self, key)
        given = given or self.keeper.turns.handed_with(slot)  # handed over to an earlier plan that went stale
        if stale or not self.keeper.turns.fence_holds(fence):  # we handed the slot on since our claim: place it again
            assert fence is not None
            self.emit(self.keeper.turns.stale_plan(fence, "page", key))
            return Moved.STALE, fence
        self.gate.moves(slot, flow_id)
        if need is not None and ask.elsewhere is None and self.elsewhere is not None and not self.store.remote:
            # Another server may hold the source by now: its session computed it while this one waited its turn
            # (bench subagents-2x2 seed 1: a new subagent prompt, 899 tokens, warmed up cold 3.5 s after the other
            # server's subagent had prefilled it). Only a source there now: this slot's lock is held.
            ask = await self.elsewhere.find(need, ask, by, wait=False)
        ask = replace(ask, sent=self.pages.last_sent.get(slot), given=given, ours=self.gate.last_started.get(slot),
                      paging_out=frozenset(self.pages.saving))
        plan = self.keeper.pager.page_plan(ask)
        # Our own conversation is on a slot another placement is paging now: its page of us is recorded by the
        # time it lets that slot go; wait for that, then plan again (the page is there then).
        if plan.seed is not None and plan.seed.source == key and plan.seed.local_slot is not None \
                and not self.store.remote and self.pages.busy(plan.seed.local_slot) \
                and await self.pages.wait_free(plan.seed.local_slot, slot, within(SEED_SLOT_WAIT, by)):
            ask = replace(ask, sent=self.pages.last_sent.get(slot), ours=self.gate.last_started.get(slot))
            plan = self.keeper.pager.page_plan(ask)
        # The source is being paged out by the placement that took its slot: once its page is recorded the page
        # is the seed (no save needed), instead of prefilling it all (bench subagents seed 1 under load: three
        # sessions waited for one source, whose slot was then taken; one of them warmed 737 tokens cold)
        seed = plan.seed
        source = seed.source if seed is not None and seed.local_slot is not None and seed.source != key \
            and self.pages.busy(seed.local_slot) else self.keeper.pager.page_coming(ask, seed)
        if source is not None and not self.store.remote and await save_begun(self, source, slot, by):
            await self.pages.settled(source, left(by))
            ask = replace(ask, sent=self.pages.last_sent.get(slot), ours=self.gate.last_started.get(slot))
            plan = self.keeper.pager.page_plan(ask)
        if plan.seed is not None and plan.seed.local_slot is not None and (
                self.store.remote or self.pages.placed(plan.seed.local_slot)):
            # A live seed's slot is saved under its local lock only: never while another placement pages it,
            # nor when other proxies (a shared store) may be paging it (a copy of it in progress is waited for:
            # subagents-2x2 seed 1, 732 tokens warmed cold while the other server copied the same slot).
            # Its own live conversation: its page then.
            plan = plan.without_seed() if plan.seed.source != key else self.keeper.pager.page_plan(replace(
                ask, sent=self.pages.last_sent.get(slot), copy_live=False, ours=self.gate.last_started.get(slot)))
        for choice in plan.choices:
            self.emit(CostWeighed(self.url, slot, choice.session[:8] or None, choice))
        if plan.empty:
            return Moved.NOTHING, fence  # nothing to move, but our request must still go after the page-in before it
        if plan.restore_file is not None and not self.keeper.turns.fence_holds(fence):
            assert fence is not None
            self.emit(self.keeper.turns.stale_plan(fence, "page", key))  # the slot moved on while the lock was awaited
            return Moved.STALE, fence
        holder = plan.save_for
        saving = self.pages.save_starts(holder) if holder is not None else None
        # A live seed's save is its source's new page: others copying that source wait for it (subagents seed 17)
        copy_source = plan.seed.source if plan.seed is not None and plan.seed.local_slot is not None \
            and plan.seed_file is not None and plan.seed.source not in (key, plan.save_for) else None
        copying = self.pages.save_starts(copy_source) if copy_source is not None else None
        try:
            if plan.saves:  # the holder's page-out and a live seed's save: both recorded before they are written
                files = await asyncio.to_thread(self.pages.files)
                async with self.store.transaction() as state:
                    room, fits = self.keeper.pager.page_room(state, plan, time.time(), self.pages.max_bytes, files)
                    plan = plan if fits else plan.without_saves()  # what it would write cannot fit the budget
                    replaced = self.keeper.pager.page_intent(state, plan, time.time())
                self.pages.delete(room)  # the budget holds while the saves are written
                # Another placement (of any proxy) may have planned its restore from the record just replaced:
                # a seed from this session's page, on a slot whose lock it holds, not this one. (Its file counts
                # against the budget meanwhile.)
                self.pages.delete_later(replaced, REPLACED_GRACE)
            out = await self.pages.run(plan)
            if plan.copy_file is not None:  # another server's slot, copied: nobody's page
                self.pages.delete([plan.copy_file])
            await self.record_pages(plan, out)
            await found_empty(self, plan, out)
            if plan.seed is not None and plan.seed.slot is not None and out.seed_tokens is None:
                plan, out = await (seed_from_its_page(self, ask, plan, out, fence, by) if plan.seed.server is None
                                   else seed_from_peer_page(self, plan, out, fence, by))
        except Exception as e:
            self.emit(Failed(self.url, Stage.PAGING, type(e).__name__, slot=plan.slot))
            return Moved.NOTHING, fence
        finally:
            if saving is not None:
                self.pages.save_ends(holder or "", saving)
            if copying is not None:
                self.pages.save_ends(copy_source or "", copying)
        if out.missing_save_path and not self._told_no_save_path:
            self._told_no_save_path = True
            self.emit(NoSavePath(self.url, paging=True))
        self.emit(Paged(self.url, plan.slot, plan.save_for[:8] if plan.save_for else None, out.saved_tokens,
                        plan.restore_for[:8] if plan.restore_for else None, out.restored_tokens, out.seconds,
                        out.server_ms, seed=plan.seed is not None))
        if out.restored_tokens is None:
            return Moved.NOTHING, fence
        if plan.seed is None or plan.seed.source == key:  # its own page (a fresh one, saved from its live slot)
            return Moved.OWN, self.keeper.turns.slot_written(fence, Holds.PAGE, key, out.restored_tokens)
        moved = Moved.PREFIX if plan.seed.prefix else Moved.SEED
        return moved, self.keeper.turns.slot_written(fence, Holds.SEED, key, 0, over=Cause.SEED_OVER_OWNER)

    async def record_pages(self, plan: PagePlan, out: PageOutcome) -> None:
        """The page index after a paging step, in the state file; the files it drops deleted."""
        assert self.pages is not None
        files = await asyncio.to_thread(self.pages.files)  # every step: the budget bounds the save dir's page files
        async with self.store.transaction() as state:
            seed = (out.seed_tokens, out.seed_bytes) if out.seed_tokens is not None else None
            done = PageDone(out.saved_tokens, out.saved_bytes, out.restore_failed, seed)
            doomed = self.keeper.pager.pages_recorded(state, plan, done, time.time(), self.pages.max_bytes, files)
        self.pages.delete(doomed)

    async def warm(self, slot: int, need: NeedSlot, info: ServerInfo, holds: bool,
                    fence: Fence | None = None, copied: bool = False) -> Fence | None:
        """Restore or warm the shared prefix into the new session's slot; fail open on anything. With a shared
        store, the build is claimed first (`slotkeeper.drivers.build_claims`): another proxy's build is waited for and
        restored, not prefilled again."""
        assert self.checkpoints is not None and need.stable is not None
        cp, started = self.checkpoints, time.monotonic()
        key = need.ticket.session.key
        claim = await self.builds.claim(cp, need.stable, info) if self.builds is not None else None
        try:
            state = await self.store.aread() if self.store.remote and fence is not None else None
            # the slot moved on while the build was awaited
            if not self.keeper.turns.fence_holds(fence, state, time.time()):
                assert fence is not None
                self.emit(self.keeper.turns.stale_plan(fence, "prefix", key))
                return fence
            orch = await cp.prepare(slot, need.stable, info, holds_prefix=holds, copied=copied)
        except Exception as e:
            self.emit(Failed(self.url, Stage.CHECKPOINT, type(e).__name__, slot=slot))
            return fence
        finally:
            if claim is not None and self.builds is not None:
                await self.builds.finish(cp, info, claim)
        if orch.outcome is not None:
            self.emit(CheckpointDone(self.url, slot, orch.outcome, orch.spent_prefill, orch.identical,
                                     orch.divergent, time.monotonic() - started))
            if orch.outcome is not Outcome.HIT:  # a restore or warm-up wrote the prefix into the slot
                tokens = orch.restored_tokens or orch.saved_tokens or 0
                fence = self.keeper.turns.slot_written(fence, Holds.PREFIX, key, tokens, over=Cause.PREFIX_OVER_OWNER) \
                    or fence
        return fence


async def drop_page(mover: SlotMover, key: str, file: str) -> None:
    """A page the answer showed to be wrong (`Pager.page_doubtful`): out of the index, its file deleted."""
    async with mover.store.transaction() as state:
        doomed = mover.keeper.pager.page_dropped(state, key, file)
    mover.delete_pages(doomed)


async def found_empty(mover: SlotMover, plan: PagePlan, out: PageOutcome) -> None:
    """The page-out found the slot empty where our session's conversation was: the server is asked why
    (`ServerProbe.explain_emptied`), so that loss is labelled so and not after the write that followed."""
    key, outcomes, saved = plan.save_for, mover.keeper.outcomes, out.saved_tokens
    if key is None or saved is None or mover.explain_emptied is None:
        return
    try:
        found = outcomes.found_empty(plan.slot, key, saved)
        if found is None:  # another proxy's session, as far as this ledger knows: the shared state says
            found = outcomes.found_empty(plan.slot, key, saved, await mover.store.fresh(), time.time())
        if not found:
            return
        cause = await mover.explain_emptied(plan.slot)
        outcomes.emptied(key, cause)
        async with mover.store.transaction() as state:  # for the proxy whose session it may be (sim seed 364)
            shared.note_emptied(state, key, cause.value, time.time())
    except Exception as e:  # not asked: the loss keeps the cause the later writes give it
        mover.emit(Failed(mover.url, Stage.PAGING, type(e).__name__, slot=plan.slot))


async def unbuilt(cp: CheckpointRunner | None, need: NeedSlot, info: ServerInfo) -> int | None:
    """No checkpoint file holds the session's stable prefix yet (so a warm-up would prefill it): how much of it
    the longest shorter checkpoint gives (a family's base prompt; 0: none). None: it is built, or being built."""
    if cp is None or need.stable is None or not cp.persist:
        return None
    name = pfx.file_name(cp.fingerprint(need.stable, info))
    if name in cp.building or await asyncio.to_thread(cp.file_known, name, info):
        return None
    base = await asyncio.to_thread(cp.longest_base, need.stable, info, name)
    return base[0] if base is not None else 0


async def fresh_pages(mover: SlotMover, key: str) -> shared.ServerState:
    """With the slot's lock held: the page index as the store has it now (another proxy, of this machine's
    state dir or of a shared store, may have paged this session out since its placement was decided),
    waiting a little while its page is being written (recorded, not saved yet: simulator seed 984, a page
    saved by the other proxy in the same millisecond). Returns the state last read (its epochs fence moves)."""
    deadline = time.monotonic() + REMOTE_SETTLE
    state = await mover.store.fresh()
    while mover.keeper.pager.pages_seen(state, key, time.time(), REMOTE_SETTLE) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        state = await mover.store.fresh()
    mover.keeper.outcomes.emptied_elsewhere(state, key)
    return state


async def unless_freed(mover: SlotMover, waiting: Awaitable[bool],
                       watch: tuple[int, str, str, float, int] | None) -> bool | None:
    """`waiting`'s answer, unless another slot frees first (`SlotMover.freed`, Rule 10): None then, and `waiting`
    is called off (a paging lock it took meanwhile is let go with the placement: `SlotMover.stopped`). `watch`:
    the slot, flow, session, arrival and prompt characters of the placement. It moves once it has waited as long
    as prefilling its own prompt would take: before that, what its slot holds or will hold for it (a copy of a
    conversation it starts with) may still be worth the wait (bench subagents seed 9: moved at once, a subagent
    warmed 393 tokens of its family's prefix up cold, 1.07x its limit against 1.01-1.02x)."""
    if watch is None or mover.freed is None:
        return await waiting
    slot, flow_id, key, arrived, own = watch
    after = wait.estimate(own, mover.keeper.prefill_estimate()) or 0.0
    mine, other = asyncio.ensure_future(waiting), asyncio.ensure_future(mover.freed(slot, flow_id, key, arrived, after))
    try:
        await asyncio.wait({mine, other}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        other.cancel()
        if not mine.done():
            mine.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await mine
    return None if mine.cancelled() else mine.result()
