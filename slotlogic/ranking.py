"""Slot choice for a session the proxy has not pinned yet.

Rule 1: what a slot costs a session not pinned yet is priced here; `placement.assign` keeps the promises
        before it (a session resumes its own slot, a side call gets the reserved one) and claims the choice.
Rule 2: no I/O. Inputs are snapshots (`SlotView` per slot: live `/slots` numbers merged with what the
        state file says about claims); the output is a `Choice`: the slot and a `Why`.
Rule 3: never return a slot outside `0 … total_slots-1`.

Theory of operation
-------------------
A slot is *claimed* when some session (of any proxy process sharing the state file) used it within the
TTL; otherwise it is *free*, whatever it still holds. Policies:

`seed` (the design's first ranking, verbatim): free before claimed; among free, fewest cached tokens, then
lowest id; among claimed, oldest `last_used`, then fewest tokens, then lowest id.

`auto` (default) ranks by one cost (`Asking.cost`, docs/scheduler.md), in prefill tokens, which at the
server's one prefill rate are seconds: the session's own prefill beyond what the slot spares (a free slot
still holding its shared prefix), plus the tokens of whatever conversation it writes over, weighed by how surely
its owner is back soon (`owner_wanted`: by the owner's own turn gap, `slotlogic.returns`; the farthest return is
the cheapest eviction; as little as an expired claim for a parent waiting for the subagent that just started;
with paging a save and a restore instead of a prefill). The reserved side slot's prompt weighs 1: the next side
call comes.
One filter stays outside the price: a busy slot only when every slot is busy (llama-server defers a request
pinned to a busy slot and unpinned requests starve behind it), then the shortest expected wait
(`SlotView.wait_tokens`), the side slot last. A displaced session (its slot ran another session since) is
ranked by the same cost, and leaves its own slot only where `worth_moving` says the target's owner is far less
surely back than the displacer it would otherwise write over.

`affinity` ranks nothing here: a new session's first request goes out with `id_slot: -1` and llama-server
chooses (prompt similarity, then LRU); the slot it chose is pinned from then on (`slotlogic.affinity`).

`hash_slot` is the fallback when the server cannot be asked: a stable digest of the session key modulo the
last known slot count, so every proxy process agrees without coordination.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import Enum

from slotlogic import returns
from slotlogic.reasons import Why


class Policy(Enum):
    AUTO = "auto"
    SEED = "seed"
    AFFINITY = "affinity"  # llama-server chooses a new session's slot, the proxy pins it (slotlogic/affinity.py)
    OFF = "off"


@dataclass(frozen=True)
class SlotView:
    id: int
    n_tokens: int | None = None      # `/slots` n_prompt_tokens; None when unknown
    busy: bool = False               # `/slots` is_processing
    last_used: float | None = None   # newest claim by any session, from the state file
    owner: str | None = None         # session key of that claim
    prefix: str | None = None        # prefix signature of the last content pinned here
    owner_done: float | None = None  # when the owner's last response completed (this process's knowledge)
    wait_tokens: float | None = None  # busy: its expected time to first token in prefill tokens (None: unknown)
    owner_gap: float | None = None   # the owner's turn gap, answer to next request (`returns`; None: not measured)


SPAWN_WINDOW = 3.0  # seconds: a new session this soon after a session's answer is likely its subagent
TURN_GAP = 5.0      # seconds: an owner due back n of these from now is worth 1 / (1 + n) of one due now
PAGE_SHARE = 0.1    # a save and a restore, against prefilling the same tokens again (paging on)
STAY_SHARE = 0.5    # a displaced session moves only onto an owner at most this share as surely back as the displacer
UNSEEN_TOKENS = 1000.0  # a used slot whose count `/slots` did not give: some conversation, priced as a typical one


@dataclass(frozen=True)
class Choice:
    slot: int
    why: Why


def is_claimed(view: SlotView, now: float, ttl: float) -> bool:
    return view.last_used is not None and now - view.last_used < ttl


def _tokens(view: SlotView) -> int:
    return view.n_tokens if view.n_tokens is not None else 0


def _empty(view: SlotView) -> bool:
    return view.n_tokens == 0 or (view.n_tokens is None and view.last_used is None)


def seed_key(view: SlotView, now: float, ttl: float) -> tuple[int, float, int, int]:
    if not is_claimed(view, now, ttl):
        return (0, 0.0, _tokens(view), view.id)
    return (1, view.last_used or 0.0, _tokens(view), view.id)


def holds_prefix(view: SlotView, prefix: str | None) -> bool:
    """The slot's last content starts with the shared prefix `prefix` names."""
    return prefix is not None and view.prefix == prefix and _tokens(view) > 0


