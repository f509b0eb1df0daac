"""slotkeeper's core for one upstream server: a request's facts in, a typed decision out (h11 style).

Rule 1: pure. No sockets, files, clocks or mitmproxy: the driver (`slotkeeper/drivers/upstream.py`) passes the request's
        facts, the server's answers (`/props`, `/slots`) and the shared state in, and performs what comes out.
Rule 2: a known, live session is answered from memory (`request` returns `Pin`): no I/O, no lock, and, for an
        agent's next turn, not even a parse of the body (`slotlogic.fastpath`). That is the hot path.
Rule 3: everything else that needs the server or the shared state comes out as `NeedSlot`; the driver then
        calls, in this order: `assign` (under the state lock; claims a slot, returns a `Placement`),
        `page_plan` (under that slot's paging lock), `pin(placement)` (the rewrite). Or `fallback` when the
        server cannot be asked. The values are frozen; a call out of order raises `ProtocolError`.
Rule 4: the answer comes back through `outcomes.answered` (`slotlogic.outcomes`), which moves the slot
        bookkeeping on (whose conversation a slot holds now) and returns the `Report` every view is rendered from.
docs/design.md ("One request, stop by stop") follows a request through it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from slotlogic import (
    affinity,
    costs,
    handover,
    placement,
    rewrite,
    shared,
    sidecalls,
)
from slotlogic import lead as leads
from slotlogic.decisions import (
    TRANSLATED_PATH,
    Decision,
    Forward,
    NeedSlot,
    Observe,
    Pin,
    RequestFacts,
    Ticket,
)
from slotlogic.endpoints import Route, classify
from slotlogic.events import (
    Event,
    Unreachable,
)
from slotlogic.fastpath import Shape
from slotlogic.intake import Arrival, Intake, Recognition
from slotlogic.ledger import Fence, Ledger
from slotlogic.outcomes import Outcomes
from slotlogic.pager import Pager
from slotlogic.placements import OpenPlacements, ProtocolError
from slotlogic.ranking import Policy, SlotView
from slotlogic.reasons import Passed, Unpinned, Why
from slotlogic.restore_health import RestoreKind
from slotlogic.server import ServerInfo, slot_facts
from slotlogic.server_facts import ServerFacts
from slotlogic.settings import SESSION_KEEP_SECONDS, Settings
from slotlogic.table import SessionTable
from slotlogic.turns import Turns

Restore = tuple[RestoreKind, int] | None  # what a restore put in the slot for the request (`Ticket.restore`)


@dataclass(frozen=True)
class Placement:
    """A new or displaced session's slot, claimed in the shared state."""

    slot: int
    why: Why
    view: SlotView               # the slot as it was before this claim (its owner, its tokens, its prefix)
    dropped_pages: list[str]     # page files of sessions the state forgot (the driver deletes them)
    events: list[Event]
    views: tuple[SlotView, ...] = ()  # every slot as it was before this claim (where a seed may come from)
    fence: Fence | None = None        # the slot's epoch after this claim: the moves for it are fenced by it
    need: NeedSlot | None = None      # the request as placed (its prefix as learned by then): what `pin` takes
    serial: int = 0                   # this claim's number: only the newest claim of a session may be pinned

    @property
    def side(self) -> bool:
        return self.why is Why.SIDE_CALL


