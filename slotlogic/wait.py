"""A request held in the proxy while our own earlier requests run on its slot: the facts the scheduler decides
it by, and the bookkeeping of what it decides.

Why hold at all: llama-server queues a request pinned to a busy slot until that slot is free, however long the
work ahead takes and however many other slots are idle, and a client gives up after its own timeout
(docs/clients.md). Held here, the request can still go elsewhere. What it does, and when, is one pick of
`slotlogic.scheduler` (`plan`); this module says which slots are free of promises (`free_slot`), which run
nothing of ours (`idle_set`), and writes a move or an unpinned send into the ledger and the table before the
request goes (`move`, `unpin`). Only our own open requests count as ahead: this path asks the server nothing.
The times: the bound counts from the request's arrival, its placement included; a placement whose slot's turn
has come while our earlier request still runs there keeps its turn while that request is expected to end
sooner than its own prompt would take elsewhere (`stay_past`); a placement past its bound with every slot
running our work waits for one that runs none (the driver places it again then), oldest first.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from enum import Enum

from slotlogic import rewrite, scheduler
from slotlogic.decisions import Observe, Ticket
from slotlogic.ledger import MAX_SLOTS, Holds, Ledger, put_back
from slotlogic.reasons import Unpinned, Why
from slotlogic.scheduler import Action
from slotlogic.table import SessionTable

CHARS_PER_TOKEN = 4  # a body's bytes per prompt token, roughly (JSON and English text)


UNPINNED = (Unpinned.WAIT_BOUND, Unpinned.SIDE_BUSY)  # the requests this module sent with id_slot -1


class Verdict(Enum):
    GO = "go"          # send it pinned now
    WAIT = "wait"      # hold it: the slot frees soon enough
    UNPIN = "unpin"    # send it with id_slot -1
    MOVE = "move"      # pin it to `Plan.slot`, a free slot, instead


class WaitWhy(Enum):
    """Why a pinned request went out with `id_slot: -1` after all (the `why=` word of its log line)."""

    BOUND = "wait-bound"     # it waited its bound behind our own requests on its slot
    SIDE_BUSY = "side-busy"  # a side call: the work ahead on its slot outlasts prefilling it elsewhere
    SLOT_BUSY = "slot-busy"  # a session's turn: another session's work on its slot outlasts its own prefill


@dataclass(frozen=True)
class Ahead:
    """Our requests open on one slot, sent before this one."""

    count: int = 0
    chars: int = 0          # their bodies' sizes (their prompt work, at most)


@dataclass(frozen=True)
class Plan:
    verdict: Verdict
    why: WaitWhy | None = None
    wait: float | None = None  # seconds the work ahead is estimated to take (None: no rate known)
    slot: int | None = None    # MOVE: the free slot it goes to
    until: float = 0.0         # WAIT: the waited seconds at which to decide again (a slot freeing comes first)
    pick: scheduler.Pick | None = None  # the scheduler's pick it comes from (the decision record)


def estimate(chars: int, rate: float | None) -> float | None:
    """Seconds to prefill `chars` of body at `rate` prompt tokens a second (None: no rate measured yet)."""
    return scheduler.seconds(chars, rate)


@dataclass(frozen=True)
class Elsewhere:
    """What the rest of the server offers a held request: `free`, a slot that could run it without writing over
    anyone's conversation (`free_slot`), if there is one; `idle`: some other slot runs nothing of ours and no
    placement is under way there, else `soonest`: our work on the other slot that frees first (characters);
    `exposed`: the promised tokens the server's own choice could write over."""

    free: int | None = None
    idle: bool = True
    exposed: int = 0
    soonest: int | None = None


