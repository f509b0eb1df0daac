"""Counters behind `/_slots/metrics`, fed by the typed reports and events: a few dict additions per request.

Keyed by (server URL, slot id): never a session, never prompt text. `slotkeeper/mitm/metrics.py` renders them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from slotlogic.board import client_kind
from slotlogic.checkpoint_machine import Outcome
from slotlogic.decisions import Report
from slotlogic.events import STALE_MOVES, CheckpointDone, Event, Paged, StalePlan, TokensLost
from slotlogic.ledger import Cause

Key = tuple[str, str]   # (server, slot)


class Tally:
    """Plain counters, keyed by (server, slot)."""

    def __init__(self) -> None:
        self.requests: defaultdict[Key, int] = defaultdict(int)
        self.prefill: defaultdict[Key, int] = defaultdict(int)
        self.cached: defaultdict[Key, int] = defaultdict(int)
        self.paged_in: defaultdict[Key, int] = defaultdict(int)
        self.page_ops: defaultdict[tuple[str, str, str], int] = defaultdict(int)    # + direction
        self.page_seconds: defaultdict[Key, float] = defaultdict(float)
        self.checkpoints: defaultdict[tuple[str, str, str], int] = defaultdict(int)  # + outcome
        self.checkpoint_seconds: defaultdict[Key, float] = defaultdict(float)
        self.lost: defaultdict[tuple[str, str, str], int] = defaultdict(int)   # (server, cause, expected)
        self.stale_plans: defaultdict[tuple[str, str], int] = defaultdict(int)  # (server, move)
        self.servers: set[str] = set()
        # (server, client kind): what pinning saved, per client (`slotlogic.board.client_kind`, a fixed set)
        self.client_requests: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.reused: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.saved_s: defaultdict[tuple[str, str], float] = defaultdict(float)
        self.client_lost: defaultdict[tuple[str, str, str], int] = defaultdict(int)   # + cause

    # Every labelled counter lists each of its labels' known values at 0 until it counts one (the servers
    # fronted and their slots from the start, the causes, directions, outcomes and moves from their enums): a
    # dashboard's panel of a fresh proxy reads 0, not "no data". `slots`: server URL -> its slot count.

    def lost_by_cause(self, slots: Mapping[str, int] | None = None) -> dict[tuple[str, str, str], int]:
        """Tokens lost per (server, cause, expected)."""
        out = {(srv, c.value, _expected(c)): 0 for srv in self.servers | set(slots or {}) for c in Cause}
        out.update(self.lost)
        return out

    def client_lost_by_cause(self) -> dict[tuple[str, str, str, str], int]:
        """Tokens lost per (server, client kind, cause, expected), every cause of every client seen."""
        out = {(srv, client, c.value, _expected(c)): 0 for srv, client in self.client_requests for c in Cause}
        for (srv, client, cause), v in self.client_lost.items():
            out[(srv, client, cause, _expected(Cause(cause)))] = v
        return out

    def page_ops_all(self, slots: Mapping[str, int]) -> dict[tuple[str, str, str], int]:
        """Pages written (out) and read (in) per (server, slot, direction)."""
        out = {(srv, str(s), d): 0 for srv, n in slots.items() for s in range(n) for d in ("out", "in")}
        out.update(self.page_ops)
        return out

    def checkpoints_all(self, slots: Mapping[str, int]) -> dict[tuple[str, str, str], int]:
        """Prefix checkpoint preparations per (server, slot, outcome)."""
        out = {(srv, str(s), o.value): 0 for srv, n in slots.items() for s in range(n) for o in Outcome}
        out.update(self.checkpoints)
        return out

    def stale_plans_all(self, slots: Mapping[str, int]) -> dict[tuple[str, str], int]:
        """Slot moves dropped as stale per (server, move)."""
        out = {(srv, m): 0 for srv in self.servers | set(slots) for m in STALE_MOVES}
        out.update(self.stale_plans)
        return out

    def report(self, r: Report) -> None:
        key = (r.upstream, "-" if r.slot is None else str(r.slot))
        self.requests[key] += 1
        self.servers.add(r.upstream)
        client = (r.upstream, client_kind(r.path, r.ticket.session.source))
        self.client_requests[client] += 1
        if r.obs.cache_n:
            self.reused[client] += r.obs.cache_n
        self.saved_s[client] += r.saved_s
        if r.obs.prompt_n:
            self.prefill[key] += r.obs.prompt_n
        if r.obs.cache_n:
            self.cached[key] += r.obs.cache_n

    def event(self, e: Event) -> None:
        if isinstance(e, Paged):
            key = (e.upstream, str(e.slot))
            if e.out_tokens is not None:
                self.page_ops[(*key, "out")] += 1
            if e.in_tokens is not None:
                self.page_ops[(*key, "in")] += 1
                self.paged_in[key] += e.in_tokens
            self.page_seconds[key] += e.seconds
        elif isinstance(e, TokensLost):  # at its answer, or once its cause was asked of the server
            self.servers.add(e.upstream)
            self.lost[(e.upstream, e.cause.value, "true" if e.expected else "false")] += e.tokens
            self.client_lost[(e.upstream, e.client or "unknown", e.cause.value)] += e.tokens
        elif isinstance(e, StalePlan):
            self.stale_plans[(e.upstream, e.move)] += 1
        elif isinstance(e, CheckpointDone):
            key = (e.upstream, str(e.slot))
            self.checkpoints[(*key, e.outcome.value)] += 1
            self.checkpoint_seconds[key] += e.seconds


def _expected(cause: Cause) -> str:
    return "true" if cause.expected else "false"
