"""How long a pinned request may wait for its slot while our own earlier requests run there, and what then.

Why: llama-server queues a request pinned to a busy slot (`id_slot`) until that slot is free, however long
the work ahead of it takes and however many other slots are idle. A client gives up after its own timeout
(docs/clients.md: Qwen Code after 120 s, the others after 300-600 s) and the request fails, where without the
proxy (`id_slot: -1`) it would have run on the first free slot. So the proxy holds such a request itself,
where it can still change its mind, instead of handing it to the server's queue.

Rule 1: pure; the waited time and the measured prefill rate are passed in.
Rule 2: only our own open requests on the slot count as ahead (what `/slots` says is not asked on this
        path: no I/O). A slot with nothing of ours ahead is sent to at once (GO).
Rule 3: a request that has waited `bound` seconds goes elsewhere (`wait-bound`): pinned to a free slot when
        one is (MOVE, below), else with `id_slot: -1` (UNPIN): the server runs it on the first slot that frees.
        Unless staying is sooner (`stays_sooner`): prefills on one server share its compute, so a prompt
        started elsewhere now reaches its first token after about `own + min(left, own)` seconds, where
        staying takes at most `left + own` (`left`: the work ahead still to run). While `left <= own` the
        request stays, until `bound + min(own, 2 * bound)` at most (then going at the bound would have been
        sooner whatever the estimate said). Two memory calls of one Qwen Code home at once: the second went
        out at its bound beside the first and both prefilled 6,300 tokens (bench mix-4), where waiting would
        have found 5,700 of them in the home's slot. The hold stays well under every client's timeout.
Rule 4: a request goes elsewhere at once when the prompt work ahead of it on its slot (another session's:
        its own session's requests never count) would take longer than prefilling its own prompt from nothing,
        and a free slot is there to run it (MOVE): a side call (`side-busy`), or a session's turn whose own
        slot runs another session's longer work (`slot-busy`: its cache there saves less time than the queue
        costs; the lowest expected time to first token, as for a new session's placement). Without a free
        slot it waits (sent with `id_slot: -1` it would land on whichever idle slot the server picks, over a
        conversation this proxy still promises to its owner). Otherwise a session's turn waits up to the
        bound (its cache is there).
Rule 5: `bound` 0 turns the hold off (the request goes to the server's queue, as before).
Rule 6: a free slot (`free_slot`) is one the ledger says holds nobody's current conversation, with nothing of
        ours running and no placement, hand-over or other writer on it: a request moved there overwrites only
        what nobody is promised. Every move is the core's, written in the ledger before it is sent.
Rule 7: the bound counts from the request's arrival in the proxy, its placement included: a placement (a new
        session's, a displaced one's, a side call's) whose slot's paging lock, earlier requests or seed source
        are not free within the bound moves nothing and the request goes as the client sent it (`past_bound`).
        A placement whose turn has come but whose slot still runs our earlier request keeps its turn past the
        bound while Rule 3 says staying is sooner (`stay_past`).
Rule 8: `id_slot: -1` only when it can run sooner. Past its bound, while every slot runs or awaits a request
        of ours (or a placement), a request sent with `id_slot: -1` would queue in the server behind the same
        work and then run wherever llama-server's own choice puts it, over a conversation promised to someone
        (bench mix-4: seven placements went out so at 30 s, then queued 150 s more in the server; the two
        memory calls of one Qwen Code home prefilled 6,335 tokens each on slots llama-server chose). So it is
        held on and decided again each time one of our requests ends: its own slot free (GO), a free slot
        (MOVE), or some slot with nothing of ours (`id_slot: -1`, it runs now). A placement past its bound is
        placed again the same way, once a slot runs nothing of ours (`slotkeeper/drivers/upstream.py`). Never
        held past `HOLD_CAP` bounds in all (Rule 9 says how it goes then).
Rule 9: at `HOLD_CAP` bounds with every slot still running or awaiting our work, the request waits in the
        server's queue whichever way it goes. Pinned to its own slot it starts once the work ahead there ends
        and finds its cache; with `id_slot: -1` it starts on the first slot that frees and prefills from
        nothing, over a conversation promised to someone. So it goes pinned (GO) while the work ahead still to
        run is no longer than its own prefill (as Rule 3 weighs it), else with `id_slot: -1`. bench mix-4 (stop
        36): three Claude Code turns and an OpenCode turn held to the cap went unpinned and prefilled 2,275-3,199
        tokens each that their own slots still held. A placement at the cap (with session paging) is placed
        again for one more cap, its moves waiting for the slot the ranking finds soonest to be idle (no slot
        action is sent to a running slot), and its page comes back in; only past that it goes with
        `id_slot: -1` (`slotkeeper/drivers/upstream.py`, `_late`; mix-4 run L: five turns sent unpinned at the
        cap prefilled 24,692 tokens that pages or slots of theirs held).
Rule 10: a placement's slot is a forecast, and a slot it did not expect may free first. A placement waiting for
        its slot (its paging lock, or its slot still running, within its bound) is placed again when another
        slot frees that was not free when its wait began (`idle_set` grows), and the placement held longest
        goes first: while it is placed again it is the oldest, and a younger one's turn waits. A placement past
        its bound (Rule 8) is placed again under the same order. It moves only once it has waited as long as
        prefilling its own prompt would take: until then what its slot holds or will hold for it may be worth the
        wait (bench subagents seed 9: moved at once, a subagent warmed 393 tokens of its family's prefix up cold,
        1.07x its limit against 1.01-1.02x). Only a slot this proxy writes counts as freed
        (or, for Rule 8, idle): one another live proxy writes runs requests this proxy does not see. (bench
        mix-4 runs M-T: for 41-94 s of each run a slot was idle while a request of ours waited for another;
        stock: 12-16 s.)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from enum import Enum

from slotlogic import rewrite, scheduler
from slotlogic.decisions import Observe, Ticket
from slotlogic.ledger import MAX_SLOTS, Holds, Ledger
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


def plan(ahead: Ahead, waited: float, bound: float, *, side: bool, own_chars: int, rate: float | None,
         free: int | None = None, idle: bool = True, exposed: int = 0, soonest: int | None = None) -> Plan:
    """What to do with a request pinned to a slot with `ahead` in front of it, after `waited` seconds: the
    scheduler's pick (`slotlogic.scheduler.decide_held`) as the hold's verdict. `free` is a slot that could run
    it without writing over anyone's conversation (`free_slot`), if there is one; `idle`: some other slot runs
    nothing of ours and no placement is under way there (`idle_elsewhere`), else `soonest`: our work on the
    other slot that frees first; `exposed`: the promised tokens the server's own choice could write over."""
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
    have no placement under way but `mine`'s (Rule 8). Unknown slot count: 1 (the server may well have one)."""
    return 1 if not total else len(idle_set(ledger, total, avoid, busy, mine))


