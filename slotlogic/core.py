"""The request-side decision: from a request's facts to "pass", "pin to slot N" or "ask the server first".

Rule 1: pure. The adapter (`addon.py`) supplies the facts (method, path, headers, parsed body, the
        in-memory `SessionTable`, the clock) and performs what the returned `Plan` says.
Rule 2: a known, live session is answered here without any I/O: that is the hot path. A known session
        whose slot another session used since (it was *displaced*) is re-placed like a new one.
Rule 3: a new session gets `Plan.need_slot`; the adapter then fetches `/props` + `/slots`, takes the state
        file lock and calls `assign`, which is also pure.

Theory of operation: `plan` classifies the route, resolves the session key (`session.resolve`), spots
side calls, and consults the table. `assign` prefers the slot the state file says the session still owns
(a restarted proxy keeps its sessions where they were), otherwise asks `ranking.choose`, and records the
claim in the state so other proxy processes see it at once.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from slotlogic import prefix as pfx
from slotlogic import ranking, sidecalls
from slotlogic import session as sess
from slotlogic import state as st
from slotlogic.endpoints import Route, classify
from slotlogic.ranking import Choice, Policy


@dataclass(frozen=True)
class Config:
    policy: Policy = Policy.AUTO
    ttl: float = 120.0
    override_client: bool = False
    header_names: tuple[str, ...] = sess.DEFAULT_SESSION_HEADERS
    side_patterns: tuple[re.Pattern[str], ...] = field(
        default_factory=lambda: tuple(sidecalls.compile_patterns(sidecalls.DEFAULT_SIDE_PATTERNS)))
    side_slot: int = -1
    markers: tuple[str, ...] = pfx.DEFAULT_MARKERS
    paging: bool = False  # sessions are paged out/in through slot files (slotlogic.paging)


@dataclass(frozen=True)
class Plan:
    """What to do with one request. `kind`: pass | pin | need_slot | observe."""

    kind: str
    reason: str
    session: sess.SessionId | None = None
    prefix: str | None = None
    side: bool = False
    slot: int | None = None  # pin: the slot; need_slot of a displaced session: the slot it was on
    route: Route = Route.OTHER
    stable: pfx.StablePrefix | None = None  # the shared prefix a checkpoint can warm, when extractable


def plan(cfg: Config, table: st.SessionTable, method: str, path: str, headers: Mapping[str, str],
         body: Any, now: float, *, total_slots: int | None,
         known_prompts: Mapping[str, sess.PromptMark] | None = None) -> Plan:
    route = classify(method, path)
    if route is Route.OTHER:
        return Plan("pass", "not a completion route", route=route)
    if not isinstance(body, dict):
        return Plan("pass", "body is not a JSON object", route=route)
    key = sess.resolve(headers, body, path, header_names=cfg.header_names, known_prompts=known_prompts)
    if route is Route.UNPINNABLE:
        return Plan("observe", "not pinnable on this server (/v1/messages drops id_slot)", key, route=route)
    if cfg.policy is Policy.OFF:
        return Plan("observe", "policy off", key, route=route)
    side = sidecalls.is_side_call(sess.system_text(body, path), cfg.side_patterns)
    placed = _placed(cfg, table, key, side, now, total_slots, route)
    if placed is not None:
        return placed  # the hot path
    live = table.live(key.key, now)
    reason, displaced_from = "new session", None
    if live is not None and (total_slots is None or live.slot < total_slots):
        # Another session ran on this slot since: our conversation is no longer there, so staying has no
        # value of its own; choose again, like a new session (its own slot is one of the candidates).
        reason, displaced_from = "displaced", live.slot
    stable = pfx.extract(body, cfg.markers)
    # What the ranking compares slot contents by: the stable prefix when there is one (windows of two
    # projects share it), else the whole system prompt + tools.
    prefix = stable.signature if stable else sess.prefix_signature(body, path)
    return Plan("need_slot", reason, key, prefix, side=side, slot=displaced_from, route=route, stable=stable)


def _placed(cfg: Config, table: st.SessionTable, key: sess.SessionId, side: bool, now: float,
            total_slots: int | None, route: Route) -> Plan | None:
    """A side call, or a known session still on its slot: answered without I/O. None: it needs a slot."""
    if side and total_slots:
        reserved = sidecalls.side_slot(total_slots, cfg.side_slot)
        if reserved is not None:
            return Plan("pin", "side-call", key, side=True, slot=reserved, route=route)
    live = table.live(key.key, now)
    if live is not None and (total_slots is None or live.slot < total_slots) and not table.displaced(key.key,
                                                                                                   live.slot):
        return Plan("pin", "known", key, live.prefix, side=side, slot=live.slot, route=route)
    return None


def plan_known_body(cfg: Config, table: st.SessionTable, path: str, key: sess.SessionId, side: bool, now: float,
                    *, total_slots: int | None) -> Plan | None:
    """`plan` for a chat body that `fastpath.ShapeIndex` recognised as a known session's next request (same
    root, same top-level fields): the same answer `plan` gives it, without the parse; None when that answer
    is not a cheap one (a new slot is needed), so the caller parses and calls `plan`."""
    route = classify("POST", path)
    if route is not Route.PINNABLE:
        return None
    if cfg.policy is Policy.OFF:
        return Plan("observe", "policy off", key, route=route)
    return _placed(cfg, table, key, side, now, total_slots, route)


def assign(cfg: Config, state: st.ServerState, session_key: str, prefix: str | None,
           live_slots: Sequence[dict[str, Any]] | None, total_slots: int, now: float, *,
           side: bool = False, local: st.SessionTable | None = None,
           displaced_from: int | None = None) -> Choice:
    """Choose and claim a slot for a session the table does not hold, or one displaced from
    `displaced_from` (under the state file lock).

    A side call learns the slot count here on a server's first request; it gets the reserved slot and
    claims nothing (side calls are not sessions)."""
    reserved = sidecalls.side_slot(total_slots, cfg.side_slot)
    if side and reserved is not None:
        return Choice(reserved, "side-call")
    views = st.views(state, total_slots, list(live_slots) if live_slots is not None else None, local)
    owned = st.owned_slot(state, session_key)
    if owned is not None and owned < total_slots:
        view = views[owned]
        claimed_by_other = view.owner not in (None, session_key) and ranking.is_claimed(view, now, cfg.ttl)
        if not claimed_by_other and (not view.busy or all(v.busy for v in views)):
            rec = state.sessions.get(session_key)
            st.claim(state, session_key, owned, now, prefix=prefix, requests=(rec.requests if rec else 0) + 1)
            return Choice(owned, "resumed")
    held_back = reserved if cfg.policy is Policy.AUTO and (local is None or local.reserving(now)) else None
    choice = ranking.choose(cfg.policy, views, now, cfg.ttl, prefix=prefix, reserved=held_back,
                            spawn=displaced_from is None)
    requests = 1
    if displaced_from is not None and displaced_from < total_slots:
        if choice.slot != displaced_from and not ranking.worth_moving(views[choice.slot], views[displaced_from],
                                                                      now, cfg.ttl, paging=cfg.paging):
            choice = Choice(displaced_from, "shared")
        rec = state.sessions.get(session_key)
        requests = (rec.requests if rec else 0) + 1
    st.claim(state, session_key, choice.slot, now, prefix=prefix, requests=requests)
    return choice


def fallback(session_key: str, total_slots: int | None) -> Choice | None:
    """No server facts: seed 000's stable hash over the last known slot count; None if never known."""
    if not total_slots:
        return None
    return Choice(ranking.hash_slot(session_key, total_slots), "hash-fallback")
