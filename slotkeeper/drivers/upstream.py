"""One llama-server behind the proxy: performs what its `slotlogic.keeper.Keeper` decides.

It owns the I/O the pure core must not do: `/props` and `/slots` look-ups for a new session, the locked
state-file transaction that claims a slot, session paging and prefix checkpoints through their runners, the
coalesced flush of `last_used` touches (at most one write per `flush_interval`), and a background `/props`
probe that notices a restarted server (new `media_marker`) or a resized pool (new `total_slots`). `/props`
never wakes a sleeping server; `/slots` is only asked when a new session needs a slot or a cache loss needs
explaining.

The order of one request that the core cannot answer from memory (`NeedSlot`):
1. wait while this session is being paged out (so it can be paged back in);
2. `/props` + `/slots` (or the facts recorded with a replayed flow); no answer: this process's last `/props`
   answer, and only when it never had one, the hash fallback. An endpoint that hung is not asked again for
   `BACKOFF` seconds (the state file and the last answer decide);
3. under the state lock: `Keeper.assign` claims a slot;
4. under that slot's paging lock: `Keeper.page_plan`, the page recorded (`Keeper.page_intent`), then the
   page-out/page-in, then the outcome recorded;
5. the prefix checkpoint, when nothing was paged in;
6. `Keeper.pin`: the body that goes out.
Anything that fails after step 3 rolls the bookkeeping back (`Keeper.abandon`): the request goes out as the
client sent it and nothing says it was pinned.

The proxy's own calls carry `slots_api_key`, never a client's (`slotkeeper.drivers.server_auth`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from slotkeeper.drivers.bounds import deadline
from slotkeeper.drivers.build_claims import BuildClaims
from slotkeeper.drivers.checkpoint_runner import CheckpointRunner
from slotkeeper.drivers.handovers import Handovers
from slotkeeper.drivers.llama_http import LlamaClient
from slotkeeper.drivers.model_check import ModelCheck
from slotkeeper.drivers.page_runner import PageRunner
from slotkeeper.drivers.placings import Placing, Placings, Tries
from slotkeeper.drivers.server_auth import ServerAuth
from slotkeeper.drivers.server_probe import Facts, ServerProbe
from slotkeeper.drivers.slot_gate import SlotGate
from slotkeeper.drivers.slot_moves import SlotMover, drop_page
from slotkeeper.drivers.slot_speeds import SlotSpeeds
from slotkeeper.drivers.slot_wait import SlotWaits
from slotkeeper.drivers.state_sync import StateSync
from slotkeeper.drivers.store import StateStore
from slotkeeper.drivers.store_file import StateFile
from slotkeeper.drivers.tasks import Tasks
from slotlogic import shared, wait
from slotlogic.affinity import Learn
from slotlogic.answers import Observation
from slotlogic.decisions import Decision, NeedSlot, Observe, Pin, Report, RequestFacts, Ticket
from slotlogic.events import (
    Event,
    PageRejected,
    RestoresBroken,
    ServerRestarted,
)
from slotlogic.intake import Recognition
from slotlogic.keeper import Keeper
from slotlogic.model_facts import ReuseKind
from slotlogic.restore_health import RestoreKind
from slotlogic.server import ServerInfo
from slotlogic.settings import CheckpointMode, Settings

Emit = Callable[[Event], None]
PROBE_TIMEOUT = 30.0
SLOW = 1.0          # seconds: a /props or /slots that failed after this long hung (the timeout is 3 s)
BACKOFF = 30.0      # seconds a hung endpoint is not asked by new sessions (the background probe may clear it)
RECONCILE_EVERY = 5.0  # seconds between looks for a slot shared with another process while idle
# the settings the model check's verdict depends on: a change checks the server again
MODEL_INPUTS = ("swa_full", "cache_type_k", "cache_type_v", "paging", "checkpoints", "save_dir", "throughput_probe")
Accept = Callable[[shared.ServerState, ServerInfo, list[dict[str, Any]] | None], bool]


@dataclass(frozen=True)
class Shared:
    """What one server's driver shares with the rest of the proxy: the state store (None: this machine's file)
    with the build claims of a store several proxies share, and the recognition of the pool's sessions."""

    store: StateStore | None = None
    builds: BuildClaims | None = None
    recognition: Recognition | None = None


