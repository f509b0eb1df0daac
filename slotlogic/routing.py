"""Which llama-server a request goes to, when the proxy fronts several (`slots_upstreams`).

A request's destination is (server, slot). Inside one server the slot is chosen as always (`placement`,
`ranking`); this module chooses the server, and says when a server counts as down and when to ask it again.

Rule 1: pure. The driver (`slotkeeper/drivers/pool.py`) gathers one `ServerView` per server (health, `/slots`, the
        shared state's claims, this proxy's in-flight requests) and calls `choose`; the clock comes in.
Rule 2: a session stays where it is. A known session goes back to its server (`go_back`) while that server
        is up; a session the shared state says still owns a slot on some server goes back there, and so does one
        whose conversation is on a server as a page or still in a slot (`kept`: paged back in there instead
        of prefilled on another). Only a new session (or one whose server went down) is placed by cost.
Rule 3: never a down server, while any server is up. With none up, `choose` returns None and the driver
        forwards the request where the client sent it (fail open: the server may be back).
Rule 4: a new session's cost, cheapest first: a free slot that already holds its stable prefix (nothing to
        prefill but its own turn); then a server with a free slot where another session holds (or is computing)
        more of its prompt than a checkpoint would give (`source`: it is copied there, not prefilled again; the
        most shared first); then a server that can restore the prefix from a checkpoint file it can
        read; then the least loaded server: most free slots (no live claim of any proxy, not processing),
        most idle slots, fewest queued requests, fewest slots prefilling; then the order of `slots_upstreams`.
        A side call (nobody's conversation) goes to the least loaded server, whose reserved slot takes it.

Health (`Health`): a refused connection, a failed `/health` or a time-out marks a server down at once (one
log line); a down server is asked again after `backoff(n)` seconds, doubling from `PROBE_MIN` to `PROBE_MAX`;
the first good answer marks it up again (one log line).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from enum import Enum

from slotlogic.paging import SEED_MIN_CHARS
from slotlogic.ranking import SlotView, holds_prefix, is_claimed

PROBE_MIN = 1.0     # seconds before a down server is asked again
PROBE_MAX = 30.0    # the back-off never waits longer than this


class RouteWhy(Enum):
    """Why a request went to the server it went to (the metrics' `reason` label)."""

    HOME = "home"                   # a known session back on its server
    OWNED = "owned"                 # the shared state says the session still owns a slot there
    KEPT = "kept"                   # its conversation is there, as a page or in a slot: paged back in there
    SAME_PREFIX = "same-prefix"     # a free slot there holds the session's stable prefix
    SOURCE = "source"               # a session there holds more of its prompt than a checkpoint gives: copied
    CHECKPOINT = "checkpoint"       # the server can restore the prefix from a checkpoint file
    LEAST_LOADED = "least-loaded"
    SIDE_CALL = "side-call"         # a side call: the least loaded server's reserved slot
    FAILOVER = "failover"           # its server is down: placed again on another
    RETRY = "retry"                 # the request could not reach its server; sent to another before it started
    ONLY = "only"                   # one server up: nothing to choose


@dataclass(frozen=True)
class ServerView:
    """One server as the router sees it, for one request."""

    index: int                       # position in `slots_upstreams` (ties go to the first)
    up: bool = True
    total_slots: int | None = None   # unknown before the first `/props`
    free: int = 0                    # slots with no live claim of any proxy and not processing
    idle: int = 0                    # slots not processing (from `/slots`; all of them when unknown)
    busy: int = 0                    # slots processing (a prompt being prefilled or tokens decoded)
    queued: int = 0                  # this proxy's requests in flight there beyond its busy slots
    same_prefix: bool = False        # a free slot holds the session's stable prefix
    checkpoint: bool = False         # a checkpoint file of the prefix that this server can restore
    owned: bool = False              # the session owns a slot there (shared state)
    kept: bool = False               # the session's conversation is there: a restorable page, or still a slot's
    source: int = 0                  # characters of its prompt a session there gives beyond a checkpoint (a copy)


@dataclass(frozen=True)
class RouteChoice:
    index: int
    why: RouteWhy


def load_key(v: ServerView) -> tuple[int, int, int, int, int]:
    """Smaller is less loaded."""
    return (-v.free, -v.idle, v.queued, v.busy, v.index)


def choose(servers: Sequence[ServerView], *, side: bool = False, home: int | None = None,
           was_down: bool = False) -> RouteChoice | None:
    """The server for one request; None when no server is up. `home`: the server a known session is on;
    `was_down`: the session's server is down (the reason says failover)."""
    up = [v for v in servers if v.up]
    if not up:
        return None
    if home is not None and any(v.index == home for v in up):
        return RouteChoice(home, RouteWhy.HOME)
    least = min(up, key=load_key)
    if len(up) == 1:
        return RouteChoice(up[0].index, RouteWhy.FAILOVER if was_down else RouteWhy.ONLY)
    if side:
        return RouteChoice(least.index, RouteWhy.SIDE_CALL)
    owned = [v for v in up if v.owned]
    if owned:
        return RouteChoice(min(owned, key=load_key).index, RouteWhy.OWNED)
    kept = [v for v in up if v.kept]
    if kept:
        return RouteChoice(min(kept, key=load_key).index, RouteWhy.KEPT)
    for flag, why in ((lambda v: v.same_prefix and v.free > 0, RouteWhy.SAME_PREFIX),
                      (lambda v: v.source > 0 and v.free > 0, RouteWhy.SOURCE),
                      (lambda v: v.checkpoint and v.free > 0, RouteWhy.CHECKPOINT)):
        hits = [v for v in up if flag(v)]
        if hits:
            return RouteChoice(min(hits, key=lambda v: (-v.source, *load_key(v))).index, why)
    return RouteChoice(least.index, RouteWhy.FAILOVER if was_down else RouteWhy.LEAST_LOADED)


@dataclass(frozen=True)
class GoBack:
    """A session a server of the pool still knows goes back there: candidate `index`, whose keeper answers
    from its own memory first (`resume`: another server parsed the request); None: the server that parsed it."""

    index: int | None

    @property
    def resume(self) -> bool:
        return self.index is not None


def go_back(knows: Sequence[bool], first: int | None, first_knows: bool, first_up: bool) -> GoBack | None:
    """Rule 2 for a session a server still holds live (`knows`, one per candidate server): another candidate
    than the server its request was parsed for (`first`, its candidate index or None) wins, since the parsing
    server would have placed it from memory; else the parsing server while it is up. None: the session is new
    to every candidate, and `choose` places it."""
    for i, known in enumerate(knows):
        if known and i != first:
            return GoBack(i)
    return GoBack(None) if first_knows and first_up else None


def failed_over(previous_up: bool | None, previous_avoided: bool) -> bool:
    """The session's last server (None: it had none) is down, or this request could not reach it."""
    return previous_up is not None and (not previous_up or previous_avoided)


def wants_free(shown: Sequence[ServerView], chosen: ServerView, side: bool) -> bool:
    """A session placed on a server that showed a free slot (`chosen`, as first seen) takes one there (a claim
    that finds every slot taken since, by another proxy, routes again) while some server still shows one
    (`shown`, the full ones as `full` made them); a side call never does (its reserved slot is not free)."""
    return not side and chosen.free > 0 and any(v.up and v.free > 0 for v in shown)


def beyond(shared: int, checkpoint: int) -> int:
    """A server's `source`: the characters a copy there gives beyond what a checkpoint restore gives, when that is
    worth a save and a restore (`paging.SEED_MIN_CHARS`, as a seed must be); else 0."""
    return shared if shared >= checkpoint + SEED_MIN_CHARS else 0


def full(v: ServerView) -> ServerView:
    """`v` once a claim there found every slot taken: nothing free, nothing held free, nothing kept free."""
    return replace(v, free=0, same_prefix=False, checkpoint=False, kept=False, source=0)


def slot_counts(views: Sequence[SlotView], now: float, ttl: float, *, exclude: Collection[int] = ()
                ) -> tuple[int, int, int]:
    """(free, idle, busy) slots of one server from its merged slot views; `exclude` (the reserved side-call
    slots) is not counted as free for a session."""
    free = sum(1 for v in views if not v.busy and not is_claimed(v, now, ttl) and v.id not in exclude)
    busy = sum(1 for v in views if v.busy)
    return free, len(views) - busy, busy


def holds_prefix_free(views: Sequence[SlotView], prefix: str | None, now: float, ttl: float) -> bool:
    """A free slot whose last content starts with `prefix` (what `ranking` calls free-same-prefix)."""
    if prefix is None:
        return False
    return any(not v.busy and not is_claimed(v, now, ttl) and holds_prefix(v, prefix) for v in views)


# ------------------------------------------------------------------------------------------- health


class Change(Enum):
    """What a health observation changed (the driver logs a change once)."""

    NONE = "none"
    WENT_DOWN = "went-down"
    CAME_BACK = "came-back"


def backoff(failures: int) -> float:
    """Seconds before a down server is asked again after `failures` failed probes in a row."""
    return min(PROBE_MAX, PROBE_MIN * (2 ** max(0, failures - 1)))


@dataclass
class Health:
    """One server's health, as this proxy saw it."""

    up: bool = True
    failures: int = 0            # failed probes in a row
    down_since: float | None = None
    next_probe: float = 0.0      # when a down server is asked again

    def failed(self, now: float) -> Change:
        self.failures += 1
        self.next_probe = now + backoff(self.failures)
        if self.up:
            self.up, self.down_since = False, now
            return Change.WENT_DOWN
        return Change.NONE

    def ok(self, now: float) -> Change:
        self.failures, self.next_probe = 0, 0.0
        if not self.up:
            self.up, self.down_since = True, None
            return Change.CAME_BACK
        return Change.NONE

    def due(self, now: float) -> bool:
        """Whether a down server should be asked again now."""
        return not self.up and now >= self.next_probe