@dataclass(frozen=True)
class Asking:
    """What the ranking of one new session weighs slots by, besides the slots themselves. `spawn=False` for a
    displaced session: it is no subagent, so "the owner that just answered is its parent" is void. `paging`: an
    evicted session is paged out and back in."""

    now: float
    ttl: float
    prefix: str | None = None
    reserved: Collection[int] = ()
    spawn: bool = True
    paging: bool = False
    prefix_tokens: float = 0.0    # the length of the stable prefix `prefix` names, in tokens

    def key(self, view: SlotView) -> tuple[object, ...]:
        """Smallest first: idle slots before busy ones (a filter, not a price: llama-server defers a request
        pinned to a busy slot, and unpinned requests starve behind it); among idle slots the lowest `cost`; among
        busy ones the shortest expected wait, the reserved side slot last. Ties: a slot nobody claims, then the
        fewest tokens, then the lowest id."""
        claimed = is_claimed(view, self.now, self.ttl)
        if view.busy:
            wait = float("inf") if view.wait_tokens is None else view.wait_tokens
            return (1, view.id in self.reserved, wait, claimed, _tokens(view), view.id)
        return (0, False, self.cost(view), claimed, _tokens(view), view.id)

    def cost(self, view: SlotView) -> float:
        """What placing the session on an idle slot costs, in prefill tokens (seconds at the server's one rate):
        its own prefill beyond what the slot spares, plus the tokens of another conversation it writes over,
        weighed by how soon that conversation is wanted again (`return_weight`). With paging a live session's
        conversation is saved and restored instead of prefilled again: `PAGE_SHARE` of its tokens."""
        claimed = is_claimed(view, self.now, self.ttl)
        # a live owner's prefix is no saving: an empty slot gets the same prefix from its checkpoint or prefill,
        # and taking it would page out, or prefill again, a conversation promised to its owner
        held = holds_prefix(view, self.prefix) and not claimed
        tokens = float(_tokens(view)) if view.n_tokens is not None or _empty(view) else UNSEEN_TOKENS
        spared = min(float(self.prefix_tokens), tokens) if held else 0.0
        if view.id in self.reserved:  # the side calls' prompt, prefilled again at the next side call, which comes
            weight = 1.0
        elif claimed:
            parent = self.spawn and _spawned_from(view, self.now)  # returns only once its subagent is done
            weight = return_weight(self.ttl) if parent else owner_wanted(view, self.now)
            weight *= PAGE_SHARE if self.paging else 1.0
        else:
            weight = return_weight(self.now - view.last_used) if view.last_used is not None else 0.0
        return max(0.0, tokens - spared) * weight - spared


def return_weight(distance: float) -> float:
    """How much a conversation is worth keeping when its owner is expected back `distance` seconds from now
    (an expired claim: its age; a waiting parent: the TTL), 1 for one due now: the farther its return, the
    likelier its slot would be needed by someone else before then anyway, so the farthest return is the
    cheapest eviction (Belady's choice, estimated)."""
    return 1.0 / (1.0 + max(0.0, distance) / TURN_GAP)


