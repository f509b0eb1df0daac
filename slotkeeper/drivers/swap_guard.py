"""Before a request that makes a model swapper unload a model: that model's conversations paged out first.

Why: llama-swap (one model of a swap group at a time) and llama-server's router mode (`--models-max`) unload a
model to load the one a request names, and every slot of the model unloaded goes with its process. What the
request unloads is decided by `slotlogic.swap_out` from the swapper's own answer (llama-swap's `/running`, the
router's `/models`); this part asks it, saves each slot worth a page through the model's own server (it is still
loaded: the request waits), records the pages as any page-out does, and marks the model unloaded so each of its
sessions is placed again, and paged back in, when it returns. Bounded: past `HOLD_SECONDS` the request goes and
the pages not written are labelled lost; any error lets it go at once (fail open).

Hot path: a request for a model this process last saw loaded costs nothing here (no network call, no lock); only
one for a model not loaded as far as it knows asks the swapper, and that request loads a model anyway.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from slotkeeper.drivers import swappers
from slotkeeper.drivers.page_runner import PageOutcome
from slotkeeper.drivers.pool_health import Member
from slotkeeper.drivers.slot_moves import REPLACED_GRACE
from slotkeeper.drivers.upstream import Upstream
from slotlogic import paging, swap_out
from slotlogic.events import Event, Failed, ModelUnloaded, Paged, Stage, SwapPagedOut
from slotlogic.paging import PagePlan
from slotlogic.swap_out import Held, SwapFacts

Emit = Callable[[Event], None]
OVER_BUDGET = "over the page budget, slots_page_max_mb"
QUIET = 5.0  # seconds the probe leaves a model alone after a request of ours swapped it out


@dataclass
class Swapper:
    """What one swapper is known to hold: the loaded models as last seen (None: not known), the models seen loaded
    together, the router's cap and its loaded models, least recently used first."""

    loaded: frozenset[str] | None = None
    together: frozenset[frozenset[str]] = frozenset()
    max_loaded: int | None = None
    recency: list[str] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def used(self, model: str) -> None:
        if model in self.recency:
            self.recency.remove(model)
        self.recency.append(model)
        del self.recency[:-swap_out.MAX_TOGETHER]

    def seen(self, held: Mapping[str, bool]) -> None:
        """What the swapper holds (model -> ready): models shown ready at once stay loaded together (one still
        starting while another stops is a swap under way, not a pair)."""
        loaded = frozenset(held)
        self.loaded = loaded
        self.together = swap_out.learn(self.together, [m for m, ready in held.items() if ready])
        self.recency = [m for m in self.recency if m in loaded] + sorted(loaded - set(self.recency))