def idle_set(ledger: Ledger, total: int | None, avoid: int | None, busy: Collection[int], mine: str = ""
             ) -> frozenset[int]:
    """The slots `idle_slots` counts (Rule 10 watches it grow); unknown slot count: none."""
    return frozenset(s for s in range(min(total or 0, MAX_SLOTS)) if s != avoid and s not in busy
                     and all(claimant == mine for claimant in ledger.claims_on(s)))


def queued_sooner(wait: float | None, own: float | None, waited: float) -> bool:
    """At the hold's cap with no slot idle (Rule 9): the work ahead on its own slot still to run is no longer
    than prefilling the request from nothing elsewhere would take. Unknown speeds: no."""
    return wait is not None and own is not None and max(0.0, wait - waited) <= own


def stay_past(ahead: Ahead, own_chars: int, rate: float | None, bound: float) -> float:
    """Rule 3 for a placement (Rule 7) whose slot still runs our earlier request when its bound passes: the
    seconds past the bound it keeps its turn on the slot (its lock and claim), while that request is expected
    to end no later than the placement's own prompt would take to prefill elsewhere; 0: it goes at the bound.
    (bench mix-4 run N: an OpenCode title call let go of its home's slot 0.6 s before the title call ahead of it
    ended; a placement that came later took the slot for 70 s, and OpenCode gave up on the call.)"""
    if ahead.count <= 0 or bound <= 0:
        return 0.0
    left, own = estimate(ahead.chars, rate), estimate(own_chars, rate)
    return scheduler.stay_limit(own, bound) - bound if stays_sooner(left, own, bound, bound) else 0.0