def owner_wanted(view: SlotView, now: float) -> float:
    """How surely the slot's owner is back soon (`returns.wanted`): by its own turn gap after its last answer
    when that is measured, else by its idle time."""
    answered = view.owner_done is not None and view.owner_done >= (view.last_used or 0.0)
    return returns.wanted(activity(view), view.owner_gap if answered else None, now, TURN_GAP)


def activity(view: SlotView) -> float:
    """When the slot's owner was last seen: its last request, or its last answer if that came later."""
    return max(view.last_used or 0.0, view.owner_done or 0.0)


def worth_moving(target: SlotView, own: SlotView, now: float, ttl: float, *, paging: bool = False) -> bool:
    """Whether a displaced session (another session ran on its slot since) should move to `target`, the slot
    its cost chose, rather than stay on its own slot `own`.

    Its conversation is gone from its slot either way. Staying writes over the displacer, moving over
    `target`'s owner, and whoever is written over displaces someone in turn when it comes back: moving spreads
    that chain over every slot, staying keeps it between two sessions on one slot while the others keep
    theirs. So it moves only where the target's owner is not coming back soon: a free slot, or an owner
    whose return is much less sure than the displacer's (`owner_wanted`, by each owner's own turn
    gap: half as sure, or less; a busy displacer counts as sure, as the session would queue behind it).

    With session paging, whoever is evicted comes back from a file in milliseconds, so what is left to
    weigh is waiting: it moves to a free slot, or away from its own slot while that one is busy. Staying
    keeps the page moves on one slot."""
    if target.id == own.id or target.busy:
        return False
    if not is_claimed(target, now, ttl):
        return True
    if paging:
        return own.busy
    displacer = 1.0 if own.busy else owner_wanted(own, now)
    return owner_wanted(target, now) <= STAY_SHARE * displacer


def _spawned_from(view: SlotView, now: float) -> bool:
    """The owner answered moments ago and is idle: an agent that just called a subagent waits for it, so
    its slot is the one whose next request is furthest away (Belady's choice among live sessions)."""
    return (not view.busy and view.owner_done is not None and 0.0 <= now - view.owner_done <= SPAWN_WINDOW)


def _reason(view: SlotView, now: float, ttl: float, prefix: str | None, spawn: bool = True) -> Why:
    if view.busy:
        return Why.ALL_BUSY if view.wait_tokens is None else Why.ALL_BUSY_SHORTEST
    if is_claimed(view, now, ttl):
        return Why.EVICT_WAITING_PARENT if spawn and _spawned_from(view, now) else Why.EVICT_CHEAPEST
    if holds_prefix(view, prefix):
        return Why.FREE_SAME_PREFIX
    if _empty(view):
        return Why.FREE_EMPTY
    return Why.FREE_FEWEST_TOKENS


def choose(policy: Policy, slots: Sequence[SlotView], asking: Asking) -> Choice:
    """The slot for a new session. `slots` must be non-empty and list every slot id once."""
    if not slots:
        raise ValueError("no slots to choose from")
    now, ttl = asking.now, asking.ttl
    if policy is Policy.SEED:
        best = min(slots, key=lambda v: seed_key(v, now, ttl))
        return Choice(best.id, Why.SEED_CLAIMED_COLDEST if is_claimed(best, now, ttl) else Why.SEED_FREE)
    if policy is Policy.AUTO:
        best = min(slots, key=asking.key)
        return Choice(best.id, _reason(best, now, ttl, asking.prefix, asking.spawn))
    raise ValueError(f"policy {policy.value!r} does not choose slots")


def hash_slot(session_key: str, total_slots: int) -> int:
    """Seed 000's fallback: stable across processes and restarts."""
    if total_slots < 1:
        raise ValueError("total_slots must be ≥ 1")
    return int(hashlib.sha256(session_key.encode()).hexdigest(), 16) % total_slots
