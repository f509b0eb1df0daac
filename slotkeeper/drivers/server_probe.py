"""What the proxy asks one server about itself, and when.

Why apart: the driver places requests; this part owns the look-ups and their state: `/props` and `/slots` for a
new session (an endpoint that hung is not asked again for `BACKOFF` seconds; while `/slots` hangs its last
answer's token counts stand in), the background `/props` probe that notices a restarted server or a resized pool
(and a llama-swap model that was unloaded: it is not asked, asking would load it), the one-time probe of whether
`/v1/messages` honours `id_slot`, and the look that explains why a known session's slot came back cold. What a
change means is the core's (`Keeper.props_seen`, `Keeper.note_server`).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from slotkeeper.drivers import cache_mode
from slotkeeper.drivers.llama_http import LlamaClient
from slotkeeper.drivers.model_check import ModelCheck
from slotkeeper.drivers.model_unload import ModelUnload
from slotkeeper.drivers.store import StateStore
from slotkeeper.drivers.tasks import Tasks
from slotlogic import shared, wait
from slotlogic.answers import Observation
from slotlogic.decisions import Report, Ticket
from slotlogic.events import (
    CacheModeFound,
    Event,
    Failed,
    IdleSlotsCleared,
    MessagesProbed,
    SlotsSlow,
    Stage,
)
from slotlogic.keeper import Keeper
from slotlogic.ledger import Cause, tolerance
from slotlogic.server import CacheMode, ServerInfo, may_clear_idle_slots, probe_slot, slot_that_ran
from slotlogic.settings import AnthropicMode, Settings

PROBE_TIMEOUT = 30.0
SLOW = 1.0          # seconds: a /props or /slots that failed after this long hung (the timeout is 3 s)
BACKOFF = 30.0      # seconds a hung endpoint is not asked by new sessions (the background probe may clear it)
ASK_AGAIN = 1.0     # seconds between look-ups of a patient `ask` (a server with no facts yet)
START_QUIET = 0.5   # seconds the start-up's /v1/messages probe leaves a client that starts with the proxy
Facts = tuple[dict[str, Any] | None, list[dict[str, Any]] | None]   # `/props` and `/slots` as asked


class ServerProbe:
    def __init__(self, url: str, client: LlamaClient, keeper: Keeper, emit: Callable[[Event], None],
                 model: ModelCheck, tasks: Tasks, *, loaded: Callable[[], Any] | None = None,
                 on_checked: Callable[[], None] = lambda: None) -> None:
        self.url = url
        self.client = client
        self.keeper = keeper
        self.emit = emit
        self.model = model
        self.tasks = tasks
        self.loaded = loaded  # llama-swap: whether the model is loaded (a probe must not load it)
        self.on_checked = on_checked  # the model check's verdict came: the driver's runners follow it
        self.settings: Settings = keeper.settings
        self.store: StateStore | None = None
        self.unload = ModelUnload(url, keeper, emit)  # a swapper's model: whether it is unloaded
        self.last_probe = 0.0
        self._hung: dict[str, float] = {}          # endpoint -> monotonic time until which it is not asked
        self._slow: dict[str, bool] = {}           # endpoint -> its last look-up hung (rather than was refused)
        self._last_live: list[dict[str, Any]] | None = None  # the last /slots answer (counts for a hung /slots)
        self._messages_probing = False   # the /v1/messages probe is running or has answered
        self.client_came = False  # a client's request reached this server (the start-up probe steps aside)
        self._unified_told = False       # idle-slot clearing explained once
        self._clearing_shared: str | None = None  # the server process whose idle clearing the state was told of
        self.hold = cache_mode.Hold()  # new requests wait for the start-up cache-mode probe
        self._starting = False  # `start` runs: it learns the server (a first `/props` meanwhile leaves it to it)
        self._mode_probing = False  # one cache-mode probe at a time

    async def facts_for(self, asked: Facts | None, arrived: float | None, bound: float
                        ) -> tuple[ServerInfo | None, dict[str, Any] | None, list[dict[str, Any]] | None]:
        """What a new placement decides with: the parsed `/props`, `/props` and `/slots` (`asked`: the router's,
        else asked now; `arrived`: when its request came, monotonic; `bound`: its wait bound). A `/props` that
        hangs leaves this process's last answer standing (a loaded server answers late; the hash fallback would
        pin outside the slots' plans); a restart or resize is the background probe's to notice. A server never
        heard from is asked again up to the hold's cap; one that refuses is down: the caller falls back at once."""
        known = self.keeper.server
        patient = None if known is not None else (arrived or time.monotonic()) + wait.hold_cap(bound)
        props, live = asked if asked is not None else await self.ask(patient)
        info = self.server_info(props)
        if info is None:
            return (known if asked is None and self._slow.get("/props") else None), props, live
        self.seen(info)
        return info, props, live

    async def ask(self, until: float | None = None) -> Facts:
        """`/props` and, when it answered, `/slots` (an endpoint that hung lately is not asked). `until`: a
        monotonic time up to which a `/props` that hangs is asked again, for a server this process has no facts
        of yet (without them a request cannot be placed through a slot's plan); one that refuses is not."""
        props = await self._ask("/props", self.client.props)
        while props is None and until is not None and self._slow.get("/props") and time.monotonic() < until:
            await asyncio.sleep(ASK_AGAIN)
            props = await self._ask("/props", self.client.props, again=True)
        return props, (await self.live_slots() if props is not None else None)

    async def _ask(self, endpoint: str, call: Callable[[], Any], *, again: bool = False) -> Any:
        """One look-up, unless the endpoint hung lately (and this is not a patient `ask`): then None at once
        (the caller falls back)."""
        now = time.monotonic()
        if self._hung.get(endpoint, 0.0) > now and not again:
            return None
        answer = await call()
        self._slow[endpoint] = answer is None and time.monotonic() - now >= SLOW
        if self._slow[endpoint] and self._hung.get(endpoint, 0.0) <= now:  # not told within this back-off
            self.emit(SlotsSlow(self.url, endpoint, BACKOFF))
        if self._slow[endpoint]:
            self._hung[endpoint] = time.monotonic() + BACKOFF
        elif answer is not None:
            self._hung.pop(endpoint, None)
        return answer

    async def live_slots(self) -> list[dict[str, Any]] | None:
        """`/slots`, or while it hangs the last answer's token counts (nothing marked busy: that is unknown)."""
        live = await self._ask("/slots", self.client.slots)
        if live is not None:
            self._last_live = live
            return live
        if "/slots" in self._hung and self._last_live is not None:
            return [{**e, "is_processing": False} for e in self._last_live]
        return None

    def server_info(self, props: Any) -> ServerInfo | None:
        """`/props` parsed, with the model file's size and mtime when it is on this machine (a page written
        for another file of the same name must not be restored)."""
        info = ServerInfo.parse(props)
        if info is None:
            return info
        info = self.keeper.facts.with_kv(info)  # the KV cache types: not in /props (slotlogic.kv_types)
        if not info.model_path:
            return info
        try:
            st = os.stat(info.model_path)
        except (OSError, ValueError):
            return info
        return replace(info, model_size=st.st_size, model_mtime=st.st_mtime)

    def seen(self, info: ServerInfo) -> None:
        """A `/props` answer: a model file, or a server process, not checked yet gets the model check."""
        if self.model.due(info):
            self.model.claim(info)
            self.tasks.spawn(self.model.run(info, self.settings, self.on_checked))

    async def probe(self) -> None:
        """`/props` only (never wakes a sleeping server): restart and resize detection. A model that
        llama-swap unloaded is not asked (asking would load it): its slots are empty, as after a restart."""
        self.last_probe = time.monotonic()
        # quiet: a request of ours swaps it out (or just did, maybe while the swapper was asked)
        if self.loaded is not None and (self.unload.quiet_now() or await self.loaded() is False
                                        or self.unload.quiet_now()):
            if not self.unload.quiet_now():
                self.unload.note()
            return
        self.unload.unloaded = False
        async with self.unload.props_lock:  # a swap's guard waits for a `/props` already sent
            info = None if self.unload.quiet_now() else self.server_info(await self.client.props())
        if info is None:
            return
        self._hung.pop("/props", None)  # it answers again: new sessions may ask it
        first = self.keeper.server is None
        if not self.keeper.facts.props_seen(info):
            self.seen(info)
            return
        live = await self.live_slots()  # what ran on the new server before this look is kept
        assert self.store is not None
        async with self.store.transaction() as state:
            events = self.keeper.facts.note_server(state, info, live, me=self.keeper.instance, now=time.time())
        for event in events:
            self.emit(event)
        self.seen(info)  # after the core noted the server: the model probe's fence is planned against its slots
        if first and self._starting:  # `start` learns the rest
            return
        if self.keeper.messages_native is None:  # a restarted server may be another build; its slots are empty
            self._messages_probing = False
        self.tasks.spawn(self._learn())

    def probe_messages_once(self, *, step_aside: bool = False) -> None:
        if self.keeper.messages_native is None and not self._messages_probing:
            self._messages_probing = True
            self.tasks.spawn(self.probe_messages(step_aside=step_aside))

    async def start(self) -> None:
        """`_learn` (the `/v1/messages` probe, which needs every slot empty, then the cache mode), then `/props`
        (the model check and its probe). A client's first request goes before them, except on a server that may
        clear idle slots (`server.may_clear_idle_slots`): there it is held until the mode is known."""
        self._starting = True
        try:
            info = self.server_info(await self.client.props()) if self.keeper.facts.mode_unknown() else None
            self.hold.on = info is not None and may_clear_idle_slots(info)
            await self._learn(quiet=START_QUIET if not self.hold.on else 0.0)
            self.hold.end()
            if self.keeper.server is None:
                await self.probe()
        finally:
            self._starting = False
            self.hold.end()

    async def _learn(self, quiet: float = 0.0) -> None:
        """A new server process (at start, after a restart): whether `/v1/messages` honours id_slot (while its
        slots are empty: first, after `quiet` s that leave a client starting with the proxy to go first), then its
        cache mode (whose probe writes empty slots)."""
        if self.keeper.messages_native is None and not self._messages_probing:
            self._messages_probing = True
            await asyncio.sleep(quiet)
            await self.probe_messages(step_aside=True)
        if self.keeper.facts.mode_unknown():
            await self.probe_cache_mode()

    async def probe_messages(self, *, step_aside: bool = False) -> bool | None:
        """Whether the server honours `id_slot` on `/v1/messages` (upstream PR #26758): while every slot is
        empty (at start, after a restart), two one-token requests pinned to slot 0, and `/slots` says which slot
        ran each; a server that ignores the field puts them on its LRU choice, the highest empty slot. Unknown
        (slots in use, other traffic): tried again later; meanwhile requests are translated, which is always
        correct. `step_aside`: not while a client's request has come (the start-up's)."""
        if self.settings.anthropic is not AnthropicMode.TRANSLATE:
            return None
        honoured: bool | None = None
        before = None if step_aside and self.client_came else await self.client.slots()
        target = probe_slot(before) if before is not None else None
        if before is not None and target is not None:
            honoured = True
            body = {"max_tokens": 1, "messages": [{"role": "user", "content": "ok"}], "id_slot": target}
            for _ in range(2):
                if step_aside and self.client_came:
                    honoured = None
                    break
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
            self._messages_probing = False
        else:
            self.keeper.facts.messages_probed(honoured)
            self.emit(MessagesProbed(self.url, honoured))
        return honoured

    async def probe_cache_mode(self, seen: str = "probe") -> CacheMode | None:
        """Whether the server clears idle slots (`slotkeeper.drivers.cache_mode`). Unknown: the proxy places
        requests as before, and a slot of ours found emptied later asks again (`_clearing_seen`)."""
        if self._mode_probing:
            return None
        self._mode_probing = True
        try:
            mode = await cache_mode.probe(self.client, self.keeper.turns, erase=bool(self.settings.save_dir))
        finally:
            self._mode_probing = False
        if mode is not None and self.keeper.facts.cache_mode_found(mode):
            self.emit(CacheModeFound(self.url, mode, seen))
        if mode is CacheMode.IDLE_CLEARED:
            await self._tell_clearing()
        return mode

    async def learn_slot(self, ticket: Ticket, obs: Observation) -> bool:
        """Affinity on a route whose answer does not name the slot: read `/slots` once, right after it. True
        when a slot was learned (a new claim for the state file)."""
        learned = self.keeper.outcomes.learn_from_slots(ticket, obs, await self.client.slots(), time.time())
        if learned is not None:
            self.emit(learned)
        return learned is not None

    async def explain(self, report: Report) -> None:
        """A request found less of its conversation in its slot than it had: ask the server why, and settle the
        loss with that cause (`Outcomes.settle_loss`; the loss meter's line goes out then). Always settled,
        `unknown` when nothing explains it or the asking failed."""
        found = None
        try:
            if report.slot is not None:
                cold = report.loss is not None and report.obs.cache_n is not None \
                    and report.obs.cache_n <= tolerance(report.loss.tokens)
                found = await self.explain_cache_loss(report.slot, cold=cold)
        finally:
            lost = self.keeper.outcomes.settle_loss(report, found)
            if lost is not None:
                self.emit(lost)

    async def explain_cache_loss(self, slot: int, *, cold: bool = True) -> Cause | None:
        """A known session's pinned slot came back cold: a restart? idle clearing (unified KV)? say which.
        `cold`: it found (next to) nothing there, as idle clearing leaves a slot."""
        before = self._marker()
        await self.probe()
        if self._marker() != before:
            return Cause.RESTART  # already logged
        live = await self.client.slots()
        if live is None:
            return None
        marker = self._marker()
        cleared, state = self.keeper.outcomes.idle_cleared(live, slot, time.time()), None
        if cleared is None and self.store is not None:
            # The evidence may be on slots only another proxy of this state uses, or that proxy may have seen it
            # already (it would call the same clearing `unknown`).
            # The state is read only when this process's own slots show nothing.
            state = await self.store.fresh()
            held = shared.held_slots(state, time.time(), self.settings.ttl)
            cleared = self.keeper.outcomes.idle_cleared(live, slot, time.time(), held - {slot})
        if cleared is None:
            return Cause.IDLE_CLEAR if state is not None and cold and shared.clears_idle_slots(state, marker) else None
        await self._clearing_seen(cleared)
        return Cause.IDLE_CLEAR

    async def explain_emptied(self, slot: int) -> Cause:
        """Our page-out found `slot` idle and empty where our session's conversation was (`Outcomes.found_empty`):
        the server restarted, or it empties idle slots (unified KV + `--cache-idle-slots`), as an idle slot
        found empty on `/slots` shows in `explain_cache_loss`."""
        before = self._marker()
        await self.probe()
        if self._marker() != before:
            return Cause.RESTART
        await self._clearing_seen(slot)
        return Cause.IDLE_CLEAR

    def _marker(self) -> str | None:
        return self.keeper.server.media_marker if self.keeper.server else None

    async def _clearing_seen(self, cleared: int) -> None:
        """This server seems to empty idle slots: said once, and confirmed by the probe before requests pass
        through (a failed restore also leaves a slot empty), which tells the other proxies of a shared state."""
        if not self._unified_told:
            self._unified_told = True
            self.emit(IdleSlotsCleared(self.url, cleared))
        if not self.keeper.facts.passes_through():
            self.tasks.spawn(self.probe_cache_mode(seen="loss"))

    async def _tell_clearing(self) -> None:
        """Idle clearing confirmed: the other proxies of a shared state pass through too (`StateSync`), and
        label their losses with it."""
        marker = self._marker()
        if self.store is not None and marker and marker != self._clearing_shared:
            self._clearing_shared = marker
            try:  # telling the other proxies is a courtesy: the cause found here stands either way
                async with self.store.transaction() as state:
                    shared.saw_idle_clearing(state, marker)
            except Exception as e:
                self.emit(Failed(self.url, Stage.STATE_WRITE, type(e).__name__))
