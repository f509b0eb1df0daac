"""The slot ledger: what this proxy believes each slot of one server holds, and the loss meter behind it.

The session table says who *claimed* a slot; the ledger says what it *holds* after every write, so a session is
"known" (its next turn pinned without a page-in) only while its slot still holds its conversation, and every
answer is checked against what was promised for it. Pure; every write is fenced by the slot's epoch (`admit`);
claims queue behind each other and move no epoch; bounded (`MAX_SLOTS`, `MAX_SESSIONS`). docs/ledger.md.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum

from slotlogic.numbers import MAX_SLOTS  # slots of one server the ledger keeps (a larger count is capped)
from slotlogic.paging import MIN_TOKENS as MIN_PAGE_TOKENS
from slotlogic.server_placed import ServerPlaced

MAX_SESSIONS = 4096     # conversations whose length and history are remembered
TOLERANCE_TOKENS = 16   # a turn's re-rendered tail (generation prompt, a re-evaluated last token) is no loss
TOLERANCE_SHARE = 0.02


class Holds(Enum):
    """What a slot holds, as far as this proxy knows."""

    UNKNOWN = "unknown"   # never seen, or written by something the proxy does not follow
    EMPTY = "empty"       # a restart emptied it
    SESSION = "session"   # `owner`'s conversation, `tokens` long (in flight while its request runs)
    PREFIX = "prefix"     # a stable prefix restored or warmed for `owner`'s request
    PAGE = "page"         # `owner`'s page, restored: `tokens` long (its request has not run yet)
    SEED = "seed"         # another session's conversation, copied in as `owner`'s start


class Cause(Enum):
    """Why tokens a session had were not in its slot when it came back."""

    RESTART = "restart"                      # the server restarted: every slot was emptied
    MODEL_CHANGE = "model-change"            # another model or configuration now answers
    EVICTED = "evicted"                      # another session took the slot and no page could keep it
    PREFIX_OVER_OWNER = "prefix-over-owner"  # a prefix restore or warm-up wrote the owner's slot
    SEED_OVER_OWNER = "seed-over-owner"      # a seed copy wrote the owner's slot
    STALE_PAGE = "stale-page"                # paged in from a page older than the conversation
    OTHER_PROCESS = "other-process"          # another proxy's session ran there
    UNPINNED = "unpinned"                    # a request the server placed itself ran there
    SIDE_CALL = "side-call"                  # a side call ran on the session's slot
    IDLE_CLEAR = "idle-clear"                # the server emptied the idle slot (unified KV, --cache-idle-slots):
    #                                          the proxy pinned there before it knew the mode, so not expected
    LET_GO = "let-go"                        # not paged by choice: prefilling it again measured cheaper, or
    #                                          its page went to keep the save dir within the page budget
    UNKNOWN = "unknown"

    @property
    def expected(self) -> bool:
        """Causes outside the proxy's control, or chosen knowingly (no page budget, no save dir). Idle clearing is
        not one: on such a server the proxy passes requests through, so a pin it lost there is its own miss."""
        return self in _EXPECTED


_EXPECTED = frozenset({Cause.RESTART, Cause.MODEL_CHANGE, Cause.EVICTED, Cause.LET_GO})
_EMPTIED = frozenset({Cause.RESTART, Cause.MODEL_CHANGE})  # every slot (and maybe every page) of the server
_KEPT = _EMPTIED | {Cause.IDLE_CLEAR, Cause.LET_GO}  # gone before a write of ours: a later write cannot lose it again


@dataclass(frozen=True)
class Entry:
    epoch: int
    holds: Holds = Holds.UNKNOWN
    owner: str | None = None    # the session whose conversation (SESSION) or start (PREFIX, SEED) it is
    tokens: int = 0             # tokens the slot holds for `owner` (0: unknown or none promised)
    mark: int = 0               # when `owner`'s conversation was brought here (its pin or page-in), ledger-wide


@dataclass(frozen=True)
class Fence:
    """A plan's token: the slot's epoch when the plan was made."""

    slot: int
    epoch: int
    shared: int | None = None  # the slot's epoch in the shared state after the claim (several proxies)
    outside: int = 0           # writes to the slot from outside this process's plans, as of the claim


@dataclass(frozen=True)
class Promise:
    """What a pinned request should find: `tokens` in the slot for it, of a conversation `conversation` long."""

    slot: int
    tokens: int
    conversation: int          # the session's prompt tokens at its previous answer (0: none known)
    page_tokens: int | None    # the page it was paged in from, when it was
    placed_before: int = 0     # requests sent for the server to place before this one was pinned
    undo: Undo | None = None   # what the pin wrote over, put back if its request leaves the slot unrun (`put_back`)


@dataclass(frozen=True)
class Undo:
    """What a pin replaced: the slot's entry, the former owner's `gone` and the pinned session's `latest` before
    it, and the epoch the pin wrote (nothing else wrote the slot while that is still the slot's)."""

    entry: Entry
    epoch: int
    gone: Cause | None
    latest: int | None


@dataclass(frozen=True)
class Loss:
    tokens: int
    cause: Cause

    @property
    def expected(self) -> bool:
        return self.cause.expected


def tolerance(tokens: int) -> int:
    return TOLERANCE_TOKENS + int(tokens * TOLERANCE_SHARE)


class Marks(OrderedDict[str, tuple[int, str]]):
    """Each session's last parsed request's conversation mark (`slotlogic.lead.extends`), the least recent
    beyond a bound dropped: a request that never gets an answer (a 404) still leaves one."""

    def put(self, key: str, mark: tuple[int, str], limit: int) -> None:
        self[key] = mark
        self.move_to_end(key)
        while len(self) > limit:
            self.popitem(last=False)


class Ledger:
    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        self._slots: dict[int, Entry] = {}
        self.total = 0
        self.conversations: OrderedDict[str, int] = OrderedDict()  # session -> prompt tokens at its last answer
        self.gone: dict[str, Cause] = {}  # session -> what last wrote over its conversation
        self.marks = Marks()  # session -> (messages, digest) of its last parsed request
        self.max_sessions = max_sessions
        self.stale = 0   # plans dropped because their slot moved on
        self._claims: dict[int, list[str]] = {}  # slot -> sessions whose placements chose it, in claim order
        self._tick = 0
        self._outside: dict[int, int] = {}  # slot -> writes from outside this process's plans (fences compare it)
        self.writing: set[int] = set()  # slots this process is the writer of (`slotlogic.handover`), as it last knew
        self.latest: dict[str, int] = {}  # session -> the mark of its newest pin or page-in, on any slot
        self.placed = ServerPlaced()  # requests sent for the server to place (`id_slot: -1`)
        self._unpinned_at: dict[str, int] = {}  # session -> `placed.answers` as of its last answer

    # ------------------------------------------------------------------------------------------ reading

    def entry(self, slot: int) -> Entry:
        return self._slots.get(slot) or Entry(0)

    def fence(self, slot: int) -> Fence:
        return Fence(slot, self.entry(slot).epoch, outside=self.outside(slot))

    def outside(self, slot: int) -> int:
        """How many writes to `slot` came from outside this process's own plans (another proxy took it, the
        server put a request there, a restart): a placement claimed before one of them is stale."""
        return self._outside.get(slot, 0)

    def _from_outside(self, slot: int) -> None:
        self._outside[slot] = self._outside.get(slot, 0) + 1

    def current(self, fence: Fence) -> bool:
        return self.entry(fence.slot).epoch == fence.epoch

    def holds(self, slot: int, key: str) -> bool:
        """The slot holds `key`'s conversation, or what was put there for its request (nothing wrote since), and
        no placement has claimed it since: a request of `key` may go there without any move first."""
        if self._claims and slot in self._claims:
            return False
        e = self._slots.get(slot)
        return e is None or e.owner == key  # a slot never written since the ledger was sized: the table decides

    def claimed(self, slot: int) -> bool:
        """A placement has chosen `slot` and its request has not been pinned yet: its moves are to come."""
        return bool(self._claims) and slot in self._claims

    def handing_over(self, slot: int, marker: str) -> bool:
        """`marker`'s claim is queued on `slot`: it is being handed to another proxy."""
        return bool(self._claims) and marker in self._claims.get(slot, ())

    def claims_on(self, slot: int) -> tuple[str, ...]:
        """Who has claimed `slot`, in claim order (sessions' placements, or a marker such as the probe's)."""
        return tuple(self._claims.get(slot, ())) if self._claims else ()

    def claimed_slots(self) -> frozenset[int]:
        return frozenset(self._claims)

    def conversation_on(self, slot: int) -> str | None:
        """The session whose current conversation `slot` holds (or is about to hold), if any: what a write for
        anyone else would destroy unless it is paged out first. A copy its session has moved on from (it ran
        on another slot since) is nobody's conversation any more."""
        e = self._slots.get(slot)
        if e is None or not e.owner or e.holds not in (Holds.SESSION, Holds.PAGE):
            return None
        return e.owner if self.latest.get(e.owner) == e.mark else None

    def where(self, key: str) -> int | None:
        """The slot holding `key`'s current conversation, if one does (a scan: slow path only)."""
        mark = self.latest.get(key)
        if mark is None:
            return None
        return next((s for s, e in self._slots.items() if e.owner == key and e.mark == mark
                     and e.holds in (Holds.SESSION, Holds.PAGE)), None)

    def moved_on(self, slot: int, key: str) -> bool:
        """`slot` does not hold `key`'s current conversation, though this proxy had it there: something else
        wrote the slot since, or `key` ran (or was paged in) elsewhere since. What is left there of it is an
        older copy at best, never its page."""
        return key in self.latest and self.conversation_on(slot) != key

    def view(self) -> tuple[Entry, ...]:
        """Every slot's entry, in slot order (the simulator's invariants and the status view)."""
        return tuple(self.entry(s) for s in range(self.total))

    # ------------------------------------------------------------------------------------------ writing

    def resize(self, total: int, cause: Cause | None = None, keep: Collection[int] = ()) -> None:
        """A server of `total` slots (from `/props` only), or the same server restarted (`cause`): every
        slot's content is unknown (EMPTY after a restart), and every conversation in one is gone, but for the
        slots in `keep` (written since the restart: `written_since_restart`)."""
        total = max(0, min(total, MAX_SLOTS))
        for e in self._slots.values():
            if e.owner and e.holds is Holds.SESSION and cause is not None:
                self.gone[e.owner] = cause  # a kept slot's request still running found the slot emptied too
        if cause is not None:  # a paged-out conversation too, should its page not restore on the new server
            kept = {self.entry(s).owner for s in keep}  # (a new build's restart, else called `unknown`)
            for key in self.conversations:
                if key not in kept:
                    self.gone[key] = cause
        self._claims = {s: keys for s, keys in self._claims.items() if s < total}
        for s in range(total):
            self._from_outside(s)
        if cause is Cause.RESTART:  # the same slots, emptied: each still its owner's, holding nothing
            self._slots = {s: replace(self.entry(s), epoch=self.entry(s).epoch + 1) if s in keep else
                           Entry(self.entry(s).epoch + 1, Holds.EMPTY, self.entry(s).owner) for s in range(total)}
        else:
            self._slots = {s: Entry(self.entry(s).epoch + 1) for s in range(total)}
        self.total = total

    def claim(self, slot: int, key: str) -> None:
        """A placement for `key` chose `slot` (Rule 4): queued behind the placements that chose it before."""
        if 0 <= slot < MAX_SLOTS:
            self._claims.setdefault(slot, []).append(key)

    def unclaim(self, slot: int, key: str) -> None:
        """`key`'s placement on `slot` is over: its request was pinned there, or it went elsewhere or nowhere."""
        keys = self._claims.get(slot)
        if keys is None:
            return
        try:
            keys.remove(key)
        except ValueError:
            return
        if not keys:
            del self._claims[slot]

    def admit(self, fence: Fence, holds: Holds, owner: str | None, tokens: int = 0,
              cause: Cause = Cause.UNKNOWN) -> Fence | None:
        """Perform a planned write: the new fence, or None when the slot moved on since the plan (stale)."""
        if not self.current(fence) or fence.slot >= max(self.total, fence.slot + 1) > MAX_SLOTS:
            self.stale += 1
            return None
        return replace(self.write(fence.slot, holds, owner, tokens, cause), shared=fence.shared,
                       outside=fence.outside)

    def write(self, slot: int, holds: Holds, owner: str | None, tokens: int = 0,
              cause: Cause = Cause.UNKNOWN) -> Fence:
        """Something wrote `slot` (unfenced: an answer that says where it ran, another process's claim). The
        conversation it replaces is gone, for `cause`."""
        if slot < 0 or slot >= MAX_SLOTS:
            return Fence(slot, 0)
        old = self.entry(slot)
        if old.owner and old.owner != owner and old.holds is Holds.SESSION:
            self._gone(old.owner, cause)
        if owner and holds is Holds.PAGE and tokens > 0 \
                and tokens + tolerance(had := self.conversations.get(owner, 0)) >= had:
            self.gone.pop(owner, None)  # paged back in whole: its conversation is here again, whatever took it
        mark = 0
        if owner and holds in (Holds.SESSION, Holds.PAGE):
            if holds is Holds.SESSION and old.owner == owner and old.holds in (Holds.SESSION, Holds.PAGE):
                mark = old.mark  # its next turn where its conversation is: the same one, further on
            else:
                self._tick += 1
                mark = self._tick
            self.latest[owner] = mark
            if len(self.latest) > 2 * self.max_sessions:  # sessions pinned but never answered: keep the owners'
                owners = {e.owner for e in self._slots.values()}
                self.latest = {k: v for k, v in self.latest.items() if k in owners or k in self.conversations}
        e = Entry(old.epoch + 1, holds, owner, max(0, tokens), mark)
        self._put(slot, e)
        return Fence(slot, e.epoch)

    def pin(self, slot: int, key: str, *, side: bool = False, paging: bool = True) -> Promise:
        """A request of `key` goes to `slot` now (the hot path: a few dict operations): what it will find.
        A side call over a conversation is a fault with paging (it pages it out first), a known eviction
        without (nothing could keep it)."""
        old = self.entry(slot)
        own = old.owner == key and old.holds in (Holds.SESSION, Holds.PREFIX, Holds.PAGE)
        promised = old.tokens if own else 0
        undo = Undo(old, old.epoch + 1, self.gone.get(old.owner) if old.owner else None, self.latest.get(key))
        # a side call's home (`sidecalls.home`) owns what it leaves there, as a session does
        self.write(slot, Holds.SESSION, key, promised, (Cause.SIDE_CALL if paging else Cause.EVICTED) if side
                   else Cause.EVICTED)
        page = old.tokens if own and old.holds is Holds.PAGE else None
        return Promise(slot, promised, self.conversations.get(key, 0), page, self.placed.sent, undo)

    def settle(self, key: str, promise: Promise | None, slot: int | None, cache_n: int | None,
               prompt_n: int | None, extends: bool | None) -> Loss | None:
        """An answer of `key` completed on `slot`: the slot holds its conversation now; the loss, if its
        request found less than the session had (only for a request that extends its previous one)."""
        loss = None
        had = self.conversations.get(key, 0)
        if cache_n is not None and promise is not None and extends and had > 0:
            short = had - cache_n
            if short > tolerance(had):
                loss = Loss(short, self._cause(key, promise))
        if cache_n is not None and prompt_n is not None:
            tokens = cache_n + prompt_n
            overtaken = False
            if slot is not None and 0 <= slot < MAX_SLOTS:
                e = self.entry(slot)
                if e.owner == key:
                    self._put(slot, replace(e, holds=Holds.SESSION, tokens=tokens))
                else:  # pinned for someone else while this ran (a side call queued behind it): gone already
                    overtaken = key in self.gone
            self.conversations[key] = tokens
            self.conversations.move_to_end(key)
            self._unpinned_at[key] = self.placed.answers
            if not overtaken:
                self.gone.pop(key, None)
            if slot is None:  # sent with id_slot -1 and the slot that ran it not learned: the server's choice
                # (a turn sent unpinned at its wait bound: its next one, placed anew, finds none of its tokens,
                # which are then labelled, not `unknown`)
                self.gone[key] = Cause.UNPINNED
            while len(self.conversations) > self.max_sessions:
                old, _ = self.conversations.popitem(last=False)
                self.gone.pop(old, None)
                self.marks.pop(old, None)
                self.latest.pop(old, None)
                self._unpinned_at.pop(old, None)
        return loss

    def ran_unpinned(self, slot: int, key: str, *, side: bool = False, queued: bool = False) -> None:
        """An unpinned request (the server chose) ran on `slot`: it holds `key`'s prompt now. A side call's home
        whose content another slot holds stays there (the copy that ran elsewhere is nobody's). `queued`: the
        owner's own pinned request waits behind it there, so the slot stays the owner's (`overrun`)."""
        self._from_outside(slot)
        if queued:
            old = self.entry(slot)
            if old.owner and old.owner != key and old.holds is Holds.SESSION:
                self._gone(old.owner, Cause.UNPINNED)
            self._put(slot, replace(old, epoch=old.epoch + 1))
            return
        if side and self.where(key) not in (None, slot):
            self.write(slot, Holds.UNKNOWN, None, 0, Cause.UNPINNED)
            return
        self.write(slot, Holds.SESSION, key, 0, Cause.UNPINNED)
        if self.gone.get(key) is Cause.UNPINNED:
            del self.gone[key]  # where it ran is learned after all: its conversation is known to be here

    def overrun(self, key: str) -> None:
        """`key`'s request ran where the server put it, ahead of another session's request pinned there: what it
        left is written over next (`ran_unpinned`'s `queued`)."""
        if key in self.conversations:
            self._gone(key, Cause.UNPINNED)

    def sent_unpinned(self) -> int:
        """A request goes out for the server to choose its slot: its number (`slotlogic.server_placed`)."""
        return self.placed.send()

    def emptied(self, key: str, cause: Cause) -> None:
        """`key`'s conversation was gone before a move of ours (`found_empty`), for `cause`: whatever
        writes the slot next loses nothing of it (else it takes the blame)."""
        if key in self.conversations:  # (another proxy's session: its own proxy says)
            self._gone(key, cause, keep=_EMPTIED)

    def claimed_elsewhere(self, slot: int, claimant: str, cause: Cause = Cause.OTHER_PROCESS) -> None:
        self._from_outside(slot)
        self.write(slot, Holds.SESSION, claimant, 0, cause)

    def not_paged(self, key: str) -> None:
        """`key`'s conversation leaves its slot unsaved by choice (`Cause.LET_GO`)."""
        if key in self.conversations:
            self._gone(key, Cause.LET_GO)

    def forget(self, key: str) -> None:
        self.latest.pop(key, None)
        self.conversations.pop(key, None)
        self.gone.pop(key, None)
        self.marks.pop(key, None)
        self._unpinned_at.pop(key, None)

    # ------------------------------------------------------------------------------------------ inside

    def _cause(self, key: str, promise: Promise) -> Cause:
        cause = self._found_cause(key, promise)
        if not cause.expected and self.conversations.get(key, 0) < MIN_PAGE_TOKENS:
            # too short to be worth a page (`paging.MIN_TOKENS`): never saved nor restored, prefilled again by
            # choice, as with no save dir (a title call's short home, else called `unknown`)
            return Cause.EVICTED
        return cause

    def _found_cause(self, key: str, promise: Promise) -> Cause:
        if self.gone.get(key) in _EMPTIED | {Cause.LET_GO}:  # a page made before may be short for that reason
            return self.gone[key]
        if promise.page_tokens is not None and promise.page_tokens + tolerance(promise.conversation) \
                < promise.conversation:
            return Cause.STALE_PAGE
        cause = self.gone.get(key)
        if cause is not None:
            return cause
        since = self._unpinned_at.get(key, self.placed.answers)
        return Cause.UNPINNED if self.placed.blamed(since, promise.placed_before) else Cause.UNKNOWN

    def _gone(self, key: str, cause: Cause, keep: frozenset[Cause] = _KEPT) -> None:
        """What wrote over `key`'s conversation, unless a cause in `keep` came first (what a restart or idle
        clearing emptied, later writes cannot lose). Bounded: other proxies' sessions, never answered here,
        are dropped first."""
        if self.gone.get(key) in keep:
            return
        self.gone[key] = cause
        if len(self.gone) > 2 * self.max_sessions:
            self.gone = {k: v for k, v in self.gone.items() if k in self.conversations}

    def _put(self, slot: int, e: Entry) -> None:
        self._slots[slot] = e
        if slot >= self.total:
            self.total = min(slot + 1, MAX_SLOTS)


def put_back(ledger: Ledger, promise: Promise | None, key: str) -> None:
    """`key`'s request pinned by `promise` left its slot before it ran there (the wait moved it to another slot
    or sent it with `id_slot: -1`): it wrote nothing there, so what the pin replaced is the slot's again, its
    owner's conversation not gone (else the owner's next turn is placed as displaced and a prefix or page is
    moved in over the conversation still there). Only while nothing else wrote the slot since the pin; the
    epoch moves on all the same (a plan fenced by the pin's epoch is stale)."""
    if promise is None or promise.undo is None:
        return
    undo, now = promise.undo, ledger.entry(promise.slot)
    if now.epoch != undo.epoch or now.owner != key:
        return
    ledger._put(promise.slot, replace(undo.entry, epoch=now.epoch + 1))
    owner = undo.entry.owner
    if owner and owner != key:
        if undo.gone is None:
            ledger.gone.pop(owner, None)
        else:
            ledger.gone[owner] = undo.gone
    if undo.latest is None:
        ledger.latest.pop(key, None)
    else:
        ledger.latest[key] = undo.latest


def found_empty(ledger: Ledger, slot: int, key: str, saved: int) -> bool | None:
    """A page-out of `key` from `slot` saved `saved` tokens. True: this ledger says the slot held `key`'s
    conversation and the save found it (next to) empty; nothing of ours wrote it (the save ran under its
    fence), so the server emptied it (a restart, idle clearing: the driver asks it which). None: nothing was
    found but this ledger does not know what the slot held for `key` (another proxy's session: the shared
    state may know). False otherwise."""
    e = ledger.entry(slot)
    if e.owner == key and e.holds is Holds.SESSION and e.tokens > 0:
        return e.tokens > tolerance(e.tokens) and saved <= tolerance(e.tokens)
    if e.owner in (None, key) and e.holds in (Holds.UNKNOWN, Holds.SESSION) and saved <= TOLERANCE_TOKENS:
        return None
    return False


def written_since_restart(ledger: Ledger, live: Sequence[Mapping[str, object]] | None,
                          running: Mapping[int, str]) -> frozenset[int]:
    """The slots whose conversation a request sent before the restart was noticed wrote on the new server
    (which started with every slot empty): `/slots`, read after the restart, shows the slot holding at least
    what our last request there left, or still running the request of the owner (`running`: slot -> the
    session whose request this proxy sent there and has no answer for yet)."""
    out = set()
    for entry in live or ():
        sid, n = entry.get("id"), entry.get("n_prompt_tokens")
        if not isinstance(sid, int) or not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            continue
        e = ledger.entry(sid)
        if not e.owner or e.holds is not Holds.SESSION:
            continue
        running_ours = entry.get("is_processing") is True and running.get(sid) == e.owner
        left_there = not entry.get("is_processing") and 0 < e.tokens <= n + 1 and sid not in running
        if running_ours or left_there:
            out.add(sid)
    return frozenset(out)


def pages_void(ledger: Ledger) -> None:
    """The server's restores do not take, so no page of it is restored from now on: a conversation that only its
    page kept (paged out: its loss was `unknown` until then) is gone, as one evicted with no save dir (known, not a
    fault of the proxy)."""
    held = {e.owner for s in range(ledger.total) if (e := ledger.entry(s)).owner
            and ledger.latest.get(e.owner) == e.mark and e.holds in (Holds.SESSION, Holds.PAGE)}
    for key in list(ledger.conversations):
        if key not in held and ledger.gone.get(key) in (None, Cause.UNKNOWN):
            ledger.gone[key] = Cause.EVICTED