def stays_sooner(wait: float | None, own: float | None, waited: float, bound: float) -> bool:
    """Past its bound, a request stays while its own slot is expected to reach its first token no later than
    any other (Rule 3): the work ahead still to run (its estimate less the time waited; it started no later
    than this request arrived) is no longer than the request's own prefill. Unknown speeds: it goes."""
    return waited < scheduler.stay_limit(own or 0.0, bound) and queued_sooner(wait, own, waited)


_FREE_RANK = {Holds.EMPTY: 0, Holds.UNKNOWN: 2, Holds.PREFIX: 3, Holds.SEED: 3, Holds.SESSION: 4, Holds.PAGE: 4}


def free_slot(ledger: Ledger, table: SessionTable, total: int | None, avoid: int, busy: Collection[int], *,
              writable: Callable[[int], bool]) -> int | None:
    """A slot other than `avoid` that runs a request without writing over anything promised (Rule 6): the
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


def unpin(ticket: Ticket, why: WaitWhy, holder: str | None, table: SessionTable) -> Ticket:
    """The bookkeeping of a pinned request that goes out with `id_slot: -1` after all, and the ticket it goes
    with. The slot's last dispatch is its `holder`'s again (the request ahead, None unknown);
    the session stays where it was (its conversation is still on that slot), and its answer says where the
    server ran it."""
    _leave(ticket, holder, table)
    return replace(ticket, slot=None, why=None, paged_in=False, seeded=False, promise=None,
                   unpinned=Unpinned.WAIT_BOUND if why is WaitWhy.BOUND else Unpinned.SIDE_BUSY)


def past_bound(abandoned: Ticket) -> Observe:
    """A request whose placement waited out its bound before anything was moved for it (Rule 7), given up by
    `Keeper.abandon`: it goes as the client sent it (its own path and bytes, no slot), and its answer says
    which slot ran it (`ran`)."""
    return Observe(replace(abandoned, unpinned=Unpinned.WAIT_BOUND, translated=False))


def move(ticket: Ticket, slot: int, why: WaitWhy, holder: str | None, ledger: Ledger, table: SessionTable,
         now: float, *, paging: bool) -> Ticket:
    """The bookkeeping of a held request pinned to the free `slot` instead of its own (Rule 3, Rule 4), and
    the ticket it goes with: the slot it leaves is its holder's again, as for `unpin`; the ledger and the
    table say where it runs now, so nothing promised to anyone else is on `slot` and its session (not a side
    call) is at home there."""
    key, side = ticket.session.key, ticket.why is Why.SIDE_CALL
    _leave(ticket, holder, table)
    promise = ledger.pin(slot, key, side=side, paging=paging)
    table.dispatch(key, slot)
    known = table.sessions.get(key)
    if not side and known is not None:
        table.assign(key, slot, now, prefix=known.prefix, requests=known.requests)
    held = {WaitWhy.SIDE_BUSY: Why.SIDE_BUSY, WaitWhy.SLOT_BUSY: Why.SLOT_BUSY}.get(why, Why.WAIT_BOUND)
    return replace(ticket, slot=slot, promise=promise, why=held, paged_in=False, seeded=False, displaced=False)


def _leave(ticket: Ticket, holder: str | None, table: SessionTable) -> None:
    """A held request leaves the slot it was pinned to: the slot's last dispatch, and what runs there, are its
    `holder`'s again (the request ahead, None unknown)."""
    slot, key = ticket.slot, ticket.session.key
    if slot is None:
        return
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
