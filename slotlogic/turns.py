"""The turns of one server's slots: which writes may happen now, fenced by the ledger's epochs, and the hand-over
of a slot between proxies that share one state.

Why apart: the keeper decides requests and the pager what to move; this part says whether a planned move is still
valid when it is performed (docs/ledger.md, "Fenced moves") and whose turn it is to write a slot that several
proxies share (`slotlogic.handover`). Pure: the driver passes the shared state it has just read or is writing,
and the clock.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

from slotlogic import capability, handover, reconcile, shared, wait
from slotlogic.decisions import Ticket
from slotlogic.events import StalePlan
from slotlogic.handover import Handover
from slotlogic.ledger import Cause, Fence, Holds, Ledger
from slotlogic.server import cache_probe_slots
from slotlogic.settings import Settings
from slotlogic.table import SessionTable

OTHER_PROXY = "\x00other-proxy"  # the ledger claim that keeps our sessions off a slot being handed over
PROBE = "\x00start-up-probe"     # the ledger claim of the slot the start-up probe writes and erases


class TurnsHost(Protocol):
    @property
    def instance(self) -> str: ...

    @property
    def total_slots(self) -> int | None: ...


class Turns:
    def __init__(self, settings: Settings, upstream: str, table: SessionTable, ledger: Ledger, host: TurnsHost) -> None:
        self.settings = settings
        self.upstream = upstream
        self.table = table
        self.ledger = ledger
        self.host = host
        self.handed: dict[int, Handover] = {}  # slot -> the answer it was handed to us with, until we pin there
        self.read: dict[int, int] = {}  # slot -> the epoch of the last answer to our ask of it that we have read

    # ------------------------------------------------------------------------------------------- the probe

    def probe_slot(self, live: Sequence[Mapping[str, Any]] | None, total: int) -> Fence | None:
        """The slot the start-up probe may write (`capability.probe_slot` among `_probe_free`'s), claimed for it so
        that placements rank it busy, with the fence each of its slot actions is checked against (`probe_may_write`).
        None: no such slot, no probe (it never writes over a conversation)."""
        slot = capability.probe_slot(_probe_free(self.ledger, self.table.running, live), total)
        if slot is None:
            return None
        self.ledger.claim(slot, PROBE)
        return self.ledger.fence(slot)

    def mode_probe(self, live: Sequence[Mapping[str, Any]]) -> tuple[int, list[Fence]] | None:
        """The cache-mode probe's witness and the claimed fences of the slots it writes (`cache_probe_slots`)."""
        plan = cache_probe_slots(live, {e["id"] for e in _probe_free(self.ledger, self.table.running, live)})
        written = () if plan is None else (plan[1], plan[0]) if plan[2] else (plan[1],)
        for slot in written:
            self.ledger.claim(slot, PROBE)
        return None if plan is None else (plan[0], [self.ledger.fence(s) for s in written])

    def probe_may_write(self, fence: Fence) -> bool:
        """Nothing of ours went to the probe's slot since it was chosen (a placement that chose it anyway, every
        slot being busy, has its request there, queued with the probe's actions): its next action may run."""
        slot = fence.slot
        return (self.ledger.current(fence) and self.ledger.claims_on(slot) == (PROBE,)
                and slot not in self.table.running)

    def probe_done(self, fence: Fence, erased: bool) -> None:
        """The probe is over: its claim goes; an erased slot is empty (when nothing else wrote it since)."""
        self.ledger.unclaim(fence.slot, PROBE)
        if erased and self.ledger.current(fence):
            self.ledger.write(fence.slot, Holds.EMPTY, None)

    def turn(self, fence: Fence) -> Fence:
        """A placement's turn on its slot has come (it holds the slot's lock and every request sent there
        before has reached the server): the fence of its moves, the slot's epoch now (earlier placements on
        the slot have written it since the claim), with the claim's epoch in the shared state."""
        return Fence(fence.slot, self.ledger.entry(fence.slot).epoch, fence.shared, fence.outside)

    def fence_holds(self, fence: Fence | None, state: shared.ServerState | None = None,
                    now: float | None = None) -> bool:
        """The slot has not moved on since `fence`: nothing wrote it since but our own plans, in turn, and nothing
        from outside this process since the placement's claim (another proxy we handed it to, a request the
        server placed there, a restart). With `state` (a fresh read of the shared state) and `now`: nor did a
        proxy that claimed it after us, and asked us for it, move in without our answer (`handover.WAIT`)."""
        if fence is None:
            return True
        if not self.ledger.current(fence) or self.ledger.outside(fence.slot) != fence.outside:
            return False
        if state is None or fence.shared is None or now is None:
            return True
        return not any(h.slot == fence.slot and h.giver == self.host.instance and h.answered is None
                       and now - h.asked >= handover.WAIT for h in state.handovers.values())

    def slot_written(self, fence: Fence | None, holds: Holds, key: str, tokens: int, *,
                     over: Cause = Cause.UNKNOWN) -> Fence | None:
        """A planned move wrote the slot (a page-in: `Holds.PAGE`; a seed: `SEED`; a prefix: `PREFIX`), for
        `key`'s request: the new fence. None when the plan was stale (the caller logs `stale_plan`)."""
        if fence is None:
            return None
        return self.ledger.admit(fence, holds, key, tokens, over)

    def stale_plan(self, fence: Fence, move: str, session: str) -> StalePlan:
        """A plan whose slot moved on since it was made: dropped (the caller plans again)."""
        return StalePlan(self.upstream, fence.slot, move, session[:8], fence.epoch, self.ledger.entry(fence.slot).epoch)

    def claimed_elsewhere(self, slot: int, claimant: str, sent_at: float | None) -> str | None:
        """Another proxy claimed `slot` for `claimant` (its notice): our session there is displaced, and the
        ledger says the slot holds the claimant's conversation now. Returns the displaced key. Without paging
        nothing keeps the conversation: a known eviction (the other proxy chose it)."""
        key = self.table.claimed_elsewhere(slot, claimant, sent_at)
        if key is not None:
            self.ledger.claimed_elsewhere(slot, claimant, Cause.OTHER_PROCESS if self.settings.paging
                                          else Cause.EVICTED)
        return key

    def may_write(self, state: shared.ServerState, slot: int) -> bool:
        """The shared state names this process as the slot's writer (`slotlogic.handover`), and it is not
        handing the slot to another proxy right now (a state read before that answer was written is stale)."""
        if self.handing_over(slot):
            return False
        if not self.host.instance or handover.writes(state.writers, slot, self.host.instance):
            self.ledger.writing.add(slot)
            return True
        self.ledger.writing.discard(slot)
        return False

    def writer_turn(self, state: shared.ServerState, slot: int, key: str, now: float) -> Handover | None:
        """In the store's transaction: the slot is ours to write now (None), or the handover asked of its writer."""
        asked = handover.turn(state.writers, state.handovers, state.beats, slot, self.host.instance, key, now)
        if asked is None:
            self.ledger.writing.add(slot)
        return asked

    def writer_forced(self, state: shared.ServerState, asked: Handover, now: float) -> None:
        handover.forced(state.writers, asked)
        self.ledger.writing.add(asked.slot)

    def late_answer(self, state: shared.ServerState, slot: int) -> Handover | None:
        """An answer to an ask of ours that we never read: its giver answered after we took the slot anyway
        (it had not been heard of yet at start-up), or after the placement that asked went stale and went
        elsewhere. It says whose conversation its last request left there, which our next placement on the
        slot pages out first (`handover.holder` keeps whichever of that and ours ran later)."""
        if not self.host.instance:
            return None
        h = state.handovers.get((slot, self.host.instance))
        if h is None or h.answered is None or self.read.get(slot) == h.epoch:
            return None
        self.read[slot] = h.epoch
        self.handed[slot] = h
        return h

    def writer_given(self, answer: Handover) -> None:
        """The giver answered: the slot is this process's to write. Its answer (whose conversation its last
        request left there) stays with the slot until a request of ours is pinned there: a placement planned
        again after its first plan went stale still pages that conversation out first."""
        self.ledger.writing.add(answer.slot)
        self.handed[answer.slot] = answer
        self.read[answer.slot] = answer.epoch

    def handed_with(self, slot: int) -> Handover | None:
        """The answer `slot` was handed to this process with, while nothing of ours was pinned there since."""
        return self.handed.get(slot)

    def pinned(self, slot: int) -> None:
        """A request of ours is pinned to `slot` (after its moves): what the giver left there is moved or gone."""
        if self.handed:
            self.handed.pop(slot, None)

    def asked_of_us(self, state: shared.ServerState) -> list[Handover]:
        """Handovers other proxies ask of this one (`slotlogic.handover`)."""
        return handover.asked_of(state.handovers, self.host.instance) if self.host.instance else []

    def handing_over(self, slot: int) -> bool:
        """This process is handing `slot` to another proxy right now."""
        return self.ledger.handing_over(slot, OTHER_PROXY)

    def hand_over_begins(self, h: Handover) -> None:
        """Keep this process's sessions off the slot from now on (their next request is placed again)."""
        self.ledger.claim(h.slot, OTHER_PROXY)

    def hand_over_ends(self, h: Handover) -> str | None:
        """Every request this process sent to the slot has reached the server and no move of its own is under
        way there: the session whose conversation our last write left there (the taker pages it out), and
        the slot is the other proxy's session's from now on."""
        last = self.ledger.conversation_on(h.slot)
        if self.claimed_elsewhere(h.slot, h.claimant, None) is None:
            self.ledger.claimed_elsewhere(h.slot, h.claimant)
        self.ledger.writing.discard(h.slot)
        self.handed.pop(h.slot, None)
        return last  # our sessions stay off the slot until the answer is written (`hand_over_cleared`)

    def others_alive(self, state: shared.ServerState, now: float) -> bool:
        """Another proxy beats in this server's state: it may ask us for a slot."""
        return any(p != self.host.instance and handover.alive(state.beats, p, now) for p in state.beats)

    def hand_over_cleared(self, h: Handover) -> None:
        """The handover of `h.slot` is over, answered or not: nothing of it keeps our sessions off the slot."""
        self.ledger.unclaim(h.slot, OTHER_PROXY)

    def holds_conversation_of(self, slot: int, key: str) -> bool:
        """`slot` holds `key`'s current conversation, as the ledger has it (a seed copy's fence)."""
        return self.ledger.conversation_on(slot) == key

    def holds_conversations(self) -> bool:
        """A slot holds a conversation of ours, live or expired (a proxy that takes it must ask us first, so that
        what we believe stays true: the other proxies must hear we are alive)."""
        return any(self.ledger.conversation_on(s) is not None for s in range(self.ledger.total))

    def handover_answer(self, state: shared.ServerState, asked: Handover) -> Handover | None:
        return handover.answer(state.handovers, asked)

    def beat_age(self, state: shared.ServerState, now: float) -> float:
        """Seconds since this process last beat in `state` (any transaction of its placements beats)."""
        return now - state.beats.get(self.host.instance, float("-inf")) if self.host.instance else float("inf")

    def beat(self, state: shared.ServerState, now: float) -> None:
        """This process is alive, in the state of a server it has live sessions on."""
        if self.host.instance:
            handover.beat(state.beats, self.host.instance, now)
            handover.prune(state.handovers, state.beats, now)

    def reconcile(self, state: shared.ServerState, now: float) -> list[str]:
        """Mark this process's sessions that share a slot with an earlier one of another process while a slot is
        free (`slotlogic.reconcile`); their next request is placed again. Off the hot path: the background
        flush calls it with the state it has just written or read. Returns the keys marked."""
        ttl = self.settings.ttl
        # Our live sessions, each where our memory has it, less those another of ours has displaced from their
        # slot since (two of our own on one slot are one holder and one displaced: the table moves the latter).
        table = self.table
        ours = {k: a.slot for k, a in table.sessions.items()
                if now - a.last_used < ttl and table.holders.get(a.slot, k) == k}
        if not ours:
            return []
        total = self.host.total_slots  # `/props` only: the state's count sizes nothing
        reserved = table.reserved_slots(total, self.settings.side_slot, now)
        marked = [k for k in reconcile.misplaced(state, ours, now, ttl, total, reserved, mine=table.sessions.keys())
                  if k not in self.table.misplaced]
        for key in marked:
            self.table.misplace(key)
        return marked

    def displaced_by_others(self, state: shared.ServerState) -> list[tuple[int, str, str]]:
        """Another proxy's session ran on a slot after our session's last request there (the shared state's
        newest claim is theirs): our session is displaced, and its next request is placed again (paged in
        when that proxy paged it out). Returns (slot, ours, theirs) for each, the table already updated."""
        table = self.table
        out = []
        for slot, other in shared.displaced_by_others(state, table.sessions, table.holders).items():
            out.append((slot, table.holders[slot], other))
            table.holders[slot] = other
        return out

    def unpin(self, ticket: Ticket, why: wait.WaitWhy, holder: str | None) -> Ticket:
        """The request goes out with `id_slot: -1` after its wait (`slotlogic.wait.unpin`): its new ticket."""
        return wait.unpin(ticket, why, holder, self.table, self.ledger)

    def free_slot(self, avoid: int, busy: Collection[int]) -> int | None:
        """A slot a held request may move to without writing over anything promised (`slotlogic.wait.free_slot`);
        not one this process is handing to another proxy. Whether it may write it: `take_free`."""
        return wait.free_slot(self.ledger, self.table, self.host.total_slots, avoid, busy,
                              writable=lambda s: not self.handing_over(s))

    def idle_set(self, avoid: int | None, busy: Collection[int], mine: str = "") -> frozenset[int]:
        """Slots other than `avoid` that run nothing of ours and no placement but `mine`'s (`wait.idle_set`)."""
        return wait.idle_set(self.ledger, self.host.total_slots, avoid, busy, mine)

    def exposed(self, avoid: int, busy: Collection[int]) -> int:
        """The promised tokens a request sent with `id_slot: -1` instead of to `avoid` could write over (0: it
        can only land where nothing is promised). The server runs it on an idle slot of its choosing, or with
        none idle on the first that frees, one that runs our work now. A slot whose content this process cannot
        vouch for (another placement's, another proxy's, never written here) counts as promised. Unknown slot
        count: 0 (nothing is known to be promised)."""
        total = self.host.total_slots
        if not total:
            return 0
        idle = self.idle_set(avoid, busy)
        where = idle if idle else frozenset(s for s in busy if s != avoid)
        free = wait.free_slots(self.ledger, self.table, total, avoid, busy, writable=lambda s: not self.handing_over(s))
        worst = 0
        for s in where:
            if s in free and self.writes(s):
                continue
            worst = max(worst, self.ledger.entry(s).tokens or 1)
        return worst

    def writes(self, slot: int) -> bool:
        """This process is the slot's writer, as it last knew (or the only proxy there can be)."""
        return not self.host.instance or slot in self.ledger.writing

    def take_free(self, state: shared.ServerState, slot: int, now: float) -> bool:
        """In the store's transaction: make `slot` this process's to write for a held request's move when nobody
        else may (`slotlogic.handover.take_free`); False when a live proxy writes it (the request is not moved)."""
        if not self.host.instance:
            return True
        if self.handing_over(slot) or not handover.take_free(state.writers, state.beats, slot, self.host.instance,
                                                             now):
            return False
        handover.beat(state.beats, self.host.instance, now)
        self.ledger.writing.add(slot)
        return True

    def move_held(self, ticket: Ticket, slot: int, why: wait.WaitWhy, holder: str | None, now: float) -> Ticket:
        """A held request goes to the free `slot` instead (`slotlogic.wait.move`): its new ticket."""
        return wait.move(ticket, slot, why, holder, self.ledger, self.table, now, paging=self.settings.paging)

    # ------------------------------------------------------------------------------------------- commands

    def forget(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.table.forget(key)

    def move(self, key: str, slot: int, now: float) -> str | None:
        """The slots.pin command: `key` goes to `slot` from its next request on; returns its prefix."""
        known = self.table.sessions.get(key)
        prefix = known.prefix if known else None
        self.table.assign(key, slot, now, prefix=prefix, requests=known.requests if known else 0)
        entry = self.ledger.entry(slot)
        if entry.owner != key:  # the operator's move: the slot is its from now on, holding nothing of it yet
            self.ledger.write(slot, Holds.SESSION, key, 0, Cause.UNKNOWN)
        return prefix


def _probe_free(ledger: Ledger, running: Collection[int], live: Sequence[Mapping[str, Any]] | None
                ) -> list[Mapping[str, Any]]:
    """The `/slots` entries a probe may write: no session of ours holds them, is being placed on them or has a
    request on its way there."""
    return [e for e in live or () if isinstance(e, Mapping) and isinstance(e.get("id"), int)
            and not isinstance(e.get("id"), bool) and ledger.entry(e["id"]).owner is None
            and not ledger.claimed(e["id"]) and e["id"] not in running]
