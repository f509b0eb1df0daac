"""The slot moves of one server (`SlotMover`): paging a slot's holder out and a session (or its seed) in, and
the prefix checkpoint step, performed once the slot's paging lock is held.

Why apart: `slotkeeper.drivers.upstream.Upstream` answers requests; this part owns the runners and moves conversations
between slots and files, on the slow path only (new, displaced and paged sessions). What to move is decided by the core
(`slotlogic.pager`), performed by `slotkeeper.drivers.page_runner` and `slotkeeper.drivers.checkpoint_runner`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path

from slotkeeper.drivers.build_claims import BuildClaims
from slotkeeper.drivers.checkpoint_runner import CheckpointRunner, PrefixRegistry
from slotkeeper.drivers.handovers import Handovers
from slotkeeper.drivers.llama_http import LlamaClient
from slotkeeper.drivers.page_budget import checkpoint_buckets
from slotkeeper.drivers.page_move import PageMove
from slotkeeper.drivers.page_runner import PageOutcome, PageRunner
from slotkeeper.drivers.pool_seeds import PoolSeeds
from slotkeeper.drivers.slot_gate import SlotGate
from slotkeeper.drivers.source_wait import await_source
from slotkeeper.drivers.store import StateStore
from slotlogic import wait
from slotlogic.checkpoint_machine import Orchestrator, Outcome, Phase
from slotlogic.costs import SlotFileAnswer
from slotlogic.decisions import NeedSlot, Observe
from slotlogic.events import (
    CheckpointDone,
    Event,
    Failed,
    NoSavePath,
    Stage,
)
from slotlogic.keeper import Keeper, Placement
from slotlogic.ledger import Cause, Fence, Holds
from slotlogic.paging import Moved, PageAsk, PageDone, PagePlan
from slotlogic.restore_health import RestoreKind
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
        # how long past its bound a placement keeps its turn while our request ahead ends soon (`wait.stay_past`)
        self.stay: Callable[[int, int, float], float] = lambda slot, chars, by: by
        # a slot that freed elsewhere while a placement waits for its own (`SlotWaits.freed`)
        self.freed: Callable[[int, str, str, float, float], Awaitable[int]] | None = None
        # what a restore just put in a slot for the request placed there (`Ticket.restore`), until it is pinned
        self.restored: dict[int, tuple[RestoreKind, int]] = {}
        # a prefix restore judged by its own verification: (slot, tokens restored, cache_n of the verification)
        self.on_restore: Callable[[int, int, int], None] = lambda slot, restored, cached: None

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
        if s.paging and (s.save_dir or s.save_remote):
            where = Path(s.save_dir) if s.save_dir else None  # None: the server's, out of this machine's reach
            if self.pages is None or self.pages.save_dir != where:
                self.pages = PageRunner(self.client, s.save_dir, s.page_max_bytes, self.emit, self.url)
                self.pages.gate = self.gate
            self.pages.on_answer, self.pages.server_busy = self.on_answer, self.server_busy
            self.pages.holds = lambda slot, key: self.keeper.turns.holds_conversation_of(slot, key)
            if self.elsewhere is not None:
                self.pages.copy_from = self.elsewhere.copy
            self.pages.budget.max_bytes = s.page_max_bytes
            self.pages.budget.sizes = lambda: (self.keeper.total_slots, self.keeper.server and self.keeper.server.n_ctx,
                                        self.keeper.rates().kv_bytes_per_token)
            self.pages.budget.auto = s.page_budget_auto
            self.pages.shared = self.store.slot_locks
        else:
            self.pages = None
        if s.checkpoints is CheckpointMode.OFF:
            self.checkpoints = None
        elif self.checkpoints is None or self.checkpoints.settings != s or self.checkpoints.index.dir != self.state_dir:
            self.checkpoints = CheckpointRunner(self.client, self.state_dir, s, self.emit, self.url, self.registry)
            self.checkpoints.on_answer = self.on_answer
            self.checkpoints.rates = self.keeper.rates
            if s.save_remote and s.checkpoints is CheckpointMode.DISK:
                self.checkpoints.buckets = lambda: checkpoint_buckets(
                    s.checkpoint_max_bytes, self.keeper.server and self.keeper.server.n_ctx,
                    self.keeper.rates().kv_bytes_per_token)

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
        cp, stable = self.checkpoints, need.stable
        stable_chars = len(stable.text) if stable is not None and cp is not None else 0
        base = await cp.unbuilt(stable, info) if cp is not None and stable is not None and not holds else None
        cold = stable if base is not None else None
        ask = PageAsk(placement.slot, key, placement.view, views=placement.views, stable_chars=stable_chars, cold=cold,
                      base_chars=base or 0)
        ask = await await_source(self, ask, by)
        if self.elsewhere is not None and not self.store.remote:  # a shared store: only pages are seeds
            ask = await self.elsewhere.find(need, ask, by)
        moved, fence = await self.page(ask, flow_id, fence=placement.fence, by=by, need=need, own=len(need.content),
                                       arrived=arrived)
        if moved is Moved.NOTHING:  # its turn: what was placed there before went out, so judge the slot now
            holds = self.keeper.pager.holds_prefix(need, placement.view)  # (docs/paging.md)
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
        """The placement waited out the request's bound with nothing moved (its client's patience spent): the core
        gives it up and the request goes as the client sent it; its slot lock is let go."""
        decision = wait.past_bound(self.keeper.abandon(need.ticket))
        self.unsent(flow_id)
        return decision

    async def page(self, ask: PageAsk, flow_id: str, fence: Fence | None = None, by: float | None = None,
                   need: NeedSlot | None = None, own: int = 0, arrived: float | None = None
                   ) -> tuple[Moved, Fence | None]:
        """Page the slot's holder out and this session in (or, with no page of its own, the conversation it
        shares the most with: a seed): one `PageMove`. What is in the slot for it now, and the fence after."""
        return await PageMove(self, flow_id, by).run(ask, fence, need, own, arrived)

    def no_save_path(self) -> None:
        """The server has no `--slot-save-path`: said once."""
        if not self._told_no_save_path:
            self._told_no_save_path = True
            self.emit(NoSavePath(self.url, paging=True))

    async def record_pages(self, plan: PagePlan, out: PageOutcome) -> None:
        """The page index after a paging step, in the state file; the files it drops deleted."""
        assert self.pages is not None
        files = await asyncio.to_thread(self.pages.files)  # every step: the budget bounds the save dir's page files
        async with self.store.transaction() as state:
            seed = (out.seed_tokens, out.seed_bytes) if out.seed_tokens is not None else None
            done = PageDone(out.saved_tokens, out.saved_bytes, out.restore_failed, seed)
            doomed = self.keeper.pager.pages_recorded(state, plan, done, time.time(), self.pages.budget.bytes(), files)
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
        self._restore_seen(slot, orch)
        if orch.outcome is not None:
            self.emit(CheckpointDone(self.url, slot, orch.outcome, orch.spent_prefill, orch.identical,
                                     orch.divergent, time.monotonic() - started))
            if orch.outcome is not Outcome.HIT:  # a restore or warm-up wrote the prefix into the slot
                tokens = orch.restored_tokens or orch.saved_tokens or 0
                fence = self.keeper.turns.slot_written(fence, Holds.PREFIX, key, tokens, over=Cause.PREFIX_OVER_OWNER) \
                    or fence
        return fence

    def _restore_seen(self, slot: int, orch: Orchestrator) -> None:
        """A prefix restore is judged by its verification when one ran (the same prompt: most of it must be
        cached), else by the answer of the request it was made for."""
        if not orch.restored_tokens or orch.phase is not Phase.DONE:
            return
        if orch.identical is not None:
            self.on_restore(slot, orch.restored_tokens, orch.identical[0])
        elif orch.outcome is Outcome.RESTORED:
            self.restored[slot] = (RestoreKind.PREFIX, orch.restored_tokens)


async def drop_page(mover: SlotMover, key: str, file: str) -> None:
    """A page the answer showed to be wrong (`Pager.page_doubtful`): out of the index, its file deleted."""
    async with mover.store.transaction() as state:
        doomed = mover.keeper.pager.page_dropped(state, key, file)
    mover.delete_pages(doomed)