class SwapGuard:
    def __init__(self, emit: Emit, hold: float = swap_out.HOLD_SECONDS) -> None:
        self.emit = emit
        self.hold = hold
        self.swappers: dict[str, Swapper] = {}  # swapper URL -> what it is known to hold

    def swapper(self, url: str) -> Swapper:
        return self.swappers.setdefault(url, Swapper())

    def loaded(self, member: Member, model: str) -> Callable[[], Awaitable[bool | None]]:
        """Whether `member` (a swapper) has `model` loaded and ready (None: it did not answer as it does), asked
        by the model's probe; what it shows loaded is kept for the next request's guard."""
        async def ready() -> bool | None:
            held = await swappers.loaded(member)
            if held is None:
                return None
            self.swapper(member.url).seen(held)
            return held.get(model, False)
        return ready

    async def before_request(self, member: Member | None, model: str, servers: Mapping[str, Any],
                             make: Callable[[str, Any], Upstream]) -> None:
        """`before`, for a request to `model` on a pool's `member` (nothing unless it is a swapper): each of its
        models the proxy has a server of (`servers`, by URL; `make` returns that server's driver) is paged out
        before the request unloads it."""
        if member is None or not member.swap or not model:
            return
        swapper = self.swapper(member.url)
        if swapper.loaded is not None and model in swapper.loaded:  # the hot path: a memory look-up
            swapper.used(model)
            return
        swapper.max_loaded = member.max_loaded if member.router else None

        async def running() -> Mapping[str, bool] | None:
            return await swappers.loaded(member)

        def server_of(name: str) -> Upstream | None:
            at = swappers.model_url(member, name)
            return make(at, None) if at in servers else None
        await self.before(swapper, model, running, server_of)

    async def before(self, swapper: Swapper, model: str, running: Callable[[], Awaitable[Mapping[str, bool] | None]],
                     server_of: Callable[[str], Upstream | None]) -> None:
        """Called before a request for `model` goes to the swapper: when it will unload models, their slots are
        paged out first (within the hold). `running`: the swapper's loaded models (-> ready), asked; `server_of`:
        the proxy's server of a model, if it has one. Never raises."""
        if not model or (swapper.loaded is not None and model in swapper.loaded):
            swapper.used(model)
            return
        try:
            async with swapper.lock:
                if swapper.loaded is not None and model in swapper.loaded:
                    return
                held = await running()
                if held is None:  # the swapper did not say: the request goes as it came
                    return
                swapper.seen(held)
                loaded = frozenset(held)
                facts = SwapFacts(model, loaded, swapper.max_loaded, tuple(swapper.recency), swapper.together)
                gone = swap_out.unloads(facts)
                deadline = time.monotonic() + self.hold
                for name in sorted(gone):
                    up = server_of(name)
                    if up is not None:
                        await self._leave(up, model, deadline)
                swapper.loaded = (loaded - gone) | {model}
        except Exception as e:
            swapper.loaded = None
            self.emit(Failed("", Stage.PAGING, type(e).__name__))
        finally:
            swapper.used(model)

    async def _leave(self, up: Upstream, model: str, deadline: float) -> None:
        """`up`'s model is about to be unloaded for `model`: its slots paged out, then it is marked unloaded."""
        started = time.monotonic()
        unload = up.prober.unload
        async with unload.props_lock:  # a probe's `/props` already sent reaches the swapper first
            unload.quiet(QUIET)
        try:
            await self._save_all(up, model, deadline, started)
        finally:
            unload.note(QUIET, swapped=True)  # after the saves: it resets what the slots hold

    async def _save_all(self, up: Upstream, model: str, deadline: float, started: float) -> None:
        keeper, pages = up.keeper, up.mover.pages
        ledger = keeper.ledger
        held = [Held(s, ledger.conversation_on(s), ledger.entry(s).tokens) for s in range(ledger.total)]
        state = await up.store.fresh() if pages is not None else None
        todo = swap_out.to_save(held, state.pages if state is not None else {}, keeper.page_identity)
        saved, tokens, why = 0, 0, ""
        if todo and pages is None:
            why = "no save dir" if not up.settings.save_dir else "paging off"
        for h in todo if pages is not None else ():
            left = deadline - time.monotonic()
            if left <= 0:
                why = "hold ran out"
                break
            task = asyncio.ensure_future(self._save(up, h))
            try:
                n = await asyncio.wait_for(asyncio.shield(task), left)
            except TimeoutError:  # it goes on and records itself; the request does not wait for it
                why = "hold ran out"
                break
            if isinstance(n, str):
                why = why or n
            else:
                saved, tokens = saved + 1, tokens + n
        seconds = time.monotonic() - started
        self.emit(SwapPagedOut(up.url, model, saved, len(todo) - saved, tokens, seconds,
                               why if len(todo) > saved else "") if todo else ModelUnloaded(up.url))

    async def _save(self, up: Upstream, h: Held) -> int | str:
        """One slot's conversation saved as its session's page (recorded before it is written, as any page-out):
        the tokens saved, or why not."""
        pages, pager, key = up.mover.pages, up.keeper.pager, h.session or ""
        assert pages is not None
        plan = PagePlan(h.slot, save_for=key, save_file=paging.page_file(up.url, key, secrets.token_hex(6)))
        # a save dir out of reach: one of the ring's names instead, held until the save is recorded
        plan, writing = pager.claim_names(plan, pages.budget.ring_size())
        if plan.save_file is None:
            return OVER_BUDGET
        saving = pages.save_starts(key)
        try:
            files, budget = await asyncio.to_thread(pages.files), pages.budget.bytes()
            async with up.store.transaction() as state:
                room, fits = pager.page_room(state, plan, time.time(), budget, files)
                if not fits:
                    pages.delete(room)
                    return OVER_BUDGET
                replaced = pager.page_intent(state, plan, time.time())
            pages.delete(room)
            pages.delete_later(replaced, REPLACED_GRACE)
            out = await _run_locked(pages, plan)
            await up.mover.record_pages(plan, out)
            self.emit(Paged(up.url, h.slot, key[:8], out.saved_tokens, None, None, out.seconds, out.server_ms))
            rec = pager.page_of(key)  # the budget may have dropped it as it was recorded
            if rec is not None and rec.file == plan.save_file and rec.n_tokens > 0:
                return rec.n_tokens
            return "save failed" if out.saved_tokens is None else OVER_BUDGET
        finally:
            pages.save_ends(key, saving)
            pager.names.write_done(writing)


async def _run_locked(pages: Any, plan: PagePlan) -> PageOutcome:
    """The save under the slot's paging lock, once every request sent there reached the server (a slot still
    running a request is saved by the server once that request ends)."""
    lock = pages.locks.setdefault(plan.slot, asyncio.Lock())
    async with lock:
        if not await pages.gate.quiet(plan.slot, warn=False):
            return PageOutcome()
        out: PageOutcome = await pages.run(plan)
        return out