def plan(ahead: Ahead, waited: float, bound: float, *, side: bool, own_chars: int, rate: float | None,
         where: Elsewhere = Elsewhere()) -> Plan:
    """What to do with a request pinned to a slot with `ahead` in front of it, after `waited` seconds: the
    scheduler's pick (`slotlogic.scheduler.decide_held`) as the hold's verdict."""
    free, idle, exposed, soonest = where.free, where.idle, where.exposed, where.soonest
    chosen = scheduler.decide_held(scheduler.Held(ahead.count, ahead.chars, waited, bound, own_chars, rate, free,
                                                  idle, exposed, soonest))
    c = chosen.chosen
    wait = estimate(ahead.chars, rate)
    if c.action is Action.HOLD:
        return Plan(Verdict.WAIT, None, wait, until=c.until, pick=chosen)
    if c.action is Action.MOVE_FREE:
        why = WaitWhy.BOUND if waited >= bound else WaitWhy.SIDE_BUSY if side else WaitWhy.SLOT_BUSY
        return Plan(Verdict.MOVE, why, wait, c.slot, pick=chosen)
    if c.action is Action.SERVER_CHOOSES:
        return Plan(Verdict.UNPIN, WaitWhy.BOUND, wait, pick=chosen)
    return Plan(Verdict.GO, None, wait, pick=chosen)


def hold_cap(bound: float) -> float:
    """The longest any request is held in the proxy: the client's patience (`scheduler.patience`)."""
    return scheduler.patience(bound)


def idle_slots(ledger: Ledger, total: int | None, avoid: int | None, busy: Collection[int], mine: str = "") -> int:
    """How many slots other than `avoid` run nothing of ours (`busy`: the slots with requests of ours open) and
    have no placement under way but `mine`'s (a held request's idle check). Unknown slot count: 1 (the server
    may well have one)."""
    return 1 if not total else len(idle_set(ledger, total, avoid, busy, mine))


def idle_set(ledger: Ledger, total: int | None, avoid: int | None, busy: Collection[int], mine: str = ""
             ) -> frozenset[int]:
    """The slots `idle_slots` counts (a waiting placement watches it grow); unknown slot count: none."""
    return frozenset(s for s in range(min(total or 0, MAX_SLOTS)) if s != avoid and s not in busy
                     and all(claimant == mine for claimant in ledger.claims_on(s)))


def queued_sooner(wait: float | None, own: float | None, waited: float) -> bool:
    """At the hold's cap with no slot idle: the work ahead on its own slot still to run is no longer
    than prefilling the request from nothing elsewhere would take. Unknown speeds: no."""
    return wait is not None and own is not None and max(0.0, wait - waited) <= own


def stay_past(ahead: Ahead, own_chars: int, rate: float | None, bound: float) -> float:
    """For a placement whose slot still runs our earlier request when its bound passes: the
    seconds past the bound it keeps its turn on the slot (its lock and claim), while that request is expected
    to end no later than the placement's own prompt would take to prefill elsewhere; 0: it goes at the bound.
    Letting go a moment before the request ahead ends hands the slot to whichever placement comes next, for as
    long as its moves and its turn take."""
    if ahead.count <= 0 or bound <= 0:
        return 0.0
    left, own = estimate(ahead.chars, rate), estimate(own_chars, rate)
    return scheduler.stay_limit(own, bound) - bound if stays_sooner(left, own, bound, bound) else 0.0


def stays_sooner(wait: float | None, own: float | None, waited: float, bound: float) -> bool:
    """Past its bound, a request stays while its own slot is expected to reach its first token no later than
    any other: the work ahead still to run (its estimate less the time waited; it started no later
    than this request arrived) is no longer than the request's own prefill. Unknown speeds: it goes."""
    return waited < scheduler.stay_limit(own or 0.0, bound) and queued_sooner(wait, own, waited)


_FREE_RANK = {Holds.EMPTY: 0, Holds.UNKNOWN: 2, Holds.PREFIX: 3, Holds.SEED: 3, Holds.SESSION: 4, Holds.PAGE: 4}


def free_slot(ledger: Ledger, table: SessionTable, total: int | None, avoid: int, busy: Collection[int], *,
              writable: Callable[[int], bool]) -> int | None:
    """A slot other than `avoid` that runs a request without writing over anything promised: the
    emptiest first (empty, never written, a prefix or a copy its session moved on from);
    None when there is none. A scan of the ledger's slots: a held request's path only."""
    free = free_slots(ledger, table, total, avoid, busy, writable=writable)
    return min(free, key=lambda s: (_FREE_RANK[ledger.entry(s).holds], s)) if free else None