class Keeper:
    def __init__(self, settings: Settings, upstream: str = "", recognition: Recognition | None = None,
                 instance: str = "") -> None:
        self.settings = settings
        self.upstream = upstream
        self.ledger = Ledger()  # what each slot holds, fenced by its epoch; the loss meter (slotlogic/ledger.py)
        self._instance = instance  # unique to this process ("" offline), so its page file names are its own
        self._intake = Intake(settings, self.ledger, self, recognition)
        self.learner = self._intake.recognition.learner  # stable prefixes of marker-less clients (one per pool)
        self._table = SessionTable(ttl=settings.ttl, placements=self._intake.recognition.placements)
        self._facts = ServerFacts(settings, upstream, self._table, self.ledger)  # `/props` as last seen
        self._pager = Pager(settings, upstream, self._table, self.ledger, self.learner, self)
        self._turns = Turns(settings, upstream, self._table, self.ledger, self)
        self._outcomes = Outcomes(upstream, self._table, self.ledger, self)
        self._placements = OpenPlacements(self.ledger)  # assigned, not pinned yet (slotlogic/placements.py)

    # What the drivers and the core's parts may read (values; the core alone changes them).

    @property
    def table(self) -> SessionTable:
        return self._table

    @property
    def facts(self) -> ServerFacts:
        """The server as last seen; what a new `/props` means (`note_server`, `props_seen`, `messages_probed`)."""
        return self._facts

    @property
    def server(self) -> ServerInfo | None:
        return self._facts.server

    @property
    def total_slots(self) -> int | None:
        return self._facts.total_slots

    @property
    def messages_native(self) -> bool | None:
        return self._facts.messages_native

    @property
    def instance(self) -> str:
        return self._instance

    @property
    def outcomes(self) -> Outcomes:
        """What this server's answers taught: session counters, losses settled, the prefill rate, learned slots."""
        return self._outcomes

    @property
    def recognition(self) -> Recognition:
        """What recognises this server's sessions' next requests (shared by the servers of one pool)."""
        return self._intake.recognition

    @property
    def pager(self) -> Pager:
        """This server's pager: page-outs, page-ins and seeds around a slot's new owner (`slotlogic.pager`)."""
        return self._pager

    @property
    def turns(self) -> Turns:
        """Whether a planned move may happen now, and whose turn a slot shared with other proxies is."""
        return self._turns

    @property
    def page_identity(self) -> str:
        return self._facts.page_identity()

    def prefill_estimate(self) -> float | None:
        """Prompt tokens a second on this server: its recent answers', else the start-up probe's."""
        return self._outcomes.prefill_estimate()

    @property
    def speeds(self) -> costs.Speeds:
        """Slot save/restore throughput and KV bytes a token, measured (the drivers feed it every answer)."""
        return self._outcomes.speeds

    def rates(self) -> costs.Rates:
        """The measured speeds the cost of a slot move is weighed with (`slotlogic.costs`)."""
        return self._outcomes.rates()

    def reconfigure(self, settings: Settings) -> None:
        """A changed option: the new settings replace the old whole; what the proxy learned stays."""
        self.settings = settings
        self._pager.settings = settings
        self._turns.settings = settings
        self._facts.settings = settings
        self._intake.settings = settings
        self._table.ttl = settings.ttl
        self.learner.min_chars = settings.prefix_min_chars

    # ------------------------------------------------------------------------------------------- requests

    def request(self, facts: RequestFacts) -> Decision:
        route = classify(facts.method, facts.path)
        if route is Route.OTHER:
            return Forward(Passed.NOT_COMPLETION, completion_route=False)
        shape = self._intake.known(facts, route)  # the hot path: a known session's next turn, from its bytes
        passing = self._facts.passing()  # observed only, sent as they came
        if shape is not None:
            if passing is not None:
                self.ledger.marks.pop(shape.key.key, None)
                return Observe(_known_ticket(shape, unpinned=passing))
            placed = self._placed(shape.key.key, shape.side, facts.now)
            if placed is not None:  # its last parsed request is not its previous one any more (this one is not parsed)
                self.ledger.marks.pop(shape.key.key, None)
                return self._pin(shape, placed[1], {}, facts.content or b"", placed[0], facts.now)
        arrival = self._intake.read(facts, route)
        if not isinstance(arrival, Arrival):
            return arrival
        ticket, req = arrival.ticket, arrival.req
        if passing is not None:  # the client's own bytes go to its own route (an Anthropic request natively)
            return Observe(replace(ticket, unpinned=passing, translated=False), arrival.original)
        placed = self._placed(ticket.session.key, ticket.side, facts.now, req.body)
        if placed is not None:
            return self._pin(ticket, placed[1], req.body, req.content, placed[0], facts.now)
        if self.settings.policy is Policy.AFFINITY:
            return self._pending(ticket, req.body, req.content, TRANSLATED_PATH if ticket.translated else facts.path,
                                 facts.now)
        displaced = _displaced_from(self._table, self.total_slots, ticket, facts.now)
        ticket = replace(ticket, displaced=True) if displaced is not None else ticket
        return self._intake.need_slot(ticket, req, facts.now, displaced)

    def _placed(self, key: str, side: bool, now: float, body: dict[str, Any] | None = None
                ) -> tuple[int, Why] | None:
        """A side call, or a known session still on its slot: the slot and why, with no I/O. None: it needs a
        slot (a trusted client asking for another slot than its session's is placed there, under the state lock)."""
        total = self.total_slots
        if side and total:
            slots = sidecalls.side_slots(total, self.settings.side_slot)
            writes = self.ledger.writing.__contains__ if self._instance else bool  # no other proxy may write it
            slot = sidecalls.home_slot(slots, key, self.ledger, writes, self.settings.paging, self._pager.has(key))
            if slot is not None:
                return slot, Why.SIDE_CALL
            if slots:
                return None  # a placement is under way there, a conversation to page out first, or another writer
        live = self._table.live(key, now)
        if (live is not None and (total is None or live.slot < total) and not self._table.displaced(key, live.slot)
                and self.ledger.holds(live.slot, key)):
            client = rewrite.trusted_client_slot(body, total, self.settings.override_client) if body else None
            if client is not None and client != live.slot:
                return None
            return live.slot, Why.KNOWN
        return None

    def _pin(self, ticket: Ticket | Shape, why: Why | None, body: dict[str, Any], content: bytes, slot: int,
             now: float, **moved: Any) -> Pin:
        """The rewrite for `slot` and the pin's bookkeeping; one new ticket (a hot path `Shape`'s only one)."""
        total = self.total_slots or slot + 1
        result = rewrite.pin(body, slot, total, override_client=self.settings.override_client)
        key = ticket.key.key if isinstance(ticket, Shape) else ticket.session.key
        if result.client_slot_kept and result.slot != slot:
            why = Why.CLIENT_SLOT
            if not ticket.side:  # the claim follows the slot used (in memory; the next flush writes it)
                self._follow(key, result.slot, now)
        promise = self.ledger.pin(result.slot, key, side=why is Why.SIDE_CALL, paging=self.settings.paging)
        self._turns.pinned(result.slot)
        self._placements.drop(key)  # its placement's moves are done: the slot is its session's now
        self._table.dispatch(key, result.slot, holds=why is Why.SIDE_CALL)
        if ticket.side:
            self._table.side_call(now)
        if key in self._table.sessions:  # side calls on the reserved slot are not sessions
            self._table.use(key, now)
        pinned = (_known_ticket(ticket, slot=result.slot, why=why, promise=promise) if isinstance(ticket, Shape)
                  else replace(ticket, slot=result.slot, why=why, promise=promise, **moved))
        return _rewritten(pinned, content, body, result)

    def _pending(self, ticket: Ticket, body: dict[str, Any], content: bytes, path: str, now: float) -> Pin:
        """Affinity: `id_slot: -1`, llama-server chooses; `learn` pins the session where it ran (slotlogic/affinity)."""
        how = affinity.method(path, body)
        result = rewrite.pend(body, self.total_slots, verbose=how is affinity.Learn.VERBOSE,
                              override_client=self.settings.override_client)
        if result.client_slot_kept:
            ticket = replace(ticket, why=Why.CLIENT_SLOT, slot=result.slot,
                             promise=self.ledger.pin(result.slot, ticket.session.key))
            if not ticket.side:
                self._follow(ticket.session.key, result.slot, now)
                self._table.use(ticket.session.key, now)
            self._table.dispatch(ticket.session.key, result.slot)
        else:
            ticket = replace(ticket, why=Why.PENDING, learn=how, placed=self.ledger.sent_unpinned(),
                             client={**ticket.client, "verbose": body.get("verbose")})
        if ticket.side:
            self._table.side_call(now)
        return _rewritten(ticket, content, body, result)

    def _follow(self, key: str, slot: int, now: float) -> None:
        """A trusted client ran its session on `slot`: the session is recorded there (the slot's former holder
        is displaced, and the slot the proxy would have used is left alone)."""
        known = self._table.sessions.get(key)
        self._table.assign(key, slot, now, prefix=known.prefix if known else None,
                          requests=known.requests if known else 0)

    # ------------------------------------------------------------------------------------------- new slots

    def assign(self, need: NeedSlot, state: shared.ServerState, info: ServerInfo,
               live: Sequence[dict[str, Any]] | None, now: float, ahead: Mapping[int, Sequence[int]] | None = None,
               locked: Collection[int] = ()) -> Placement:
        """Claim a slot for `need` in `state` (the caller holds the state lock and writes it back; `ahead`: our
        requests' prompt chars open per slot; `locked`: slots other placements' moves hold, ranked busy). Placed
        again, only the new `Placement` may be pinned (not back on a slot it let go of while that is locked)."""
        if not isinstance(need, NeedSlot):
            raise ProtocolError(f"assign takes a NeedSlot, not {type(need).__name__}")
        events = self._facts.note_server(state, info, live, me=self._instance, now=now)
        self.learner.load(state.prefixes)
        if not need.ticket.side and need.displaced_from is None:
            found = self.learner.find(need.body, now)  # learned elsewhere, before a restart, or since it came
            if found is not None and (need.stable is None or len(found.text) > len(need.stable.text)):
                need = replace(need, stable=found, prefix=found.signature)
        shared.keep_learned(state, self.learner.records(), now, self.settings.checkpoint_ttl_days * 86400)
        total = info.total_slots
        self._placements.drop(need.ticket.session.key)
        pending = self.ledger.claimed_slots() | frozenset(locked)  # placements under way: busy, as they soon are
        before = shared.views(state, total, list(live) if live is not None else None, self._table, pending)
        ticket = replace(need.ticket, facts={"props": dict(info.raw or {}), "slots": slot_facts(live)})
        who = placement.Seeker(ticket.session.key, need.prefix, ticket.side, need.displaced_from,
                               resume=ticket.session.key not in self._table.misplaced,
                               client_slot=rewrite.trusted_client_slot(need.body, total, self.settings.override_client),
                               prefix_chars=len(need.stable.text) if need.stable is not None else 0)
        seen = placement.SlotsSeen(live, total, self._table, pending, self._facts.written_over, dict(ahead or {}),
                                   self.rates().decode_cost)
        choice = placement.assign(self.settings, state, who, seen, now)
        if choice.why is Why.RESUMED and self._facts.may_still_hold(choice.slot, ticket.session.key):
            self._facts.go_back(choice.slot)
        dropped = shared.compact(state, now, SESSION_KEEP_SECONDS, self.settings.state_max_sessions)
        self._pager.load(state.pages)
        if choice.why is not Why.SIDE_CALL:
            self._table.assign(ticket.session.key, choice.slot, now, prefix=need.prefix, lead=leads.of(need.body))
        record = state.slots.get(choice.slot)
        if record is not None and record.owner == ticket.session.key and self._instance:
            record = state.slots[choice.slot] = replace(record, proxy=self._instance)
        if self._instance:
            handover.beat(state.beats, self._instance, now)
            handover.prune(state.handovers, state.beats, now)
        serial = self._placements.open(ticket.session.key, choice.slot)
        fence = Fence(choice.slot, self.ledger.entry(choice.slot).epoch,
                      record.epoch if record is not None and record.owner == ticket.session.key else None,
                      self.ledger.outside(choice.slot))
        return Placement(choice.slot, choice.why, before[choice.slot], dropped, events, tuple(before), fence,
                         replace(need, ticket=ticket), serial)

    def fallback(self, need: NeedSlot, now: float, known: int | None, path: str = "") -> tuple[Pin | Observe, Event]:
        """The server did not answer `/props`: pin by a stable hash over the last known slot count (every proxy
        agrees without asking), or, with no count ever known, send it unpinned, asking where it ran (`unplaced`)."""
        if not isinstance(need, NeedSlot):
            raise ProtocolError(f"fallback takes a NeedSlot, not {type(need).__name__}")
        total = self.total_slots or known  # the last known count: a hash's modulus only, never the size of anything
        ticket = need.ticket
        self._placements.drop(ticket.session.key)
        choice = placement.fallback(ticket.session.key, total)
        if choice is None or total is None:
            out = unplaced(replace(ticket, unpinned=Unpinned.SERVER_UNKNOWN), need, path, self.settings.override_client)
            return out, Unreachable(self.upstream, ticket.session.short)
        self._table.assign(ticket.session.key, choice.slot, now, prefix=need.prefix)
        pin = self._pin(ticket, choice.why, need.body, need.content, choice.slot, now)
        return pin, Unreachable(self.upstream, ticket.session.short, choice.slot, total)

    def resume(self, need: NeedSlot, now: float) -> Pin | NeedSlot:
        """A `NeedSlot` that another keeper of the same pool made (several servers share one shape index):
        this keeper's answer from memory when the session is live here, else the `NeedSlot` for `assign`
        (when it was here but displaced, a new one that says from which slot)."""
        placed = self._placed(need.ticket.session.key, need.ticket.side, now, need.body)
        if placed is not None:
            return self._pin(need.ticket, placed[1], need.body, need.content, placed[0], now)
        live = self._table.live(need.ticket.session.key, now)
        if live is not None and need.displaced_from is None and (self.total_slots is None
                                                                   or live.slot < self.total_slots):
            return replace(need, ticket=replace(need.ticket, displaced=True), displaced_from=live.slot)
        return need

    def pin(self, placed: Placement, now: float, *, seeded: bool = False, restore: Restore = None) -> Pin:
        """The rewrite of a placed request, once its slot's moves are done: only the newest `Placement` of its
        session, once (a placement made again, pinned already, or abandoned raises)."""
        need = placed.need if isinstance(placed, Placement) else None
        if need is None:
            raise ProtocolError(f"pin takes a Placement from assign, not {type(placed).__name__}")
        self._placements.close(need.ticket.session.key, placed.serial)
        return self._pin(need.ticket, placed.why, need.body, need.content, placed.slot, now, seeded=seeded,
                         restore=restore, paged_in=restore is not None and restore[0] is RestoreKind.PAGE)

    # ------------------------------------------------------------------------------------------- answers

    def withdraw(self, key: str) -> None:
        """A placement waiting to be placed again (past its bound, every slot running our work) lets go of its
        slot meanwhile."""
        self._placements.drop(key)

    def abandon(self, ticket: Ticket) -> Ticket:
        """The request goes out unpinned after all (an error after its slot was chosen): nothing may still say
        it is pinned. The session is forgotten in memory, so its next request is placed again (its claim in
        the state file lets it resume the same slot when that is still right). Returns the ticket it goes with."""
        slot, key = ticket.slot, ticket.session.key
        self._placements.drop(key)
        if ticket.why is not Why.SIDE_CALL:
            self._table.forget(key)
        if slot is not None and self._table.dispatched.get(slot) in (key, ""):
            del self._table.dispatched[slot]
        return replace(ticket, slot=None, why=None, paged_in=False, seeded=False, unpinned=Unpinned.FAILED)

    def status(self, state: shared.ServerState, now: float) -> dict[str, Any]:
        return self._outcomes.status(state, now, self.server)  # the status view: hashes and counts only


