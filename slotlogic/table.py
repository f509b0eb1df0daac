"""This process's sessions on one server, in memory: the hot path is a lookup here.

Pure, the clock passed in. A live entry answers its session with no I/O; its touches collect in `dirty` for
the driver's periodic flush. At most `max_sessions` entries, least recently used (expired first) forgotten: a
forgotten session is placed again through the shared state, which keeps its claim.

Three slot maps follow a request's three moments, since llama-server runs a slot's work in arrival order:
`running` (assigned there last), `dispatched` (left the proxy for it last: what a save would write; a side
call's home) and `holders` (answered there last: the conversation the slot holds).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace

from slotlogic import returns, sidecalls
from slotlogic.lead import Lead

MAX_SESSIONS = 4096  # live sessions of one server remembered in memory (100k one-shot sessions: 45 MB unbounded)


@dataclass
class Assignment:
    slot: int
    last_used: float
    requests: int = 0
    prefix: str | None = None
    done: float | None = None  # when its last response completed
    lead: Lead | None = None   # its first request's leading messages, as digests (a new session's seed)
    order: int = 0             # its placement's number in the pool (`SessionTable.assign`): which came first
    gap: float | None = None   # its turn gap: seconds from an answer's end to its next request (`returns.next_gap`)


@dataclass
class SessionTable:
    ttl: float
    sessions: dict[str, Assignment] = field(default_factory=dict)
    dirty: set[str] = field(default_factory=set)
    holders: dict[int, str] = field(default_factory=dict)
    running: dict[int, str] = field(default_factory=dict)
    dispatched: dict[int, str] = field(default_factory=dict)
    last_side_call: float | None = None
    misplaced: set[str] = field(default_factory=set)  # sharing a slot with another process's session: place again
    foreign: dict[int, str] = field(default_factory=dict)  # slot -> another process's newer claim (a notice)
    max_sessions: int = MAX_SESSIONS
    # the pool's count of placements, one list shared by its servers' tables (`Recognition.placements`)
    placements: list[int] = field(default_factory=lambda: [0])

    def side_call(self, now: float) -> None:
        self.last_side_call = now

    def reserving(self, now: float) -> bool:
        """Whether the side-call slot is kept back: only while side calls come (within the TTL). A reservation
        nobody uses would cost every session a quarter of a 4-slot server."""
        return self.last_side_call is not None and now - self.last_side_call < self.ttl

    def reserved_slots(self, total: int | None, configured: int, now: float) -> tuple[int, ...]:
        """The side-call slots kept out of sessions' reach now: none before side calls came (`reserving`)."""
        return sidecalls.side_slots(total, configured) if total and self.reserving(now) else ()

    def displaced(self, key: str, slot: int) -> bool:
        """Another session ran on `slot` since `key` last did, or has a request on its way there (ours would
        queue behind it): either way the slot will not hold key's conversation when ours runs."""
        return (self.holders.get(slot, key) != key or self.running.get(slot, key) != key
                or (bool(self.misplaced) and key in self.misplaced) or (bool(self.foreign) and slot in self.foreign))

    def misplace(self, key: str) -> None:
        """Another process's session shares key's slot while a slot is free (`slotlogic.reconcile`): key's next
        request is placed again, like a displaced session's."""
        if key in self.sessions:
            self.misplaced.add(key)

    def live(self, key: str, now: float) -> Assignment | None:
        a = self.sessions.get(key)
        if a is None or now - a.last_used >= self.ttl:
            return None
        return a

    def assign(self, key: str, slot: int, now: float, *, prefix: str | None, requests: int = 0,
               lead: Lead | None = None) -> Assignment:
        old = self.sessions.pop(key, None)  # re-inserted last: the dict's order is the order of assignment
        self.placements[0] += 1
        a = Assignment(slot=slot, last_used=now, requests=requests, prefix=prefix,
                       lead=lead if lead is not None else old.lead if old is not None else None,
                       order=self.placements[0], gap=_gap(old, now))
        self.sessions[key] = a
        self.holders[slot] = key
        self.running[slot] = key
        self.misplaced.discard(key)
        self.foreign.pop(slot, None)  # our claim is the newer one now
        if len(self.sessions) > self.max_sessions:
            self._bound()
        return a

    def order(self, key: str) -> int | None:
        """The number of `key`'s placement (counted across the servers of a pool: `placements`)."""
        a = self.sessions.get(key)
        return a.order if a is not None else None

    def placed_before(self, key: str, order: int | None) -> bool:
        """`key` was placed before the placement numbered `order` (of this server or another of the pool): of
        two sessions placed together, only the later one waits for the earlier, never each for the other."""
        a = self.sessions.get(key)
        return a is not None and order is not None and a.order < order

    def _bound(self) -> None:
        """Drop the least recently used entries (an eighth of the cap at once, so the sort is rare)."""
        excess = len(self.sessions) - self.max_sessions + max(1, self.max_sessions // 8)
        for key in sorted(self.sessions, key=lambda k: self.sessions[k].last_used)[:excess]:
            del self.sessions[key]
            self.dirty.discard(key)
            self.misplaced.discard(key)

    def use(self, key: str, now: float) -> Assignment:
        """Record one request of a known session; marks it for the next coalesced flush."""
        a = self.sessions[key]
        a.gap = _gap(a, now)
        a.last_used = now
        a.requests += 1
        self.running[a.slot] = key
        self.dirty.add(key)
        return a

    def answered(self, key: str, slot: int | None, now: float) -> None:
        """A response of `key` completed on `slot`: the slot now holds key's conversation. Completion, not
        start, decides: requests pinned to one busy slot wait and may run in any order."""
        a = self.sessions.get(key)
        if a is None:
            return
        a.done = now
        # The claim lasts `ttl` after the session's last activity: a prefill longer than the TTL must not
        # leave the session expired the moment its answer ends.
        if now > a.last_used:
            a.last_used = now
            self.dirty.add(key)
        if slot is not None and slot == a.slot:
            self.holders[slot] = key
            if self.running.get(slot) == key:
                del self.running[slot]

    def claimed_elsewhere(self, slot: int, claimant: str, sent_at: float | None = None) -> str | None:
        """Another process claimed `slot` for `claimant` (`slotlogic.notices`): the session of ours that
        believed it held the slot, or had a request on its way there, is displaced, and its next request is
        placed again. The mark (`foreign`) outlives our own requests already decided for the slot (their
        dispatch and their answers may come after the notice, while the claimant's request runs after them);
        only a newer claim of ours (`assign`) lifts it. `sent_at`: the claimant's request reached the server
        then; a session of ours sent there later is on top of it, not displaced. Returns the displaced key
        (None: nobody of ours)."""
        for key in (self.holders.get(slot), self.running.get(slot), self.dispatched.get(slot)):
            a = self.sessions.get(key) if key else None
            if (key and key != claimant and a is not None and a.slot == slot
                    and (sent_at is None or a.last_used <= sent_at)):
                self.holders[slot] = claimant
                self.foreign[slot] = claimant
                return key
        return None

    def dispatch(self, key: str, slot: int, *, holds: bool = False) -> None:
        """A request pinned to `slot` leaves the proxy now (a side call: its home, `sidecalls.home`, which
        `holds` the slot from now: it is no session of the table, whose answers move `holders` on)."""
        self.dispatched[slot] = key
        if holds:
            self.holders[slot] = key

    def drain(self) -> dict[str, Assignment]:
        """The touches to flush, emptied."""
        out = {k: replace(self.sessions[k]) for k in self.dirty if k in self.sessions}
        self.dirty.clear()
        return out

    def retouch(self, touches: Mapping[str, Assignment]) -> None:
        """A flush that failed: its touches are flushed again next time."""
        self.dirty.update(touches)

    def has_touches(self) -> bool:
        return bool(self.dirty)

    def keys(self) -> list[str]:
        """The sessions this process knows on this server."""
        return list(self.sessions)

    def slot_of(self, key: str) -> int | None:
        a = self.sessions.get(key)
        return a.slot if a is not None else None

    def live_count(self, now: float) -> int:
        """Sessions used within the TTL (the metrics' gauge)."""
        return sum(1 for a in self.sessions.values() if now - a.last_used < self.ttl)

    def forget_all(self, keep: Collection[str] = ()) -> None:
        """After a restart or resize: re-choose every session on its next request (but those in `keep`, whose
        slots hold what they left there since)."""
        for key in [k for k in self.sessions if k not in keep]:
            self.forget(key)
        for where in (self.holders, self.running, self.dispatched):
            for slot in [s for s, k in where.items() if k not in keep]:
                del where[slot]
        self.misplaced.clear()
        self.foreign.clear()
        if not keep:
            self.dirty.clear()

    def readmit(self, key: str, a: Assignment) -> None:
        """A session the restart's bookkeeping forgot whose slot still holds its conversation after all: known
        again, as it was (unless it was placed anew since)."""
        if key not in self.sessions:
            self.sessions[key] = a
            self.holders[a.slot] = key

    def forget(self, key: str) -> bool:
        """Drop one session (a command, or the state file says another process took its slot)."""
        self.dirty.discard(key)
        self.misplaced.discard(key)
        a = self.sessions.pop(key, None)
        if a is not None:
            for where in (self.holders, self.running, self.dispatched):
                if where.get(a.slot) == key:
                    del where[a.slot]
        return a is not None


def _gap(a: Assignment | None, now: float) -> float | None:
    """`a`'s turn gap after a request at `now`: one more gap seen when its last request was answered."""
    if a is None:
        return None
    if a.done is None or a.done < a.last_used:
        return a.gap
    return returns.next_gap(a.gap, now - a.done)
