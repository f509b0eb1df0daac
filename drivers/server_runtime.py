"""The async driver for one upstream llama-server: performs what `slotlogic` decides.

It owns the I/O that the pure core must not do: `/props` and `/slots` look-ups for a new session, the
locked state-file transaction that claims a slot, the coalesced flush of `last_used` touches (at most one
write per `flush_interval`), and a background `/props` probe that notices a restarted server (new
`media_marker`) or a resized pool (new `total_slots`). `/props` never wakes a sleeping server; `/slots` is
only asked when a new session needs a slot or a cache loss needs explaining.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from drivers.checkpoints import CheckpointManager, CheckpointSettings
from drivers.llama_client import LlamaClient, server_identity
from drivers.pager import PageOutcome, Pager
from drivers.state_store import StateStore
from slotlogic import core, paging
from slotlogic import state as st
from slotlogic.fastpath import ShapeIndex
from slotlogic.observe import Observation
from slotlogic.ranking import Choice, SlotView
from slotlogic.session import PromptMark

log = logging.getLogger("slotkeeper")
MAX_MARKS = 512
FACT_KEYS = ("total_slots", "media_marker", "build_info", "model_path", "default_generation_settings")
SLOT_FACT_KEYS = ("id", "n_ctx", "is_processing", "n_prompt_tokens")
SESSION_KEEP_SECONDS = 7 * 24 * 3600


@dataclass
class SessionStats:
    requests: int = 0
    prefill: int = 0
    cached: int = 0
    saved_s: float = 0.0
    slot: int | None = None
    source: str = ""

    def add(self, obs: Observation) -> None:
        self.requests += 1
        if obs.prompt_n is not None:
            self.prefill += obs.prompt_n
        if obs.cache_n is not None:
            self.cached += obs.cache_n
            if obs.prompt_per_second:
                self.saved_s += obs.cache_n / obs.prompt_per_second

    @property
    def reuse(self) -> float | None:
        total = self.prefill + self.cached
        return self.cached / total if total else None


class ServerRuntime:
    def __init__(self, upstream: str, state_dir: str | Path, cfg: core.Config, *,
                 flush_interval: float = 2.0, probe_interval: float = 15.0) -> None:
        self.upstream = upstream
        self.paging_wanted = cfg.paging
        self.cfg = replace(cfg, paging=False)  # until enable_paging finds a save dir
        self.client = LlamaClient(upstream)
        self.store = StateStore(state_dir, upstream)
        self.table = st.SessionTable(ttl=cfg.ttl)
        self.flush_interval = flush_interval
        self.probe_interval = probe_interval
        self.total_slots: int | None = None
        self.media_marker: str | None = None
        self.n_ctx: int | None = None
        self.marks: OrderedDict[str, PromptMark] = OrderedDict()
        self.stats: dict[str, SessionStats] = {}
        self.warned: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._last_probe = 0.0
        self._probe_now = False
        self._seeded_from_file = False
        self.checkpoints: CheckpointManager | None = None
        self.pager: Pager | None = None
        self.pages: dict[str, paging.PageRecord] = {}  # the page index as of the last state transaction
        self.shapes = ShapeIndex()  # known sessions' request shapes: the hot path without a parse
        self._swept = False
        self.offline = False  # replaying saved flows: no network, no background task, no checkpoints
        self.log_event: Any = None  # callable(dict) for the JSONL log, set by the addon

    def enable_checkpoints(self, settings: CheckpointSettings | None, state_dir: str | Path) -> None:
        """Prefix checkpoints for this upstream (None or mode off: disabled)."""
        if settings is None or settings.mode == "off":
            self.checkpoints = None
        else:
            self.checkpoints = CheckpointManager(self.client, Path(state_dir), settings)

    def enable_paging(self, save_dir: str | None, max_mb: int) -> None:
        """Session paging through `save_dir` (llama-server's --slot-save-path); None: off."""
        if save_dir and self.paging_wanted and not self.offline:
            if self.pager is None or self.pager.save_dir != Path(save_dir):
                self.pager = Pager(self.client, save_dir, max_mb * 1024 * 1024)
            self.pager.max_bytes = max_mb * 1024 * 1024
        else:
            self.pager = None
        self.cfg = replace(self.cfg, paging=self.pager is not None)

    # --------------------------------------------------------------------------------------- configuration

    def reconfigure(self, cfg: core.Config, state_dir: str | Path) -> None:
        self.paging_wanted = cfg.paging
        self.cfg = replace(cfg, paging=cfg.paging and self.pager is not None)
        self.table.ttl = cfg.ttl
        if Path(state_dir) != self.store.dir:
            self.store = StateStore(state_dir, self.upstream)

    # --------------------------------------------------------------------------------------- hot path helpers

    def remember_prompt(self, key: str, mark: PromptMark | None) -> None:
        if mark is None:
            return
        self.marks[key] = mark
        self.marks.move_to_end(key)
        while len(self.marks) > MAX_MARKS:
            self.marks.popitem(last=False)

    def use(self, key: str, now: float) -> None:
        """Count one request of a pinned session; the touch is flushed later by the background task."""
        self.table.use(key, now)
        self.kick()

    def kick(self) -> None:
        """Make sure the background flusher/prober runs (no I/O here)."""
        if self.offline:
            return
        if self._task is None or self._task.done():
            with contextlib.suppress(RuntimeError):
                self._task = asyncio.get_running_loop().create_task(self._background())

    # --------------------------------------------------------------------------------------- new sessions

    async def identity(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]] | None]:
        props = await self.client.props()
        if props is None:
            return None, None
        return props, await self.client.slots()

    def _seed_total_from_file(self) -> None:
        """Last known slot count from the state file, for the hash fallback after a proxy restart."""
        if self.total_slots is None and not self._seeded_from_file:
            self._seeded_from_file = True
            self.total_slots = self.store.read().total_slots

    async def new_session(self, plan: core.Plan, now: float, facts: dict[str, Any] | None = None,
                          flow_id: str = "") -> tuple[Choice | None, dict[str, Any] | None]:
        """Choose and claim a slot for `plan.session`; also returns the server facts the choice used.

        Choice None: no slot count known at all (the request passes unpinned). Offline (replay of saved
        flows) the facts recorded with the flow stand in for `/props` and `/slots`."""
        assert plan.session is not None
        if self.pager is not None:
            await self.pager.settled(plan.session.key)  # its page-out is in flight: page it back in after
        if self.offline:
            props, live = (facts or {}).get("props"), (facts or {}).get("slots")
            if props is None:
                props = {"total_slots": self.total_slots or 4}
        else:
            props, live = await self.identity()
        if props is None:
            self._seed_total_from_file()
            choice = core.fallback(plan.session.key, self.total_slots)
            if choice is None:
                log.warning("slotkeeper: %s unreachable (/props) and no slot count known: request for "
                            "session %s passes unpinned", self.upstream, plan.session.short)
                return None, None
            log.warning("slotkeeper: %s /props unreachable: session %s pinned by hash fallback to slot %d "
                        "of %d (last known count)", self.upstream, plan.session.short, choice.slot,
                        self.total_slots)
            self.table.assign(plan.session.key, choice.slot, now, prefix=plan.prefix, reason=choice.reason)
            return choice, None
        facts = {"props": {k: props.get(k) for k in FACT_KEYS if k in props},
                 "slots": [{k: e.get(k) for k in SLOT_FACT_KEYS if k in e} for e in live] if live is not None
                 else None}
        marker, total, n_ctx = server_identity(props)
        if total is None:
            return None, None
        if live is None and "no-slots" not in self.warned:
            self.warned.add("no-slots")
            log.warning("slotkeeper: %s /slots unavailable (started with --no-slots?): choosing slots from "
                        "the state file alone, without cached-token counts", self.upstream)
        async with self.store.transaction() as state:
            self._apply_events(st.observe_server(state, marker, total, n_ctx))
            before = st.views(state, total, live, self.table)
            choice = core.assign(self.cfg, state, plan.session.key, plan.prefix, live, total, now,
                                 side=plan.side, local=self.table,
                                 displaced_from=plan.slot if plan.reason == "displaced" else None)
            dropped = st.prune(state, now, SESSION_KEEP_SECONDS)
            self.pages = dict(state.pages)
        if self.pager is not None and dropped:
            self.pager.delete(dropped)
        self.media_marker, self.total_slots, self.n_ctx = marker, total, n_ctx
        if choice.reason == "side-call":
            return choice, facts
        self.table.assign(plan.session.key, choice.slot, now, prefix=plan.prefix, reason=choice.reason)
        if self.offline:
            return choice, facts
        paged_in = False
        if self.pager is not None:
            paged_in = await self.page(choice.slot, plan.session.key, before[choice.slot], props, flow_id)
            if paged_in:
                choice = Choice(choice.slot, choice.reason + "+paged-in")
        if self.checkpoints is not None and plan.stable is not None and not paged_in:
            view = before[choice.slot]
            holds = view.prefix == plan.prefix and (view.n_tokens or 0) > 0
            await self.warm_slot(choice.slot, plan, props, holds)
        elif self.checkpoints is not None and "no-marker" not in self.warned:
            self.warned.add("no-marker")
            log.info("slotkeeper: prefix-cache: no stable-prefix marker in the system prompt of session %s "
                     "(markers: %s); no checkpoint for it", plan.session.short,
                     ", ".join(repr(m) for m in self.cfg.markers))
        return choice, facts

    def page_plan(self, slot: int, key: str, view: SlotView, model: str) -> paging.PagePlan:
        holder, tokens = paging.holder_of(slot, view, self.table.dispatched)
        rec = self.pages.get(key)
        holds_own = (slot not in self.table.dispatched and view.owner == key and rec is not None
                     and (view.n_tokens or 0) >= rec.n_tokens)  # a restarted proxy, its session still there
        return paging.plan(slot, key, holder, tokens, self.pages, self.upstream, model, holds_own=holds_own)

    async def page(self, slot: int, key: str, view: SlotView, props: dict[str, Any], flow_id: str) -> bool:
        """Page the slot's holder out and this session in (see drivers/pager.py for the lock); True when the
        session's conversation is back in the slot. What to do is decided once the lock is held: by then
        every request sent to the slot before is settled. Fails open: trouble only costs the prefill."""
        assert self.pager is not None
        model = paging.model_id(props)
        if self.page_plan(slot, key, view, model).empty and not self.pager.busy(slot):
            return False
        if not await self.pager.hold(slot, flow_id):
            return False
        page_plan = self.page_plan(slot, key, view, model)
        if page_plan.empty:
            return False  # nothing to move, but our request must still go after the page-in before it
        saving = None
        if page_plan.save_for is not None:
            saving = self.pager.saving[page_plan.save_for] = asyncio.Event()
        try:
            out = await self.pager.run(page_plan)
            await self._record_pages(page_plan, out, model)
        except Exception as e:
            log.warning("slotkeeper: paging on slot %d failed: %r; the request proceeds without it",
                        page_plan.slot, e)
            return False
        finally:
            if saving is not None:
                saving.set()
                if self.pager.saving.get(page_plan.save_for or "") is saving:
                    del self.pager.saving[page_plan.save_for or ""]
        if out.missing_save_path and "page-save-path" not in self.warned:
            self.warned.add("page-save-path")
            log.warning("slotkeeper: llama-server answered 501 to slot save/restore: start it with "
                        "--slot-save-path equal to slots_save_dir, or set slots_paging=false")
        if self.log_event is not None:
            self.log_event({"kind": "page", "upstream": self.upstream, "slot": page_plan.slot,
                            "out": page_plan.save_for[:8] if page_plan.save_for else None,
                            "out_tokens": out.saved_tokens,
                            "in": page_plan.restore_for[:8] if page_plan.restore_for else None,
                            "in_tokens": out.restored_tokens, "seconds": round(out.seconds, 4),
                            "server_ms": round(out.server_ms, 2)})
        return out.restored_tokens is not None

    async def _record_pages(self, page_plan: paging.PagePlan, out: PageOutcome, model: str) -> None:
        """The page index after a paging step, in the state file: the new page, a failed one dropped, the
        budget applied (and, once per process, orphaned page files swept); their files deleted."""
        assert self.pager is not None
        doomed: list[str] = []
        async with self.store.transaction() as state:
            if out.saved_tokens is not None and page_plan.save_for and page_plan.save_file:
                paging.saved(state.pages, page_plan.save_for, page_plan.save_file, out.saved_tokens,
                             out.saved_bytes, time.time(), model)
            if out.restore_failed and page_plan.restore_for:
                state.pages.pop(page_plan.restore_for, None)
            keep = frozenset(k for k in (page_plan.save_for, page_plan.restore_for) if k)
            doomed += [state.pages.pop(gone).file for gone in paging.over_budget(state.pages, self.pager.max_bytes,
                                                                                 keep=keep)]
            if not self._swept:
                self._swept = True
                doomed += paging.orphans(self.pager.files(), state.pages, time.time(), SESSION_KEEP_SECONDS)
            self.pages = dict(state.pages)
        self.pager.delete(doomed)

    def release_slot(self, flow_id: str) -> None:
        """The flow's request reached the server (or ended): the next pager of its slot may go."""
        if self.pager is not None:
            self.pager.release(flow_id)

    async def warm_slot(self, slot: int, plan: core.Plan, props: dict[str, Any], holds: bool) -> None:
        """Restore or warm the shared prefix into the new session's slot; fail open on anything."""
        assert self.checkpoints is not None and plan.stable is not None
        started = time.monotonic()
        try:
            orch = await self.checkpoints.prepare(slot, plan.stable, props, holds_prefix=holds)
        except Exception as e:
            log.warning("slotkeeper: prefix-cache failed for slot %d: %r; request proceeds without it", slot, e)
            return
        if self.log_event is not None:
            self.log_event({"kind": "checkpoint", "upstream": self.upstream, "slot": slot,
                            "outcome": orch.outcome, "prompt_n": orch.spent_prefill,
                            "identical": orch.identical, "divergent": orch.divergent,
                            "seconds": round(time.monotonic() - started, 4)})

    def _apply_events(self, events: list[str]) -> None:
        if "restart" in events:
            log.warning("slotkeeper: %s restarted (new media_marker): every slot is empty; sessions keep "
                        "their slots and prefill once", self.upstream)
            if self.checkpoints is not None or self.pager is not None:
                # Route every session through the slow path once, so its page or prefix is restored first.
                self.table.forget_all()
        if "resize" in events:
            log.warning("slotkeeper: %s slot pool resized to a new total_slots: re-pinning every session "
                        "into range", self.upstream)
            self.table.forget_all()

    # --------------------------------------------------------------------------------------- background

    async def _background(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.flush_interval)
                await self.flush()
                due = time.monotonic() - self._last_probe >= self.probe_interval
                if self.probe_interval > 0 and (due or self._probe_now):
                    await self.probe()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the background task must never die silently
            log.warning("slotkeeper: background task for %s failed: %r; it restarts on the next request",
                        self.upstream, e)

    async def flush(self) -> None:
        touches = self.table.drain()
        if not touches:
            return
        try:
            async with self.store.transaction() as state:
                for key, a in touches.items():
                    st.touch(state, key, a.slot, a.last_used, requests=a.requests, prefix=a.prefix)
        except Exception as e:
            log.warning("slotkeeper: could not write the state file %s: %r (touches kept for retry)",
                        self.store.path, e)
            self.table.dirty.update(touches)

    def flush_sync(self) -> None:
        touches = self.table.drain()
        if not touches:
            return
        try:
            with self.store.transaction_sync() as state:
                for key, a in touches.items():
                    st.touch(state, key, a.slot, a.last_used, requests=a.requests, prefix=a.prefix)
        except Exception as e:
            log.warning("slotkeeper: final state flush to %s failed: %r", self.store.path, e)

    async def probe(self) -> None:
        """`/props` only (never wakes a sleeping server): restart and resize detection."""
        self._last_probe = time.monotonic()
        self._probe_now = False
        props = await self.client.props()
        if props is None:
            return
        marker, total, n_ctx = server_identity(props)
        changed = (marker and self.media_marker and marker != self.media_marker) or (
            total and self.total_slots and total != self.total_slots)
        if changed or self.media_marker is None:
            async with self.store.transaction() as state:
                self._apply_events(st.observe_server(state, marker, total, n_ctx))
        self.media_marker = marker or self.media_marker
        self.total_slots = total or self.total_slots
        self.n_ctx = n_ctx or self.n_ctx

    def request_probe(self) -> None:
        self._probe_now = True
        self.kick()

    async def explain_cache_loss(self, slot: int) -> None:
        """A known session's pinned slot came back cold: restart? idle clearing (unified KV)? say which."""
        old_marker = self.media_marker
        await self.probe()
        if self.media_marker != old_marker:
            return  # a restart explains it; already logged
        live = await self.client.slots()
        if live is None or "unified" in self.warned:
            return
        now = time.time()
        for entry in live:
            sid = entry.get("id")
            if sid == slot or entry.get("is_processing") or not isinstance(sid, int):
                continue
            holders = [k for k, a in self.table.sessions.items()
                       if a.slot == sid and a.requests > 0 and now - a.last_used < self.cfg.ttl]
            if holders and entry.get("n_prompt_tokens") == 0:
                self.warned.add("unified")
                log.warning(
                    "slotkeeper: %s empties idle slots (slot %d was used by a live session and now holds 0 "
                    "tokens): the server runs with unified KV and --cache-idle-slots (the default when -np "
                    "is not given), which defeats pinning. Start llama-server with an explicit -np N "
                    "(without -kvu) or with --no-cache-idle-slots.", self.upstream, sid)
                return

    # --------------------------------------------------------------------------------------- stats

    def record(self, key: str, source: str, slot: int | None, obs: Observation) -> SessionStats:
        self.table.answered(key, slot, time.time())
        s = self.stats.setdefault(key, SessionStats())
        s.add(obs)
        s.slot = slot if slot is not None else s.slot
        s.source = source
        return s

    def status(self) -> dict[str, Any]:
        state = self.store.read()
        now = time.time()
        slots = []
        for sid in range(self.total_slots or state.total_slots or 0):
            rec = state.slots.get(sid)
            slots.append({"id": sid, "session": rec.owner[:8] if rec and rec.owner else None,
                          "last_used_s_ago": round(now - rec.last_used, 1) if rec else None,
                          "claimed": bool(rec and now - rec.last_used < self.cfg.ttl)})
        return {
            "upstream": self.upstream,
            "media_marker": self.media_marker,
            "total_slots": self.total_slots,
            "n_ctx_per_slot": self.n_ctx,
            "state_file": str(self.store.path),
            "slots": slots,
            "sessions": {k[:8]: {"slot": s.slot, "requests": s.requests, "prefill_tokens": s.prefill,
                                 "cached_tokens": s.cached,
                                 "reuse_pct": round(100 * s.reuse, 1) if s.reuse is not None else None,
                                 "saved_s": round(s.saved_s, 2), "source": s.source}
                         for k, s in self.stats.items()},
        }

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, RuntimeError):
                await self._task
        await self.flush()
        await self.client.aclose()
