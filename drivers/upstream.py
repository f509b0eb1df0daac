"""One llama-server behind the proxy: performs what its `slotlogic.keeper.Keeper` decides.

It owns the I/O the pure core must not do: `/props` and `/slots` look-ups for a new session, the locked
state-file transaction that claims a slot, session paging and prefix checkpoints through their runners, the
coalesced flush of `last_used` touches (at most one write per `flush_interval`), and a background `/props`
probe that notices a restarted server (new `media_marker`) or a resized pool (new `total_slots`). `/props`
never wakes a sleeping server; `/slots` is only asked when a new session needs a slot or a cache loss needs
explaining.

The order of one request that the core cannot answer from memory (`NeedSlot`):
1. wait while this session is being paged out (so it can be paged back in);
2. `/props` + `/slots` (or the facts recorded with a replayed flow); no answer: the hash fallback. An
   endpoint that hung is not asked again for `BACKOFF` seconds (the state file and the last answer decide);
3. under the state lock: `Keeper.assign` claims a slot;
4. under that slot's paging lock: `Keeper.page_plan`, the page recorded (`Keeper.page_intent`), then the
   page-out/page-in, then the outcome recorded;
5. the prefix checkpoint, when nothing was paged in;
6. `Keeper.pin`: the body that goes out.
Anything that fails after step 3 rolls the bookkeeping back (`Keeper.abandon`): the request goes out as the
client sent it and nothing says it was pinned.

The proxy's own calls carry llama-server's API key when it needs one: `slots_api_key`, else the
`Authorization` / `X-Api-Key` header a client sent to that server (kept in memory only, never logged).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from drivers.build_claims import BuildClaims
from drivers.checkpoint_runner import CheckpointRunner
from drivers.handovers import Handovers
from drivers.llama_http import LlamaClient
from drivers.model_check import ModelCheck
from drivers.page_runner import PageRunner
from drivers.slot_gate import SlotGate
from drivers.slot_moves import SlotMoves
from drivers.slot_wait import SlotWaits
from drivers.store import StateStore
from drivers.store_file import StateFile
from slotlogic import shared, wait
from slotlogic.affinity import Learn
from slotlogic.answers import Observation
from slotlogic.decisions import Decision, Fields, NeedSlot, Observe, Pin, Report, RequestFacts, Ticket
from slotlogic.events import (
    DisplacedElsewhere,
    Event,
    Failed,
    IdleSlotsCleared,
    MessagesProbed,
    ModelUnloaded,
    NoPrefixMarker,
    NoSlotsEndpoint,
    PageRejected,
    SlotShared,
    SlotsSlow,
    Stage,
    Via,
)
from slotlogic.intake import Recognition
from slotlogic.keeper import Keeper
from slotlogic.notices import ClaimNotice
from slotlogic.paging import Moved
from slotlogic.server import ServerInfo, probe_slot, slot_that_ran
from slotlogic.settings import AnthropicMode, CheckpointMode, Settings

Emit = Callable[[Event], None]
PROBE_TIMEOUT = 30.0
SLOW = 1.0          # seconds: a /props or /slots that failed after this long hung (the timeout is 3 s)
BACKOFF = 30.0      # seconds a hung endpoint is not asked by new sessions (the background probe may clear it)
RECONCILE_EVERY = 5.0  # seconds between looks for a slot shared with another process while idle
AUTH_HEADERS = (b"authorization", b"x-api-key")
Accept = Callable[[shared.ServerState, ServerInfo, list[dict[str, Any]] | None], bool]
Facts = tuple[dict[str, Any] | None, list[dict[str, Any]] | None]   # `/props` and `/slots` as asked


class Upstream(SlotMoves):
    def __init__(self, url: str, settings: Settings, state_dir: str | Path, emit: Emit, *,
                 offline: bool = False, client: LlamaClient | None = None, store: StateStore | None = None,
                 loaded: Callable[[], Any] | None = None, builds: BuildClaims | None = None,
                 recognition: Recognition | None = None) -> None:
        self.url = url
        self.offline = offline  # replaying saved flows: no network, no background task, no slot files
        self.emit = emit
        self.client = client or LlamaClient(url)
        # A pool's servers share one recognition; this process's page file names are its own.
        self.keeper = Keeper(settings, url, recognition, instance=os.urandom(8).hex())
        self.state_dir = Path(state_dir)
        self.store: StateStore = store if store is not None else StateFile(self.state_dir, url, emit)
        self.store.watch(self.claimed_elsewhere)
        self.builds = builds  # a shared store's build markers: one prefix build for all proxies (None: local)
        self.loaded = loaded  # llama-swap: whether the model is loaded (a probe must not load it)
        self.unloaded = False
        self.settings = settings
        self.pages: PageRunner | None = None
        self.checkpoints: CheckpointRunner | None = None
        self.gate = SlotGate(url, emit)  # which of our requests reached the server, slot by slot
        self.waits = SlotWaits()  # our requests open on each slot: a request behind them waits a bounded time
        self.handovers = Handovers(url, self.keeper, self.store, emit, self.gate)  # slots other proxies take
        self.model = ModelCheck(self.client, emit, url, on_speed=self.keeper.outcomes.probed)
        self._runners(settings)
        self.warned: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._side_tasks: set[asyncio.Task[None]] = set()
        self._last_probe = 0.0
        self._swept = False
        self._file_total: int | None = None
        self._file_total_read = False
        self._hung: dict[str, float] = {}          # endpoint -> monotonic time until which it is not asked
        self._last_live: list[dict[str, Any]] | None = None  # the last /slots answer (counts for a hung /slots)
        self._last_reconcile = 0.0
        self._client_auth: tuple[str, str] | None = None   # a client's own key for this server (memory only)
        self._authorize()
        self._started = False

    @classmethod
    def for_replay(cls, url: str, settings: Settings, emit: Emit) -> Upstream:
        """Saved flows (`mitmdump -nr`) get an offline upstream with a throw-away state dir: a replay never
        touches the network, the live state or any slot file."""
        quiet = replace(settings, checkpoints=CheckpointMode.OFF, paging=False, save_dir=None)
        return cls(url, quiet, tempfile.mkdtemp(prefix="slotkeeper-replay-"), emit, offline=True)

    def _runners(self, s: Settings) -> None:
        """Paging and checkpoint runners for these settings (a runner whose settings stay is kept: its slot
        locks may be held). Where the model check found that a restore cannot resume, no slot files: no
        paging, and prefix checkpoints only in memory."""
        if self.offline:
            return
        if self.model.files_blocked:
            s = replace(s, paging=False, checkpoints=CheckpointMode.MEMORY
                        if s.checkpoints is CheckpointMode.DISK else s.checkpoints)
        if s.paging and s.save_dir:
            if self.pages is None or self.pages.save_dir != Path(s.save_dir):
                self.pages = PageRunner(self.client, s.save_dir, s.page_max_bytes, self.emit, self.url)
                self.pages.gate = self.gate
            self.pages.max_bytes = s.page_max_bytes
            self.pages.shared = self.store.slot_locks
        else:
            self.pages = None
        self.handovers.store = self.store
        if s.checkpoints is CheckpointMode.OFF:
            self.checkpoints = None
        elif self.checkpoints is None or self.checkpoints.settings != s or self.checkpoints.index.dir != self.state_dir:
            self.checkpoints = CheckpointRunner(self.client, self.state_dir, s, self.emit, self.url)

    def _authorize(self) -> None:
        """The key the proxy's own calls carry: the option, else what a client sent (never logged or stored)."""
        key = self.settings.api_key
        self.client.auth = ("authorization", f"Bearer {key}") if key else self._client_auth

    def learn_auth(self, fields: Fields) -> None:
        """Remember the API key a client sends to this server, for the proxy's own calls (slow path only)."""
        if self.settings.api_key:
            return
        for k, v in fields:
            name = k.lower()
            if name in AUTH_HEADERS and v:
                found = (name.decode("latin-1"), v.decode("latin-1"))
                if found != self._client_auth:
                    self._client_auth = found
                    self._authorize()
                return

    def reconfigure(self, settings: Settings, state_dir: str | Path, store: StateStore | None = None,
                    builds: BuildClaims | None = None) -> None:
        """New settings replace the old whole; the sessions this process knows stay. A new `store` comes with
        its `builds` (None for a store of this machine's files)."""
        if self.offline:
            return
        model_inputs = ("swa_full", "cache_type_k", "cache_type_v", "paging", "checkpoints", "save_dir",
                        "throughput_probe")
        if any(getattr(settings, n) != getattr(self.settings, n) for n in model_inputs):
            self.model.forget()  # the verdict depends on them: check again at the next /props
            self._spawn(self.probe())
        self.settings = settings
        self.keeper.reconfigure(settings)
        self._authorize()
        if store is not None:
            self.state_dir = Path(state_dir)
            self.store = store
            self.builds = builds
            store.watch(self.claimed_elsewhere)
            if self.pages is not None:
                self.pages.shared = store.slot_locks
        elif Path(state_dir) != self.state_dir:
            self.state_dir = Path(state_dir)
            self.store = StateFile(self.state_dir, self.url, self.emit)
        self._runners(settings)

    # ------------------------------------------------------------------------------------------- requests

    async def decide(self, facts: RequestFacts, flow_id: str) -> Decision:
        """The decision for one request; a `NeedSlot` is resolved here, so the result is never one."""
        decision = self.keeper.request(facts)
        if isinstance(decision, NeedSlot):
            need = decision
            try:
                decision = await self._place(need, facts, flow_id)
            except BaseException:  # an error or a cancelled flow: the request is not going out pinned
                self.abandon(need.ticket, flow_id)
                raise
            self.kick()  # a new claim: the background pass will also look for a slot shared with another process
        elif self.keeper.table.dirty:
            self.kick()
        if isinstance(decision, Pin) and decision.ticket.translated:
            self._probe_messages_once()
        if isinstance(decision, Pin) and decision.ticket.learn is not None and self.keeper.server is None:
            self.start()  # a pending request (affinity) asks nothing: learn the server in the background
        return decision

    def abandon(self, ticket: Ticket, flow_id: str) -> None:
        """A decided request goes out unpinned after all: roll the core's bookkeeping back, free the slot lock."""
        self.keeper.abandon(ticket)
        self.gate.started(flow_id)
        if self.pages is not None:
            self.pages.unlock(flow_id, sent=False)

    async def place(self, need: NeedSlot, facts: RequestFacts, flow_id: str, *, asked: Facts | None = None,
                    accept: Accept | None = None) -> Pin | Observe | None:
        """A `NeedSlot` made by any keeper of a pool, placed on this server (`drivers/pool.py`): `asked` are
        the `/props` and `/slots` the router already has; `accept` may refuse the server under its state lock
        (None: no claim was made, route again)."""
        try:
            decision = await self._place(need, facts, flow_id, asked=asked, accept=accept)
        except BaseException:
            self.abandon(need.ticket, flow_id)
            raise
        self.kick()
        return decision

    async def ask(self) -> Facts:
        """`/props` and, when it answered, `/slots` (an endpoint that hung lately is not asked)."""
        props = await self._ask("/props", self.client.props)
        return props, (await self._live_slots() if props is not None else None)

    async def _place(self, need: NeedSlot, facts: RequestFacts, flow_id: str, *, asked: Facts | None = None,
                     accept: Accept | None = None, retries: int = 1) -> Any:
        key, now = need.ticket.session.key, facts.now
        if self.pages is not None:
            await self.pages.settled(key)  # its page-out is in flight: page it back in after
        if self.offline:
            recorded = (facts.replay.facts if facts.replay else None) or {}
            props = recorded.get("props") or {"total_slots": self.keeper.total_slots or 4}
            live = recorded.get("slots")
        else:
            self.learn_auth(facts.fields)
            props, live = asked if asked is not None else await self.ask()
        info = self._server_info(props)
        if info is not None:
            self._seen(info)
        if info is None:
            decision, event = self.keeper.fallback(need, now, await self._last_known_total())
            self.emit(event)
            return decision
        if live is None and not self.offline and "no-slots" not in self.warned:
            self.warned.add("no-slots")
            self.emit(NoSlotsEndpoint(self.url))
        async with self.store.transaction() as state:
            if accept is not None and not accept(state, info, live):
                return None
            placement = self.keeper.assign(need, state, info, live, now)
        for event in placement.events:
            self.emit(event)
        if self.pages is not None and placement.dropped_pages:
            self.pages.delete(placement.dropped_pages)
        # A side call on the slow path takes its turn too: a placement may be under way there (its session's
        # conversation is then paged out first, once its request reached the server).
        paged = self.pages is not None and not self.offline
        if not paged and not self.offline:  # no moves, but another proxy may write the slot: it is asked first
            state = await self.store.fresh()
            _, stale = await self._writer(placement.slot, key, placement.fence, state)
            if stale and retries > 0:
                return await self._place(need, facts, flow_id, asked=None, accept=accept, retries=retries - 1)
        if placement.side and paged:
            # The side slot may hold a session's conversation (placed there before side calls came): saved first,
            # so the session pages back in whole instead of finding a side call's prompt.
            await self._page(placement.slot, "", placement.view, flow_id, fence=placement.fence)
        if placement.side or self.offline:
            return self.keeper.pin(need, placement.slot, placement.why, now)
        moved = Moved.NOTHING
        fence = placement.fence
        holds = self.keeper.pager.holds_prefix(need, placement.view)
        if self.pages is not None:
            stable_chars = len(need.stable.text) if need.stable is not None and self.checkpoints is not None else 0
            cold = need.stable if not holds and await self._unbuilt(need, info) else None
            views = await self._await_source(placement.slot, key, placement.view, placement.views, stable_chars,
                                             cold)
            moved, fence = await self._page(placement.slot, key, placement.view, flow_id, views, stable_chars, cold,
                                            fence=fence)
        if moved is Moved.STALE and retries > 0:  # another claim of the slot came first: place it again
            self.gate.stopped(flow_id)
            if self.pages is not None:
                self.pages.unlock(flow_id, sent=False)
            return await self._place(need, facts, flow_id, asked=None, accept=accept, retries=retries - 1)
        if moved is Moved.STALE:  # twice: it goes where it was placed, with nothing moved (fail open)
            moved = Moved.NOTHING
        if self.checkpoints is not None and need.stable is not None and moved in (Moved.NOTHING, Moved.PREFIX):
            fence = await self._warm(placement.slot, need, info, holds and moved is Moved.NOTHING, fence=fence)
        elif self.checkpoints is not None and need.stable is None and "no-marker" not in self.warned:
            self.warned.add("no-marker")
            self.emit(NoPrefixMarker(self.url, need.ticket.session.short, self.settings.markers))
        if fence is not None and not self.keeper.turns.fence_holds(fence) and retries > 0:
            # Another placement claimed the slot while this one's moves ran: plan this request again.
            self.emit(self.keeper.turns.stale_plan(fence, "pin", key))
            self.gate.stopped(flow_id)
            if self.pages is not None:
                self.pages.unlock(flow_id, sent=False)
            return await self._place(need, facts, flow_id, asked=None, accept=accept, retries=retries - 1)
        return self.keeper.pin(need, placement.slot, placement.why, now, paged_in=moved is Moved.OWN,
                               seeded=moved in (Moved.SEED, Moved.PREFIX))

    async def _ask(self, endpoint: str, call: Callable[[], Any]) -> Any:
        """One look-up, unless the endpoint hung lately: then None at once (the caller falls back)."""
        now = time.monotonic()
        if self._hung.get(endpoint, 0.0) > now:
            return None
        answer = await call()
        if answer is None and time.monotonic() - now >= SLOW:
            self._hung[endpoint] = time.monotonic() + BACKOFF
            self.emit(SlotsSlow(self.url, endpoint, BACKOFF))
        elif answer is not None:
            self._hung.pop(endpoint, None)
        return answer

    async def _live_slots(self) -> list[dict[str, Any]] | None:
        """`/slots`, or while it hangs the last answer's token counts (nothing marked busy: that is unknown)."""
        live = await self._ask("/slots", self.client.slots)
        if live is not None:
            self._last_live = live
            return live
        if "/slots" in self._hung and self._last_live is not None:
            return [{**e, "is_processing": False} for e in self._last_live]
        return None

    def _server_info(self, props: Any) -> ServerInfo | None:
        """`/props` parsed, with the model file's size and mtime when it is on this machine (a page written
        for another file of the same name must not be restored)."""
        info = ServerInfo.parse(props)
        if info is None or not info.model_path:
            return info
        try:
            st = os.stat(info.model_path)
        except (OSError, ValueError):
            return info
        return replace(info, model_size=st.st_size, model_mtime=st.st_mtime)

    async def _last_known_total(self) -> int | None:
        """The slot count in the state file, for the hash fallback after a proxy restart (read once)."""
        if not self._file_total_read:
            self._file_total_read = True
            self._file_total = (await self.store.aread()).total_slots
        return self._file_total

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

    def must_wait(self, decision: Pin) -> bool:
        """Our earlier requests run on the request's slot, and another slot could run it (one dict look-up)."""
        t = decision.ticket
        slot = t.slot
        return (slot is not None and bool(self.waits.open.get(slot)) and not self.offline
                and self.waits.ahead(slot, session="" if t.side else t.session.key).count > 0
                and self.settings.wait_bound > 0 and (self.keeper.total_slots or 0) > 1)

    async def hold(self, decision: Pin, flow_id: str, content: bytes | None) -> Pin:
        """A request pinned to a slot where our earlier requests still run waits here rather than in the
        server's queue, at most `slots_wait_bound` seconds; then (or at once, for a side call behind longer
        work) it goes out with `id_slot: -1` (`slotlogic.wait`). A free slot costs one dict look-up."""
        t = decision.ticket
        if t.slot is None or not self.must_wait(decision):
            return decision
        raw = decision.body if decision.body is not None else content
        plan = await self.waits.hold(t.slot, flow_id, bound=self.settings.wait_bound, side=t.side,
                                     own_chars=len(raw or b""), rate=self.keeper.prefill_estimate,
                                     session="" if t.side else t.session.key)
        if plan.verdict is not wait.Verdict.UNPIN or not raw:
            return decision
        body = wait.unpinned_body(raw)
        if body is None:
            return decision
        holder = self.waits.holder(t.slot, flow_id)
        wait.unpin(t, plan.why or wait.WaitWhy.BOUND, holder, self.keeper.ledger, self.keeper.table)
        self.gate.started(flow_id)
        if self.pages is not None:
            self.pages.unlock(flow_id, sent=False)
        return Pin(t, body)

    def _probe_messages_once(self) -> None:
        if not self.offline and self.keeper.messages_native is None and "messages-probe" not in self.warned:
            self.warned.add("messages-probe")
            self._spawn(self.probe_messages())

    async def probe_messages(self) -> bool | None:
        """Whether the server honours `id_slot` on `/v1/messages` (upstream PR #26758): while every slot is
        empty (at start, after a restart), two one-token requests pinned to slot 0, and `/slots` says which slot
        ran each; a server that ignores the field puts them on its LRU choice, the highest empty slot. Unknown
        (slots in use, other traffic): tried again later; meanwhile requests are translated, which is always
        correct."""
        if self.settings.anthropic is not AnthropicMode.TRANSLATE:
            return None
        honoured: bool | None = None
        before = await self.client.slots()
        target = probe_slot(before) if before is not None else None
        if before is not None and target is not None:
            honoured = True
            body = {"max_tokens": 1, "messages": [{"role": "user", "content": "ok"}], "id_slot": target}
            for _ in range(2):
                status, _ = await self.client.post_json("/v1/messages", body, PROBE_TIMEOUT)
                after = await self.client.slots()
                ran = slot_that_ran(before, after) if status == 200 and after is not None else None
                if ran is None:
                    honoured = None
                    break
                if ran != target:
                    honoured = False
                    break
                before = after
        if honoured is None:
            self.warned.discard("messages-probe")
        else:
            self.keeper.messages_probed(honoured)
            self.emit(MessagesProbed(self.url, honoured))
        return honoured

    # ------------------------------------------------------------------------------------------- answers

    def answered(self, ticket: Ticket, obs: Observation, *, path: str, seconds: float) -> Report:
        report = self.keeper.outcomes.answered(ticket, obs, path=path, seconds=seconds, now=time.time())
        for event in self.keeper.outcomes.warnings(report):
            self.emit(event)
        if ticket.learn is not None:  # affinity: a learned slot is a new claim for the state file
            if ticket.learn is Learn.SLOTS and not self.offline and obs.error_type is None:
                self._spawn(self._learn_from_slots(ticket, obs))
            self.kick()
        if not self.offline and report.slot is not None and self.keeper.outcomes.lost_cache(report):
            self._spawn(self.explain_cache_loss(report.slot))
        check = self.keeper.pager.page_doubtful(report) if self.pages is not None else None
        page = self.keeper.pager.page_of(ticket.session.key)
        if check is not None and report.slot is not None and page is not None:
            self.emit(PageRejected(self.url, report.slot, check))
            self._spawn(self._drop_page(ticket.session.key, page.file))
        return report

    async def _drop_page(self, key: str, file: str) -> None:
        async with self.store.transaction() as state:
            doomed = self.keeper.pager.page_dropped(state, key, file)
        if self.pages is not None:
            self.pages.delete(doomed)

    async def _learn_from_slots(self, ticket: Ticket, obs: Observation) -> None:
        """Affinity on a route whose answer does not name the slot: read `/slots` once, right after it."""
        learned = self.keeper.outcomes.learn_from_slots(ticket, obs, await self.client.slots(), time.time())
        if learned is not None:
            self.emit(learned)
            self.kick()

    def _seen(self, info: ServerInfo) -> None:
        """A `/props` answer: a model file, or a server process, not checked yet gets the model check."""
        if not self.offline and self.model.due(info):
            self.model.claim(info)
            self._spawn(self.model.run(info, self.settings, lambda: self._runners(self.settings)))

    def start(self) -> None:
        """At proxy start, before clients come (or at the first request): in the background, once, what can only
        be learned while the slots are empty (whether `/v1/messages` honours id_slot), then the server itself
        (`/props`, which starts the model check and its start-up probe). No request waits for it."""
        if self._started or self.offline:
            return
        self._started = True
        self._spawn(self._start())

    async def _start(self) -> None:
        if self.keeper.messages_native is None and "messages-probe" not in self.warned:
            self.warned.add("messages-probe")
            await self.probe_messages()  # first: it needs every slot empty, the model probe takes one
        if self.keeper.server is None:
            await self.probe()

    async def explain_cache_loss(self, slot: int) -> None:
        """A known session's pinned slot came back cold: restart? idle clearing (unified KV)? say which."""
        before = self.keeper.server.media_marker if self.keeper.server else None
        await self.probe()
        if (self.keeper.server.media_marker if self.keeper.server else None) != before:
            return  # a restart explains it; already logged
        live = await self.client.slots()
        if live is None or "unified" in self.warned:
            return
        cleared = self.keeper.outcomes.idle_cleared(live, slot, time.time())
        if cleared is not None:
            self.warned.add("unified")
            self.emit(IdleSlotsCleared(self.url, cleared))

    # ------------------------------------------------------------------------------------------- background

    def kick(self) -> None:
        """Make sure the background flusher/prober runs (no I/O here)."""
        if self.offline:
            return
        if self._task is None or self._task.done():
            with contextlib.suppress(RuntimeError):
                self._task = asyncio.get_running_loop().create_task(self._background())
        self.handovers.start()

    def _spawn(self, coro: Any) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:
            coro.close()
            return
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    async def _background(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.settings.flush_interval)
                if not await self.flush() and time.monotonic() - self._last_reconcile >= RECONCILE_EVERY:
                    await self.reconcile()
                probe = self.settings.probe_interval
                if probe > 0 and time.monotonic() - self._last_probe >= probe:
                    await self.probe()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the background task must never die silently
            self.emit(Failed(self.url, Stage.BACKGROUND, type(e).__name__))

    async def flush(self) -> bool:
        """Write the coalesced touches (and look for a slot shared with another process in what was written);
        False when there was nothing to write."""
        touches = self.keeper.table.drain()
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
            self.keeper.table.dirty.update(touches)
            return True
        self._reconciled(state)
        return True

    async def reconcile(self) -> None:
        """With nothing to flush: read the state (no lock, a worker thread) and look for a shared slot."""
        if not self.keeper.table.sessions:
            return
        state = await self.store.aread()  # a worker thread for the file, one GET for Redis
        self.note_displaced(state)
        self._reconciled(state)

    def _reconciled(self, state: shared.ServerState) -> None:
        self._last_reconcile = time.monotonic()
        for key in self.keeper.turns.reconcile(state, time.time()):
            self.emit(SlotShared(self.url, key[:8], self.keeper.table.sessions[key].slot))

    def note_displaced(self, state: shared.ServerState) -> None:
        """Another proxy's session ran on a slot after our session's last request there (the shared state's
        newest claim is theirs): our session is displaced, and its next request is placed again (paged in
        when that proxy paged it out). Memory only; the hot path reads it."""
        if not self.store.remote:  # proxies on one machine: the file store's own reconcile covers them
            return
        table = self.keeper.table
        for slot, other in shared.displaced_by_others(state, table.sessions, table.holders).items():
            self.emit(DisplacedElsewhere(self.url, slot, table.holders[slot][:8], other[:8], Via.FLUSH))
            table.holders[slot] = other

    def claimed_elsewhere(self, notice: ClaimNotice) -> None:
        """Another proxy claimed a slot of this server (its notice, pushed through the store): the session of
        ours that believed it held the slot is displaced now, not at the next flush, so its next request is
        placed again (and paged in) instead of prefilling on a slot that holds another conversation. Memory
        only; the listener's task calls it, never a request."""
        if self.offline:
            return
        self.handovers.poke()  # a handover may be asked of us with it
        key = self.keeper.turns.claimed_elsewhere(notice.slot, notice.claimant, notice.at if notice.sent else None)
        if key is not None:
            self.emit(DisplacedElsewhere(self.url, notice.slot, key[:8], notice.claimant[:8], Via.NOTICE))

    def flush_sync(self) -> None:
        """The last flush at shutdown (`done` must stay sync)."""
        touches = self.keeper.table.drain()
        if not touches or self.offline:
            return
        try:
            with self.store.transaction_sync() as state:
                for key, a in touches.items():
                    shared.touch(state, key, a.slot, a.last_used, requests=a.requests, prefix=a.prefix)
        except Exception as e:
            self.emit(Failed(self.url, Stage.FINAL_FLUSH, type(e).__name__))

    async def probe(self) -> None:
        """`/props` only (never wakes a sleeping server): restart and resize detection. A model that
        llama-swap unloaded is not asked (asking would load it): its slots are empty, as after a restart."""
        self._last_probe = time.monotonic()
        if self.loaded is not None and await self.loaded() is False:
            if not self.unloaded:
                self.unloaded = True
                self.keeper.table.forget_all()
                self.emit(ModelUnloaded(self.url))
            return
        self.unloaded = False
        info = self._server_info(await self.client.props())
        if info is None:
            return
        self._hung.pop("/props", None)  # it answers again: new sessions may ask it
        self._seen(info)
        k = self.keeper
        known = k.server
        changed = known is None or (info.media_marker and known.media_marker
                                    and info.media_marker != known.media_marker) or (
            k.total_slots is not None and info.total_slots != k.total_slots)
        if changed:
            live = await self._live_slots()  # what ran on the new server before this look is kept
            async with self.store.transaction() as state:
                events = k.note_server(state, info, live)
            for event in events:
                self.emit(event)
            if k.messages_native is None:  # a restarted server may be another build; its slots are empty now
                self.warned.discard("messages-probe")
                self._probe_messages_once()
        else:
            k.server, k.total_slots = info, info.total_slots

    # ------------------------------------------------------------------------------------------- commands

    async def status(self) -> dict[str, Any]:
        """The status view, from a fresh read of the state file (in a worker thread)."""
        return {**self.keeper.status(await self.store.aread(), time.time()),
                **self.model.status(self.settings)}

    def status_now(self) -> dict[str, Any]:
        """The status view from memory (the state as of the last transaction): for sync callers."""
        return {**self.keeper.status(self.store.last, time.time()), **self.model.status(self.settings)}

    def release(self, wanted: str) -> list[str]:
        """Forget the sessions whose key starts with `wanted`: their slots are free for the next new session.
        This process forgets them at once; the state file follows in the background (never a blocking lock
        on the event loop)."""
        keys = shared.match_sessions(list({*self.store.last.sessions, *self.keeper.table.sessions}), wanted)
        if not keys:
            return []
        slots = {k: (self.keeper.table.sessions[k].slot if k in self.keeper.table.sessions
                     else self.store.last.sessions[k].slot) for k in keys}
        self.keeper.turns.forget(keys)
        self._spawn(self._release_in_file(keys))
        return [f"{k[:8]} (slot {slots[k]}) on {self.url}" for k in keys]

    async def _release_in_file(self, keys: list[str]) -> None:
        doomed = []
        async with self.store.transaction() as state:
            for key in keys:
                shared.forget_session(state, key)
                page = state.pages.pop(key, None)
                if page is not None:
                    doomed.append(page.file)
        if self.pages is not None:
            self.pages.delete(doomed)

    def move(self, wanted: str, slot: int) -> list[str]:
        """Move the sessions whose key starts with `wanted` to `slot` from their next request on (the state
        file follows in the background)."""
        keys = shared.match_sessions(list({*self.store.last.sessions, *self.keeper.table.sessions}), wanted)
        now = time.time()
        moved = {key: self.keeper.turns.move(key, slot, now) for key in keys}
        if moved:
            self._spawn(self._claim_in_file(moved, slot, now))
        return [f"{k[:8]} → slot {slot} on {self.url}" for k in keys]

    async def _claim_in_file(self, moved: dict[str, str | None], slot: int, now: float) -> None:
        async with self.store.transaction() as state:
            for key, prefix in moved.items():
                shared.claim(state, key, slot, now, prefix=prefix)

    async def settle(self) -> None:
        """Wait for the background work a command or an answer started (tests, shutdown)."""
        while self._side_tasks:
            await asyncio.gather(*list(self._side_tasks), return_exceptions=True)

    async def cleanup(self) -> list[str]:
        return await self.checkpoints.cleanup() if self.checkpoints is not None else []

    # ------------------------------------------------------------------------------------------- shutdown

    def close_sync(self) -> None:
        """At `done`: the last touches written; a replay's throw-away state removed."""
        if self.offline:
            shutil.rmtree(self.state_dir, ignore_errors=True)
            return
        self.flush_sync()
        if self.pages is not None:
            self.pages.delete_doomed_now()
        for task in (self._task, *self._side_tasks):
            if task is not None:
                task.cancel()
        self.handovers.stop()

    async def aclose(self) -> None:
        self.handovers.stop()
        await self.client.aclose()