def free_slots(ledger: Ledger, table: SessionTable, total: int | None, avoid: int, busy: Collection[int], *,
               writable: Callable[[int], bool]) -> frozenset[int]:
    """Every slot `free_slot` may choose from."""
    if not total or total < 2:
        return frozenset()
    homes = {a.slot for a in table.sessions.values()}
    out = set()
    for s in range(min(total, MAX_SLOTS)):
        if s == avoid or s in busy or ledger.claimed(s) or not writable(s) or ledger.conversation_on(s):
            continue
        if ledger.entry(s).holds is Holds.UNKNOWN and s in homes:
            continue  # never written in this ledger: the table's session may still be there
        out.add(s)
    return frozenset(out)


def body_with_slot(raw: bytes, slot: int = -1) -> bytes | None:
    """The pinned body with `id_slot: -1` (the server chooses the slot; or `slot`, a move), every other byte
    kept; None when it is not one JSON object (the caller then sends it pinned, as it was)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(body, dict):
        return None
    out = {"id_slot": slot, "cache_prompt": True if body.get("cache_prompt") is None else body["cache_prompt"]}
    return rewrite.set_fields(raw, rewrite.Rewrite(body=out, slot=slot, changed=True, client_slot_kept=False))


def unpin(ticket: Ticket, why: WaitWhy, holder: str | None, table: SessionTable, ledger: Ledger) -> Ticket:
    """The bookkeeping of a pinned request that goes out with `id_slot: -1` after all, and the ticket it goes
    with. The slot's last dispatch is its `holder`'s again (the request ahead, None unknown);
    the session stays where it was (its conversation is still on that slot), and its answer says where the
    server ran it."""
    _leave(ticket, holder, table, ledger)
    return replace(ticket, slot=None, why=None, paged_in=False, seeded=False, promise=None,
                   unpinned=Unpinned.WAIT_BOUND if why is WaitWhy.BOUND else Unpinned.SIDE_BUSY)


def past_bound(abandoned: Ticket) -> Observe:
    """A request whose placement waited out its bound before anything was moved for it, given up by
    `Keeper.abandon`: it goes as the client sent it (its own path and bytes, no slot), and its answer says
    which slot ran it (`ran`)."""
    return Observe(replace(abandoned, unpinned=Unpinned.WAIT_BOUND, translated=False))


def move(ticket: Ticket, slot: int, why: WaitWhy, holder: str | None, ledger: Ledger, table: SessionTable,
         now: float, *, paging: bool) -> Ticket:
    """The bookkeeping of a held request pinned to the free `slot` instead of its own (the scheduler's move), and
    the ticket it goes with: the slot it leaves is its holder's again, as for `unpin`; the ledger and the
    table say where it runs now, so nothing promised to anyone else is on `slot` and its session (not a side
    call) is at home there."""
    key, side = ticket.session.key, ticket.why is Why.SIDE_CALL
    _leave(ticket, holder, table, ledger)
    promise = ledger.pin(slot, key, side=side, paging=paging)
    table.dispatch(key, slot)
    known = table.sessions.get(key)
    if not side and known is not None:
        table.assign(key, slot, now, prefix=known.prefix, requests=known.requests)
    held = {WaitWhy.SIDE_BUSY: Why.SIDE_BUSY, WaitWhy.SLOT_BUSY: Why.SLOT_BUSY}.get(why, Why.WAIT_BOUND)
    return replace(ticket, slot=slot, promise=promise, why=held, paged_in=False, seeded=False, displaced=False)


def _leave(ticket: Ticket, holder: str | None, table: SessionTable, ledger: Ledger) -> None:
    """A held request leaves the slot it was pinned to: the slot's last dispatch, and what runs there, are its
    `holder`'s again (the request ahead, None unknown), and the slot's ledger entry what it was before the pin
    (`ledger.put_back`: the request wrote nothing there)."""
    slot, key = ticket.slot, ticket.session.key
    if slot is None:
        return
    put_back(ledger, ticket.promise, key)
    for marks, mine in ((table.dispatched, (key, "")), (table.running, (key,))):
        if marks.get(slot) in mine:
            if holder is None:
                del marks[slot]
            else:
                marks[slot] = holder


def ran(ledger: Ledger, slot: int, ticket: Ticket) -> None:
    """Where a request sent with `id_slot: -1` ran (read from `/slots` after its answer): that slot holds its
    prompt now, so what the slot's owner had there is a labelled eviction, not a surprise at its next turn."""
    if ledger.entry(slot).owner != ticket.session.key:
        ledger.ran_unpinned(slot, ticket.session.key, side=ticket.side)
