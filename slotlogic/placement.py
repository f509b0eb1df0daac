"""A slot for a session this process cannot answer from memory, claimed in the shared state.

Rule 1: pure. The driver holds the state file's lock, reads `/slots`, and calls `assign`, which changes the
        `ServerState` it is given (the claim) and returns a `Choice`; the driver writes the state back.
Rule 2: a session keeps the slot the state file says it still owns (a restarted proxy keeps its sessions
        where they were); otherwise `ranking.choose` picks, and the claim is recorded at once so that every
        other proxy process sharing the file sees it.
Rule 3: a side call gets a reserved slot when there is one (the one its home claimed, else an idle one:
        `sidecalls.choose_side_slot`), claimed for its home (`sidecalls.home`: one per side-call prompt), so the
        shared state keeps its home's page like a session's.
Rule 4: a trusted client's own valid `id_slot` (`slots_override_client=false`) is the slot the request runs on,
        so it is the slot claimed: the claim follows the slot used, never a slot the request does not touch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from slotlogic import ranking, shared, sidecalls
from slotlogic.paging import CHARS_PER_TOKEN
from slotlogic.ranking import Choice, Policy
from slotlogic.reasons import Why
from slotlogic.server import work_left
from slotlogic.settings import Settings
from slotlogic.table import SessionTable


@dataclass(frozen=True)
class Seeker:
    """Who asks for a slot. `displaced_from`: the slot a displaced session was on; `resume=False` (a session
    found sharing its slot with another process's, `slotlogic.reconcile`) ranks even when the state says the
    slot is still its own; `client_slot`: a trusted client's own valid `id_slot`."""

    key: str
    prefix: str | None            # what the ranking compares slot contents by
    side: bool = False
    displaced_from: int | None = None
    resume: bool = True
    client_slot: int | None = None
    prefix_chars: int = 0         # the length of the stable prefix `prefix` names


@dataclass(frozen=True)
class SlotsSeen:
    """The server's slots as this process sees them for one placement. `pending`: slots other placements of
    this process have chosen and not yet sent their request to (ranked as busy). `written_over(slot, session)`:
    this process knows the slot no longer holds the session's conversation (a side call or another session
    wrote it since): its claim there is not resumed. `ahead` and `decode_cost`: what a busy slot's wait is
    made of (`waits`)."""

    live: Sequence[dict[str, Any]] | None   # `/slots` as read (None: unknown)
    total: int
    local: SessionTable | None = None       # this process's session table
    pending: Collection[int] = ()
    written_over: Callable[[int, str], bool] | None = None
    ahead: Mapping[int, Sequence[int]] = field(default_factory=dict)  # slot -> prompt chars of each request of
    #                                                                   ours open there, oldest (running) first
    decode_cost: float | None = None        # prefill tokens one generated token costs (None: not measured)


def assign(cfg: Settings, state: shared.ServerState, who: Seeker, slots: SlotsSeen, now: float) -> Choice:
    """Choose and claim a slot for a session the table does not hold, or one displaced from
    `who.displaced_from`. A side call learns the slot count here on a server's first request."""
    session_key, prefix, side, displaced_from = who.key, who.prefix, who.side, who.displaced_from
    resume, client_slot = who.resume, who.client_slot
    live_slots, total_slots, local, pending, written_over = (slots.live, slots.total, slots.local, slots.pending,
                                                             slots.written_over)
    reserved = sidecalls.side_slots(total_slots, cfg.side_slot)
    views = shared.views(state, total_slots, list(live_slots) if live_slots is not None else None, local, pending)
    if side and reserved:
        rec = state.sessions.get(session_key)
        owners = {s: r.owner for s, r in state.slots.items()}
        slot = sidecalls.choose_side_slot(reserved, session_key, owners, lambda s: not views[s].busy,
                                          lambda s: views[s].last_used or 0.0)
        shared.claim(state, session_key, slot, now, prefix=prefix, requests=(rec.requests if rec else 0) + 1)
        return Choice(slot, Why.SIDE_CALL)
    if client_slot is not None and 0 <= client_slot < total_slots:
        rec = state.sessions.get(session_key)
        shared.claim(state, session_key, client_slot, now, prefix=prefix, requests=(rec.requests if rec else 0) + 1)
        return Choice(client_slot, Why.CLIENT_SLOT)
    views = waits(views, slots, prefix, who.prefix_chars)
    owned = shared.owned_slot(state, session_key)
    if resume and owned is not None and owned < total_slots and not (written_over and written_over(owned, session_key)):
        view = views[owned]
        claimed_by_other = view.owner not in (None, session_key) and ranking.is_claimed(view, now, cfg.ttl)
        if not claimed_by_other and (not view.busy or all(v.busy for v in views)):
            rec = state.sessions.get(session_key)
            shared.claim(state, session_key, owned, now, prefix=prefix, requests=(rec.requests if rec else 0) + 1)
            return Choice(owned, Why.RESUMED)
    held_back = reserved if cfg.policy is Policy.AUTO and (local is None or local.reserving(now)) else ()
    choice = ranking.choose(cfg.policy, views, ranking.Asking(now, cfg.ttl, prefix, held_back, displaced_from is None,
                                                             cfg.paging, who.prefix_chars / CHARS_PER_TOKEN))
    requests = 1
    if displaced_from is not None and displaced_from < total_slots:
        # with paging its conversation comes back from its page, older than what it left on its own slot when
        # no one wrote over that yet (a placement chose the slot and has not run): it stays and runs there
        still_there = written_over is not None and not written_over(displaced_from, session_key)
        if choice.slot == displaced_from or (cfg.paging and still_there) or not ranking.worth_moving(
                views[choice.slot], views[displaced_from], now, cfg.ttl, paging=cfg.paging):
            choice = Choice(displaced_from, Why.SHARED)
        rec = state.sessions.get(session_key)
        requests = (rec.requests if rec else 0) + 1
    shared.claim(state, session_key, choice.slot, now, prefix=prefix, requests=requests)
    return choice


def waits(views: Sequence[ranking.SlotView], slots: SlotsSeen, prefix: str | None, prefix_chars: int
          ) -> list[ranking.SlotView]:
    """Each busy slot's expected time to first token for this session, in prefill tokens: the work its
    `/slots` entry shows left (`server.work_left`) plus the prompts of ours queued behind it on that slot, or
    without a size from `/slots` every prompt of ours open there, less the shared prefix it holds and would not
    prefill again. Unknown (None) when neither says. The queue counts: three new sessions placed on one busy
    slot within seconds would each see only its running request's work, and the last would wait longest. A slot
    with a request of ours open is busy even before `/slots` shows it running (a turn sent a moment ago)."""
    by_id = {e.get("id"): e for e in slots.live or () if isinstance(e, Mapping)}
    spared = prefix_chars / CHARS_PER_TOKEN
    out = []
    for v in views:
        ours = list(slots.ahead.get(v.id, ()))
        if ours and not v.busy:  # our request sent there has not started yet: it is the slot's next work
            v = replace(v, busy=True)
        if v.busy:
            running = work_left(by_id.get(v.id), slots.decode_cost) if slots.live is not None else None
            if running is not None:
                left: float | None = running + sum(ours[1:]) / CHARS_PER_TOKEN
            else:
                left = sum(ours) / CHARS_PER_TOKEN if ours else None
            if left is not None:
                v = replace(v, wait_tokens=max(0.0, left - (spared if ranking.holds_prefix(v, prefix) else 0.0)))
        out.append(v)
    return out


def fallback(session_key: str, total_slots: int | None) -> Choice | None:
    """No server facts: the stable hash over the last known slot count; None if never known."""
    if not total_slots:
        return None
    return Choice(ranking.hash_slot(session_key, total_slots), Why.HASH_FALLBACK)