def _displaced_from(table: SessionTable, total: int | None, ticket: Ticket, now: float) -> int | None:
    """The slot a session still live here was on: another session ran there since (else it would have been
    placed from memory), so staying has no value of its own; it chooses again, its own slot a candidate."""
    live = table.live(ticket.session.key, now)
    if live is not None and (total is None or live.slot < total):
        return live.slot
    return None


def unplaced(ticket: Ticket, need: NeedSlot, path: str, override_client: bool) -> Pin | Observe:
    """A request sent with `id_slot: -1` because the server cannot be asked asks its answer which slot ran it, as
    a pending one does (`slotlogic.affinity`): its session is then recorded there, so its next turn goes back to
    its conversation instead of being placed anew beside it (a slot the server gave it no longer looks free).
    Sent as it came (`Observe`) when its route names the slot only through `/slots`, which cannot be read now,
    when the client chose its own slot, or when it is translated. `path`: the client's."""
    how = affinity.method(path, need.body) if path and not ticket.translated else affinity.Learn.SLOTS
    result = rewrite.pend(need.body, None, verbose=how is affinity.Learn.VERBOSE, override_client=override_client)
    if how is affinity.Learn.SLOTS or result.client_slot_kept:
        return Observe(ticket)
    return _rewritten(replace(ticket, learn=how, client={**ticket.client, "verbose": need.body.get("verbose")}),
                      need.content, need.body, result)


def _known_ticket(shape: Shape, **fields: Any) -> Ticket:
    """The ticket of a chat request the fast path matched (no parse: the match proved both fields absent)."""
    return Ticket(shape.key, Route.PINNABLE, side=shape.side, client={"id_slot": None, "cache_prompt": None},
                  extends=True, **fields)


def _rewritten(ticket: Ticket, content: bytes, body: dict[str, Any], result: rewrite.Rewrite) -> Pin:
    """The client's bytes with the rewrite's two fields, spliced in place (never re-serialised)."""
    if not result.changed:
        return Pin(ticket, None)
    out = rewrite.splice(content, body, result) or rewrite.set_fields(content, result)
    if out is None:  # cannot happen for a body that parsed as an object; never re-serialise it
        raise ValueError("request body could not be rewritten in place")
    return Pin(ticket, out)
