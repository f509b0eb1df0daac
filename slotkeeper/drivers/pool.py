"""Several llama-servers behind one proxy (`slots_upstreams`): which server each request goes to.

Each server keeps its own `Upstream`; the pool adds one shape index and prompt memory for all of them (a known
session stays a memory look-up), gathers each server's facts for `slotlogic.routing` to decide, re-chooses
when a free slot seen is gone by the claim (`full`), tracks health (`pool_health`), and treats each model
behind a llama-swap URL as a server of its own. docs/scale-out.md explains pools and llama-swap.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

from slotkeeper.drivers.checkpoint_runner import PrefixRegistry
from slotkeeper.drivers.llama_http import LlamaClient
from slotkeeper.drivers.origins import base_of
from slotkeeper.drivers.pool_health import Member, PoolHealth
from slotkeeper.drivers.swap_guard import SwapGuard
from slotkeeper.drivers.swappers import detect, model_url
from slotkeeper.drivers.upstream import Upstream
from slotlogic import json_scan, routing, shared, swap_models
from slotlogic.decisions import Decision, Forward, NeedSlot, Pin, RequestFacts
from slotlogic.events import Event
from slotlogic.intake import MAX_ITEMS, Recognition
from slotlogic.ranking import SlotView
from slotlogic.reasons import Passed
from slotlogic.routing import RouteWhy, ServerView
from slotlogic.server import ServerInfo

Emit = Callable[[Event], None]


class Pool:
    def __init__(self, urls: list[str], make_upstream: Callable[[str, Any], Upstream], emit: Emit,
                 make_client: Callable[[str], LlamaClient] = LlamaClient, health_interval: float = 5.0, *,
                 drop: Callable[[str], None] | None = None, max_models: int = swap_models.MAX_MODELS,
                 recognition: Recognition | None = None) -> None:
        self.members = [Member(base_of(u), i, make_client(base_of(u))) for i, u in enumerate(urls)]
        self.make_upstream = make_upstream
        self.drop = drop                # forgets a model's server outside the pool (its driver, its tasks)
        self.max_models = max_models    # model servers kept per llama-swap
        self.used: dict[str, float] = {}  # a llama-swap model's server URL -> when a request last went there
        self.emit = emit
        self.health = PoolHealth(self.members, emit, health_interval, every_pass=self.forget_idle)
        self.recognition = recognition or Recognition()  # its servers' keepers are made with the same one
        self.servers: dict[str, tuple[Member, str]] = {}   # server URL -> (member, model or "")
        self.where: dict[str, Upstream] = {}               # session key -> the server of its last request
        self.inflight: dict[str, int] = {}                 # server URL -> requests in flight
        self.routes: dict[tuple[str, str], int] = {}       # (server URL, RouteWhy value) -> count (metrics)
        # The servers of a pool share one save dir: a prefix checkpoint being built for one of them is waited for
        # and restored by the others, not built once per server (and, with a shared store, once for all proxies:
        # each server's `Upstream` claims the build, `slotkeeper.drivers.build_claims`).
        self.prefixes = PrefixRegistry()
        self.guard = SwapGuard(emit)  # a request that swaps a model out waits for that model's page-outs
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------------------------------- membership

    def fronts(self, base: str) -> bool:
        return any(m.url == base for m in self.members)

    def member_at(self, address: tuple[str, int]) -> Member | None:
        return next((m for m in self.members if m.address == tuple(address)), None)

    def upstream(self, member: Member, model: str = "") -> Upstream:
        url = self._url(member, model)
        up = self.make_upstream(url, self.guard.loaded(member, model) if member.swap and model
                                else None)  # what the probe asks first (`/props` loads the model)
        if url not in self.servers:
            self.servers[url] = (member, model if member.swap else "")
            if member.swap and model:
                self.used[url] = time.monotonic()  # new: not idle (a request is on its way)
            up.mover.share(self.prefixes)  # prefix builds and known prefixes: the pool's
            up.mover.join(lambda up=up: [u.mover for u in self.known() if u is not up])  # seeds across servers
        return up

    async def before_swap(self, up: Upstream) -> None:
        """A llama-swap model's request: the models it unloads are paged out first (`SwapGuard`)."""
        member, model = self.servers.get(up.url, (None, ""))
        await self.guard.before_request(member, model, self.servers, self.make_upstream)

    async def _detect(self, member: Member) -> None:
        await detect(member)

    async def _served(self, member: Member, model: str) -> Upstream | None:
        """The server of `model` on `member`: a plain llama-server serves any; llama-swap only a model it
        lists, and only while fewer than `max_models` of its models have a server (an idle one makes room).
        None: the request passes through unpinned."""
        if not member.swap:
            return self.upstream(member)
        now = time.monotonic()
        if swap_models.due(member.models, model, member.models_asked, now):
            member.models_asked = now
            found = swap_models.listed(await member.client.get_json("/v1/models"),
                                       await member.client.get_json("/running"))
            if found is not None:
                member.models = found
        if not swap_models.accepts(member.models, model):
            return None
        url = self._url(member, model)
        if url not in self.servers:
            mine = {u: self.used.get(u, now) for u, (m, name) in self.servers.items() if m is member and name}
            self._forget(swap_models.to_forget(mine, self.inflight, now, cap=self.max_models, room_for=1))
            if len(mine) - sum(u not in self.servers for u in mine) >= self.max_models:
                return None  # every kept model has a request in flight
        up = self.upstream(member, model)
        self._note_use(up)
        return up

    def _url(self, member: Member, model: str) -> str:
        return model_url(member, model)

    def _forget(self, urls: list[str]) -> None:
        """Forget llama-swap model servers (idle, or past the cap): the sessions they served are placed again
        at their next request (their claims stay in the state, so they resume their slots)."""
        for url in urls:
            self.servers.pop(url, None)
            self.used.pop(url, None)
            self.inflight.pop(url, None)
            self.where = {k: up for k, up in self.where.items() if up.url != url}
            if self.drop is not None:
                self.drop(url)

    def forget_idle(self, now: float) -> None:
        for member in self.members:
            if member.swap:
                mine = {u: self.used.get(u, now) for u, (m, name) in self.servers.items() if m is member and name}
                self._forget(swap_models.to_forget(mine, self.inflight, now, cap=self.max_models))

    def known(self) -> list[Upstream]:
        return [self.make_upstream(url, None) for url in self.servers]

    # The router interface the pinning addon uses (`slotkeeper.drivers.one_server.OneServer` has it too).
    retries = True   # a request that could not reach its server goes to another before anything was sent
    server = None    # no request's server is known before the pool decides

    def destination(self, up: Upstream) -> str:
        return self.member_of(up).url

    def member_of(self, up: Upstream) -> Member:
        return self.servers[up.url][0]

    def is_up(self, up: Upstream) -> bool:
        return self.member_of(up).health.up

    # ------------------------------------------------------------------------------------------- requests

    async def decide(self, facts: RequestFacts, flow_id: str, *, avoid: Member | None = None
                     ) -> tuple[Upstream, Decision]:
        """The server and decision for one request. `avoid`: a server this request could not reach."""
        self.health.kick()
        first = self._first(facts, avoid)
        if first is None:
            first = await self._first_slow(facts, avoid)
        if first is None:  # nothing is up: as with one server (the first may be back; else the fallback)
            home = self.members[0]
            up = await self._served(home, _model_of(facts.content) if home.swap else "")
            if up is None:
                return self.upstream(home), Forward(Passed.UNLISTED_MODEL, completion_route=True)
            self._note_use(up)
            await self.before_swap(up)
            return up, await up.decide(facts, flow_id)
        if isinstance(first, Forward):  # through the first server that is up, as the client sent it
            home = next((m for m in self.members if m.health.up and m is not avoid), self.members[0])
            return self.upstream(home), first
        self._note_use(first)  # not idle while its request is placed
        await self.before_swap(first)
        decision = first.request(facts)
        up = first
        if isinstance(decision, NeedSlot):
            up, decision = await self._route(decision, first, facts, flow_id, avoid)
            await self.before_swap(up)  # another server of the pool: its model may not be loaded
        up.decided(decision)
        ticket = getattr(decision, "ticket", None)
        if ticket is not None:
            self.where[ticket.session.key] = up
            self.inflight[up.url] = self.inflight.get(up.url, 0) + 1
        self._note_use(up)
        return up, decision

    def _note_use(self, up: Upstream) -> None:
        if self.servers.get(up.url, (None, ""))[1]:
            self.used[up.url] = time.monotonic()

    def ended(self, up: Upstream) -> None:
        self.ended_url(up.url)

    def ended_url(self, url: str) -> None:
        n = self.inflight.get(url, 0)
        if n > 0:
            self.inflight[url] = n - 1

    def _first(self, facts: RequestFacts, avoid: Member | None) -> Upstream | None:
        """The server a known session's next turn goes to, from memory (the hot path); None: look further."""
        shapes = self.recognition.shapes
        if facts.replay is not None or not facts.content or not shapes:
            return None
        shape = shapes.match(facts.path, facts.content)
        if shape is None:
            return None
        up = self.where.get(shape.key.key)
        if up is None or up.url not in self.servers or not self.is_up(up) or self.member_of(up) is avoid:
            return None
        if shape.side:  # nobody's conversation: the least loaded server of the same model takes it
            model = self.servers[up.url][1]
            return self._least_loaded([u for u in self.known() if self.servers[u.url][1] == model
                                       and self.is_up(u) and self.member_of(u) is not avoid]) or up
        return up

    async def _first_slow(self, facts: RequestFacts, avoid: Member | None) -> Upstream | Forward | None:
        """A request the shapes do not know: any up server of its model parses it (they share memory).
        Forward: no server serves its model (llama-swap does not list it, or all its servers are busy)."""
        up_members = [m for m in self.members if m.health.up and m is not avoid]
        if not up_members:
            return None
        for m in up_members:
            await self._detect(m)
        model = _model_of(facts.content) if any(m.swap for m in up_members) else ""
        cands = [up for m in up_members if (up := await self._served(m, model)) is not None]
        return self._least_loaded(cands) or Forward(Passed.UNLISTED_MODEL, completion_route=True)

    def _least_loaded(self, ups: list[Upstream]) -> Upstream | None:
        if not ups:
            return None
        return min(ups, key=lambda u: (self.inflight.get(u.url, 0), self.member_of(u).index))

    async def _route(self, need: NeedSlot, first: Upstream, facts: RequestFacts, flow_id: str,
                     avoid: Member | None) -> tuple[Upstream, Decision]:
        key, now = need.ticket.session.key, facts.now
        model = _model_of_body(need.body) if self.servers[first.url][1] or self.member_of(first).swap else ""
        cands = [up for m in self.members if m.health.up and m is not avoid
                 and (up := await self._served(m, model)) is not None]
        knows = [up.keeper.table.live(key, now) is not None for up in cands]
        back = routing.go_back(knows, next((i for i, up in enumerate(cands) if up is first), None),
                               first.keeper.table.live(key, now) is not None, self.is_up(first))
        if back is not None:
            if back.index is None:
                return first, await self._place(first, need, facts, flow_id, None, RouteWhy.HOME)
            up = cands[back.index]
            resumed = up.keeper.resume(need, now)
            if isinstance(resumed, Pin):
                self._count(up, RouteWhy.HOME)
                return up, resumed
            return up, await self._place(up, resumed, facts, flow_id, None, RouteWhy.HOME)
        previous = self.where.get(key)
        was_down = routing.failed_over(None if previous is None else self.is_up(previous),
                                       previous is not None and self.member_of(previous) is avoid)
        if was_down and previous is not None:
            previous.keeper.turns.forget([key])
        page = await self._page_elsewhere(key, previous) if was_down and previous is not None else None
        asked = await asyncio.gather(*(u.prober.ask() for u in cands))
        if page is None and not need.ticket.side:  # a page another server of the pool wrote: the save dir is one
            page = await self._page_anywhere(key, cands)
        views = []
        for i, (up, (props, live)) in enumerate(zip(cands, asked, strict=True)):
            info = ServerInfo.parse(props)
            views.append(await self._view(i, up, info, live, need, now) if info is not None
                         else ServerView(i, up=False))
        shown = list(views)
        for _ in range(len(cands)):
            choice = routing.choose(shown, side=need.ticket.side, was_down=was_down)
            if choice is None:
                break
            up = cands[choice.index]
            want_free = routing.wants_free(shown, views[choice.index], need.ticket.side)

            def accept(state: shared.ServerState, info: ServerInfo, live: list[dict[str, Any]] | None,
                       want_free: bool = want_free, up: Upstream = up) -> bool:
                if want_free and _slot_counts(up, state, info, live, now)[1][0] == 0:
                    return False
                if page is not None and key not in state.pages:
                    state.pages[key] = page  # the page file is readable here: the shared save dir
                return True

            decision = await up.place(need, facts, flow_id, asked=asked[choice.index], accept=accept)
            if decision is None:  # another proxy took the last free slot there since the look-up
                shown[choice.index] = routing.full(views[choice.index])
                continue
            self._count(up, choice.why)
            return up, decision
        up = first  # nothing answered: the server the request was parsed for, as with one server
        return up, await self._place(up, need, facts, flow_id, None, RouteWhy.ONLY)

    async def _place(self, up: Upstream, need: NeedSlot, facts: RequestFacts, flow_id: str, asked: Any,
                     why: RouteWhy) -> Decision:
        self._count(up, why)
        decision = await up.place(need, facts, flow_id, asked=asked)
        assert decision is not None
        return decision

    def count_retry(self, up: Upstream) -> None:
        self._count(up, RouteWhy.RETRY)

    def _count(self, up: Upstream, why: RouteWhy) -> None:
        k = (up.url, why.value)
        self.routes[k] = self.routes.get(k, 0) + 1

    async def _view(self, i: int, up: Upstream, info: ServerInfo, live: list[dict[str, Any]] | None,
                    need: NeedSlot, now: float) -> ServerView:
        state = await up.store.aread()
        ttl = up.settings.ttl
        views, (free, idle, busy) = _slot_counts(up, state, info, live, now)
        checkpoint = False
        if up.checkpoints is not None and need.stable is not None and up.checkpoints.persist:
            with contextlib.suppress(OSError, ValueError):
                name = up.checkpoints.name_of(up.checkpoints.fingerprint(need.stable, info))
                checkpoint = await asyncio.to_thread(up.checkpoints.file_known, name, info)
        source = routing.beyond(up.keeper.pager.seeds.share(need) if up.pages is not None else 0,
                                len(need.stable.text) if checkpoint and need.stable is not None else 0)
        return ServerView(i, total_slots=info.total_slots, free=free, idle=idle, busy=busy,
                          queued=max(0, self.inflight.get(up.url, 0) - busy),
                          same_prefix=routing.holds_prefix_free(views, need.prefix, now, ttl),
                          checkpoint=checkpoint, owned=shared.owned_slot(state, need.ticket.session.key) is not None,
                          kept=up.keeper.pager.keeps(state, need.ticket.session.key), source=source)

    async def _page_anywhere(self, key: str, cands: list[Upstream]) -> Any:
        """The session's restorable page on any server of the pool (their slot files share one save dir): the
        server it is placed on restores it when its own state has none, as a failover does."""
        for up in cands:
            rec = up.keeper.pager.page_of(key)
            if rec is not None and rec.n_tokens > 0:
                return rec
        return None

    async def _page_elsewhere(self, key: str, previous: Upstream) -> Any:
        """The page record of a session whose server is down (its state is still readable)."""
        with contextlib.suppress(Exception):
            state = await previous.store.aread()
            return state.pages.get(key) or previous.keeper.pager.page_of(key)
        return None

def _slot_counts(up: Upstream, state: shared.ServerState, info: ServerInfo, live: list[dict[str, Any]] | None,
                 now: float) -> tuple[list[SlotView], tuple[int, int, int]]:
    """One server's merged slot views and its (free, idle, busy) counts, its reserved side slots not free."""
    views = shared.views(state, info.total_slots, live, up.keeper.table)
    reserved = up.keeper.table.reserved_slots(info.total_slots, up.settings.side_slot, now)
    return views, routing.slot_counts(views, now, up.settings.ttl, exclude=reserved)


def _model_of_body(body: Any) -> str:
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else ""


def _model_of(content: bytes | None) -> str:
    """The body's `model`; "" for a body not parsed (not JSON, or too costly to parse: `intake.MAX_ITEMS`)."""
    if content and json_scan.containers_over(content, MAX_ITEMS):
        return ""
    try:
        return _model_of_body(json.loads(content or b""))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return ""