class Upstream:
    def __init__(self, url: str, settings: Settings, state_dir: str | Path, emit: Emit, *,
                 offline: bool = False, client: LlamaClient | None = None, shared_with: Shared = Shared(),
                 loaded: Callable[[], Any] | None = None) -> None:
        store, builds, recognition = shared_with.store, shared_with.builds, shared_with.recognition
        self.url = url
        self.offline = offline  # replaying saved flows: no network, no background task, no slot files
        self._out = emit
        self.emit: Emit = self._event  # what the core's placements and answers report (a restart is acted on)
        self.client = client or LlamaClient(url)
        # A pool's servers share one recognition; this process's page file names are its own.
        self.keeper = Keeper(settings, url, recognition, instance=os.urandom(8).hex())
        self.state_dir = Path(state_dir)
        self.store: StateStore = store if store is not None else StateFile(self.state_dir, url, emit)
        self.settings = settings
        self.gate = SlotGate(url, emit)  # which of our requests reached the server, slot by slot
        self.handovers = Handovers(url, self.keeper, self.store, emit, self.gate)  # slots other proxies take
        self.mover = SlotMover(url, self.client, self.keeper, self.store, emit, self.gate, self.state_dir,
                               self.handovers)  # pages and prefix checkpoints
        self.mover.builds = builds
        # our requests open on each slot: a request behind them waits a bounded time (not in a replay)
        self.waits = SlotWaits(keeper=None if offline else self.keeper, bound=lambda: self.settings.wait_bound,
                               released=self.mover.unsent, slots=self.client.slots,
                               take=lambda slot: self.sync.take_free(slot), emit=emit, url=url)
        self.model = ModelCheck(self.client, emit, url, on_speed=self.keeper.outcomes.probed,
                                turns=self.keeper.turns)
        self.speeds = SlotSpeeds(url, self.keeper, self.model, emit, lambda: self.settings)  # every save/restore
        self.model.on_answer = self.mover.on_answer = self.speeds
        self.mover.server_busy = self.waits.any_open
        self.tasks = Tasks()  # background work an answer or a command started
        self.placings = Placings()  # one placement of a session at a time
        self.prober = ServerProbe(url, self.client, self.keeper, self._event, self.model, self.tasks,
                                 loaded=loaded, on_checked=lambda: self._runners(self.settings))
        self.prober.store = self.store
        self.mover.explain_emptied = self.prober.explain_emptied
        self.mover.on_restore = self._prefix_verified
        self.mover.freed = None if offline else self.waits.freed
        self.mover.stay = lambda slot, chars, by: by + wait.stay_past(
            self.waits.ahead(slot), chars, self.keeper.prefill_estimate(), self.settings.wait_bound)
        self.sync = StateSync(url, self.keeper, self.store, emit, self.tasks, delete_pages=self.mover.delete_pages,
                              poke=self.handovers.poke, settings=lambda: self.settings)
        if not offline:  # another proxy's claim notices (pushed through the store)
            self.store.watch(self.sync.claimed_elsewhere)
        self._runners(settings)
        self.warned: set[str] = set()  # one-time notices given: "no-slots", "no-marker", "page-save-path"
        self.auth = ServerAuth(self.client, settings.api_key, url, emit)  # the key the proxy's own calls carry
        self._started = False

    @classmethod
    def for_replay(cls, url: str, settings: Settings, emit: Emit) -> Upstream:
        """Saved flows (`mitmdump -nr`) get an offline upstream with a throw-away state dir: a replay never
        touches the network, the live state or any slot file."""
        quiet = replace(settings, checkpoints=CheckpointMode.OFF, paging=False, save_dir=None)
        up = cls(url, quiet, tempfile.mkdtemp(prefix="slotkeeper-replay-"), emit, offline=True)
        weakref.finalize(up, shutil.rmtree, up.state_dir, True)  # also when `done` never runs (a test, a crash)
        return up

    def _runners(self, s: Settings) -> None:
        """The mover's runners for these settings (`SlotMover.configure`); a replay has none."""
        if self.offline:
            return
        self.handovers.store = self.mover.store = self.store
        self.mover.state_dir = self.state_dir
        s = self.keeper.facts.served_with(s)  # restores that do not take: no slot files (until a restart)
        self.keeper.reconfigure(s)
        self.mover.configure(s, files_blocked=self.model.files_blocked)

    @property
    def pages(self) -> PageRunner | None:
        return self.mover.pages

    @property
    def checkpoints(self) -> CheckpointRunner | None:
        return self.mover.checkpoints

    def reconfigure(self, settings: Settings, state_dir: str | Path, store: StateStore | None = None,
                    builds: BuildClaims | None = None) -> None:
        """New settings replace the old whole; the sessions this process knows stay. A new `store` comes with
        its `builds` (None for a store of this machine's files)."""
        if self.offline:
            return
        if any(getattr(settings, n) != getattr(self.settings, n) for n in MODEL_INPUTS):
            self.model.forget()  # the verdict depends on them: check again at the next /props
            self.tasks.spawn(self.prober.probe())
        self.settings = settings
        self.prober.settings = settings
        self.keeper.reconfigure(settings)
        self.auth.configure(settings.api_key)
        if store is not None:
            self.state_dir = Path(state_dir)
            self.store = self.prober.store = self.sync.store = store
            self.mover.builds = builds
            store.watch(self.sync.claimed_elsewhere)
            if self.pages is not None:
                self.pages.shared = store.slot_locks
        elif Path(state_dir) != self.state_dir:
            self.state_dir = Path(state_dir)
            self.store = self.prober.store = self.sync.store = StateFile(self.state_dir, self.url, self.emit)
        self._runners(settings)

    # ------------------------------------------------------------------------------------------- requests

    async def decide(self, facts: RequestFacts, flow_id: str) -> Decision:
        """The decision for one request; a `NeedSlot` is placed here, so the result is never one."""
        if self.prober.hold.on:  # only in the first moments, on a server that may clear idle slots
            await self.prober.hold.wait()
        decision = self.request(facts)
        if isinstance(decision, NeedSlot):
            placed = await self.place(decision, facts, flow_id)
            assert placed is not None  # no `accept` to refuse it
            decision = placed
        return self.decided(decision)

    def request(self, facts: RequestFacts) -> Decision:
        """The core's answer from memory (a `NeedSlot` when it needs a slot placed: `place`, by this server or,
        in a pool, by the server the router chooses)."""
        self.prober.client_came = True
        decision = self.keeper.request(facts)
        if not isinstance(decision, NeedSlot) and self.keeper.table.has_touches():
            self.kick()
        return decision

    def decided(self, decision: Decision) -> Decision:
        """What a request's decision starts in the background on the server it goes to: the `/v1/messages`
        probe for a translated request, learning the server for a pending (affinity) one."""
        if isinstance(decision, Pin) and decision.ticket.translated and not self.offline:
            self.prober.probe_messages_once()
        if isinstance(decision, Pin) and decision.ticket.learn is not None and self.keeper.server is None:
            self.start()  # a pending request (affinity) asks nothing: learn the server in the background
        return decision

    def abandon(self, ticket: Ticket, flow_id: str) -> Ticket:
        """A decided request goes out unpinned after all: roll the core's bookkeeping back, free the slot lock;
        the ticket it goes out with."""
        out = self.keeper.abandon(ticket)
        self.mover.stopped(flow_id)
        return out

    async def place(self, need: NeedSlot, facts: RequestFacts, flow_id: str, *, asked: Facts | None = None,
                    accept: Accept | None = None) -> Pin | Observe | None:
        """A `NeedSlot` made by any keeper of a pool, placed on this server (`slotkeeper/drivers/pool.py`): `asked` are
        the `/props` and `/slots` the router already has; `accept` may refuse the server under its state lock
        (None: no claim was made, route again)."""
        by = None if self.offline else deadline(self.settings.wait_bound)  # its placement's waits included
        tries = Tries(arrived=time.monotonic())
        try:  # a session's second request at once waits for its first one's placement (drivers/placings.py)
            decision = await self.placings.one_at_a_time(
                need, lambda again: self.keeper.resume(again, facts.now),
                lambda n, waited: Placing(self, facts, flow_id, accept).run(n, None if waited else asked, by, tries))
        except BaseException:
            self.abandon(need.ticket, flow_id)
            raise
        self.kick()
        return decision

    def unlock(self, flow_id: str) -> None:
        """The flow's request reached the server (its response headers came), or never will: the next pager
        of its slot may go."""
        self.gate.started(flow_id)
        if self.pages is not None:
            self.pages.unlock(flow_id)

    def sent(self, flow_id: str, slot: int | None, session: str = "", chars: int = 0) -> None:
        """A request this proxy pinned to `slot` leaves for the server (hot path: a few dict writes): a page-out
        of that slot waits until the server has it (`PageRunner.quiet`), a request behind it until it ends."""
        if slot is not None:
            self.gate.sent(slot, flow_id, session)
            self.waits.entered(slot, flow_id, chars, session)

    def ended(self, flow_id: str) -> None:
        """The flow's answer ended, or it failed: a request held behind it looks again (`hold`)."""
        self.waits.left(flow_id)

    # ------------------------------------------------------------------------------------------- answers

    def answered(self, ticket: Ticket, obs: Observation, *, path: str, seconds: float) -> Report:
        report = self.keeper.outcomes.answered(ticket, obs, path=path, seconds=seconds, now=time.time(),
                                               ask=not self.offline and ticket.slot is not None)
        for event in self.keeper.outcomes.warnings(report):
            self.emit(event)
        if ticket.learn is not None:  # affinity: a learned slot is a new claim for the state file
            if ticket.learn is Learn.SLOTS and not self.offline and obs.error_type is None:
                self.tasks.spawn(_learn_from_slots(self, ticket, obs))
            self.kick()
        if ticket.unpinned in wait.UNPINNED and not self.offline and obs.error_type is None:
            self.tasks.spawn(self.waits.ran_unpinned(ticket, obs))
        if not self.offline and report.slot is not None and (not report.settled
                                                             or self.keeper.outcomes.lost_cache(report)):
            self.tasks.spawn(self.prober.explain(report))
        self._restore_answered(ticket, obs)
        check = self.keeper.pager.page_doubtful(report) if self.pages is not None else None
        page = self.keeper.pager.page_of(ticket.session.key)
        if check is not None and report.slot is not None and page is not None:
            self.emit(PageRejected(self.url, report.slot, check))
            self.tasks.spawn(drop_page(self.mover, ticket.session.key, page.file))
        return report

    def _restore_answered(self, ticket: Ticket, obs: Observation) -> None:
        """The answer of a request a restore was made for: whether the restore took (`slotlogic.restore_health`)."""
        if ticket.restore is not None and not self.offline:
            self._restore_events(self.keeper.facts.answer_after_restore(ticket, obs, self._reuse()))

    def _prefix_verified(self, slot: int, restored: int, cached: int) -> None:
        """A prefix restore's own verification showed whether it took."""
        self._restore_events(self.keeper.facts.restore_judged(slot, RestoreKind.PREFIX, restored, cached,
                                                              self._reuse()))

    def _restore_events(self, events: list[Event]) -> None:
        for event in events:
            self.emit(event)
            if isinstance(event, RestoresBroken):  # no paging, no prefix restores here until a restart
                self._runners(self.settings)

    def _event(self, event: Event) -> None:
        """An event out. A restarted server (seen by the prober or by a placement) may be another build or run
        with other flags: its restores are asked again (the core forgot the verdict), paging and prefix restores
        come back."""
        self._out(event)
        if isinstance(event, ServerRestarted):
            self._runners(self.settings)

    def _reuse(self) -> ReuseKind | None:
        facts = self.model.facts
        return facts.prefix_reuse().kind if facts is not None and facts.known else None

    def start(self) -> None:
        """At proxy start, before clients come (or at the first request): in the background, once, what can only
        be learned while the slots are empty (whether `/v1/messages` honours id_slot), then the server itself
        (`/props`, which starts the model check and its start-up probe). No request waits for it."""
        if self._started or self.offline:
            return
        self._started = True
        self.tasks.spawn(self.prober.start())

    def kick(self) -> None:
        """Make sure the background flusher/prober runs (no I/O here)."""
        if not self.offline:
            self.sync.kick(RECONCILE_EVERY, self.prober)
            self.handovers.start()

    # ------------------------------------------------------------------------------------------- commands

    async def status(self) -> dict[str, Any]:
        """The status view, from a fresh read of the state file (in a worker thread)."""
        return status_view(self.keeper, self.model, self._shown(), await self.store.aread())

    def status_now(self) -> dict[str, Any]:
        """The status view from memory (the state as of the last transaction): for sync callers."""
        return status_view(self.keeper, self.model, self._shown(), self.store.last)

    def _shown(self) -> Settings:
        """The settings as the status view shows them: the page budget in force (sized from the model, unless set)."""
        pages = self.mover.pages
        return self.settings if pages is None else replace(self.settings, page_max_bytes=pages.budget.bytes())

    async def settle(self) -> None:
        """Wait for the background work a command or an answer started (tests, shutdown)."""
        await self.tasks.settle()

    def close_sync(self) -> None:
        """At `done`: the last touches written; a replay's throw-away state removed."""
        if self.offline:
            shutil.rmtree(self.state_dir, ignore_errors=True)
            return
        self.sync.flush_sync()
        if self.pages is not None:
            self.pages.delete_doomed_now()
        self.sync.stop()
        self.tasks.cancel()
        self.handovers.stop()

    async def aclose(self) -> None:
        self.handovers.stop()
        await self.client.aclose()


async def _learn_from_slots(up: Upstream, ticket: Ticket, obs: Observation) -> None:
    """Affinity: the slot the server chose for a pending request, read from `/slots` after its answer."""
    if await up.prober.learn_slot(ticket, obs):
        up.kick()


def status_view(keeper: Keeper, model: ModelCheck, settings: Settings, state: shared.ServerState) -> dict[str, Any]:
    """The keeper's view and the model's, with what the slot page adds: the measured prefill speed (recent
    answers, else the start-up probe) and each session's page file on this server (any proxy's)."""
    pps = keeper.prefill_estimate()
    return {**keeper.status(state, time.time()), **model.status(settings),
            "prefill_tok_s": round(pps, 1) if pps else None,
            "restores": keeper.facts.restores_view(),
            "pages": {key[:8]: {"bytes": p.bytes, "tokens": p.n_tokens} for key, p in state.pages.items()}}
