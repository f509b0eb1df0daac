"""The scheduler: where and when a request runs, as one pick among explicit candidate actions.

Rule 1: pure. The caller passes a snapshot (what runs ahead, the measured rates, what each slot holds and who
        is promised it, how long the request has waited); the result is a `Pick`, nothing is done here.
Rule 2: filters keep promises and never weigh seconds; the score weighs seconds and never keeps promises.
Rule 3: one cost, in expected seconds: this request's time to first token plus what the plan costs others.

Candidates (an `Action` on a slot, with `ttft` and `others` estimates), the promise and patience filters, the
score's ties and the decision record: docs/scheduler.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

CHARS_PER_TOKEN = 4  # a body's bytes per prompt token, roughly (JSON and English text)
PATIENCE_BOUNDS = 3.0  # a client's patience is this many wait bounds: holding, staying, then going


class Action(Enum):
    """What can be done with a request, in the order ties are broken."""

    HOLD = "hold"                      # held in the proxy until one of our requests ends, then decided again
    RUN_OWN = "run-own"                # sent pinned to its own slot now (queued there behind the work ahead)
    MOVE_FREE = "move-free"            # pinned to a slot that holds nothing promised to anyone
    SERVER_CHOOSES = "server-chooses"  # sent with `id_slot: -1`: the server runs it on the slot it likes


@dataclass(frozen=True)
class Candidate:
    action: Action
    slot: int | None = None
    ttft: float | None = None   # seconds to this request's first token (None: no rate measured)
    others: float = 0.0         # seconds the plan costs other sessions
    until: float = 0.0          # HOLD: the waited seconds at which it is decided again at the latest
    given_away: bool = False    # SERVER_CHOOSES past the client's patience: a promise given up, and labelled

    @property
    def cost(self) -> float:
        return math.inf if self.ttft is None else self.ttft + self.others


@dataclass(frozen=True)
class Pick:
    chosen: Candidate
    runner_up: Candidate | None = None
    removed: tuple[tuple[Action, str], ...] = field(default_factory=tuple)  # (action, the filter that removed it)


def pick(candidates: Iterable[Candidate], removed: Iterable[tuple[Action, str]] = ()) -> Pick:
    """The lowest cost among what the filters left; ties by the order of `Action`, then the slot."""
    order = list(Action)
    ranked = sorted(candidates, key=lambda c: (c.cost, order.index(c.action), -1 if c.slot is None else c.slot))
    if not ranked:
        raise ValueError("no candidate left to pick")
    return Pick(ranked[0], ranked[1] if len(ranked) > 1 else None, tuple(removed))


def seconds(chars: int, rate: float | None) -> float | None:
    """Seconds to prefill `chars` of body at `rate` prompt tokens a second (None: no rate measured yet)."""
    if not rate or rate <= 0 or not math.isfinite(rate):
        return None
    return chars / CHARS_PER_TOKEN / rate


def patience(bound: float) -> float:
    """How long a request may be held in all: the client's patience, of which the bound is a third."""
    return PATIENCE_BOUNDS * bound


def stay_limit(own: float | None, bound: float) -> float:
    """Past the bound, how long a hold for its own slot may go on while a move is possible: its own prefill's
    time past the bound, at most two bounds."""
    return bound + min(own or 0.0, 2 * bound)


# ------------------------------------------------------------------------------------------- a held request


@dataclass(frozen=True)
class Held:
    """A request pinned to its own slot while our earlier requests run there.

    `ahead_chars`: their prompts' characters (their prefill work at most); `waited`: seconds since the request
    reached the proxy; `bound`: the wait bound (0: never held); `own_chars`: its own body's characters;
    `rate`: the measured prefill rate (tokens/s); `free`: a slot that holds nothing promised and may run it now;
    `idle`: some slot runs nothing of ours (the server's own choice would start it now), else `soonest_chars`:
    our work on the other slot expected to free first (None: unknown); `exposed`: the promised tokens the
    server's own choice could write over (0: it can only land where nothing is promised)."""

    ahead_count: int
    ahead_chars: int
    waited: float
    bound: float
    own_chars: int
    rate: float | None
    free: int | None = None
    idle: bool = True
    exposed: int = 0
    soonest_chars: int | None = None


def held_candidates(h: Held) -> tuple[list[Candidate], list[tuple[Action, str]]]:
    """The candidates for a held request that the filters leave, and what they removed. Before its bound a
    request leaves its own slot (its cache) only for a free slot; from its bound on the server may choose."""
    own = seconds(h.own_chars, h.rate)
    left = _left(h.ahead_chars, h)
    past, spent = h.waited >= h.bound, h.waited >= patience(h.bound)
    home = Candidate(Action.RUN_OWN, ttft=left)
    elsewhere: list[Candidate] = []
    removed: list[tuple[Action, str]] = []
    if h.free is not None:
        elsewhere.append(Candidate(Action.MOVE_FREE, h.free, ttft=own))
    if past and h.exposed > 0 and not spent:
        removed.append((Action.SERVER_CHOOSES, "promise"))
    elif past:
        queue = 0.0 if h.idle else None if h.soonest_chars is None else _left(h.soonest_chars, h)
        lost = seconds(h.exposed * CHARS_PER_TOKEN, h.rate) or 0.0
        elsewhere.append(Candidate(Action.SERVER_CHOOSES, ttft=None if own is None or queue is None else queue + own,
                                   others=lost, given_away=h.exposed > 0))
    out = [home, *elsewhere]
    starts_now = h.free is not None or (any(c.action is Action.SERVER_CHOOSES for c in elsewhere) and h.idle)
    if past and starts_now and (left is None or h.waited >= stay_limit(own, h.bound)):
        out.remove(home)  # its slot's estimate had its time (or there is none) against a slot that starts it now
        removed.append((Action.RUN_OWN, "patience"))
    hold = _hold(h, home, own, elsewhere, past, spent)
    if hold is None:
        removed.append((Action.HOLD, "patience"))
    else:
        out.insert(0, hold)
    return out, removed


def _left(chars: int, h: Held) -> float | None:
    """Seconds of `chars` of prompt work still to run, started no later than the request arrived."""
    total = seconds(chars, h.rate)
    return None if total is None else max(0.0, total - h.waited)


def _hold(h: Held, home: Candidate, own: float | None, elsewhere: list[Candidate], past: bool, spent: bool
          ) -> Candidate | None:
    """The hold, while the patience filter allows it (None: removed)."""
    if not past:
        return Candidate(Action.HOLD, ttft=home.ttft, until=h.bound)
    if spent:
        return None
    if not elsewhere:  # its own slot is the only place it may run without breaking a promise
        return Candidate(Action.HOLD, ttft=home.ttft, until=patience(h.bound))
    limit = stay_limit(own, h.bound)
    if home.ttft is not None and h.waited < limit and home.cost <= min(c.cost for c in elsewhere):
        return Candidate(Action.HOLD, ttft=home.ttft, until=limit)
    return None


def decide_held(h: Held) -> Pick:
    """What to do now with a request held behind our own requests on its slot."""
    if h.bound <= 0 or h.ahead_count <= 0:
        return Pick(Candidate(Action.RUN_OWN, ttft=0.0))
    candidates, removed = held_candidates(h)
    return pick(candidates, removed)
