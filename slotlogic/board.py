"""What the live slot page (`GET /_slots/`) draws beyond the status view: who held each slot over the last
minutes, the marks on those rows (page-out, page-in, prefix restore, loss), per-session extras (client kind,
losses by cause, pages) and the current warnings.

Fed by the same typed reports and events as the log and the metrics, so it can only show what the proxy
already knew. Everything is bounded (rings and capped tables) and made of digests, counts and enum words:
never prompt text. Pure: the caller hands in the time.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from slotlogic.decisions import Report
from slotlogic.endpoints import ANTHROPIC_PATHS, RESPONSES_PATHS, normalise_path
from slotlogic.events import CheckpointDone, Event, Paged, TokensLost
from slotlogic.session import DEFAULT_SESSION_HEADERS

HORIZON_S = 600.0      # how far back the page's timeline reaches
MAX_SPANS = 2048       # answered requests kept per server (a busy server's last minutes)
MAX_MARKS = 1024       # page-out / page-in / prefix / loss marks kept per server
MAX_WARNINGS = 32      # warning lines kept per server
WARNING_S = 600.0      # a warning is "current" for this long
MAX_SESSIONS = 1024    # sessions' extras kept per server (as many as the keeper's own counters, outcomes.MAX_STATS)

# Client kinds: a fixed vocabulary, so the metrics' `client` label stays bounded whatever clients send.
_NAMED = {
    ("anthropic", "header:x-claude-code-session-id"): "claude-code",
    ("anthropic", "body:metadata.user_id"): "claude-code",
    ("responses", "header:session-id"): "codex",
    ("responses", "body:prompt_cache_key"): "codex",
    ("chat", "header:x-opencode-session"): "opencode",
    ("chat", "header:x-session-affinity"): "opencode-or-pi",
    ("chat", "header:x-session-id"): "opencode-or-pi",
}
_SIGNALS = frozenset({*(f"header:{h}" for h in DEFAULT_SESSION_HEADERS), "body:metadata.user_id",
                      "body:prompt_cache_key", "body:promptCacheKey", "body:user", "content:root",
                      "content:continuation", "content:prompt", "content:body"})


def api_of(path: str) -> str:
    p = normalise_path(path)
    if p in ANTHROPIC_PATHS:
        return "anthropic"
    if p in RESPONSES_PATHS:
        return "responses"
    if p.endswith("/chat/completions"):
        return "chat"
    return "completion"


def client_kind(path: str, source: str) -> str:
    """The client as recognised from its route and session signal: a known client's name, else
    `<api>/<signal>` (a header outside the default list is `header:other`). Always one of a fixed set."""
    api = api_of(path)
    signal = source if source in _SIGNALS else ("header:other" if source.startswith("header:") else "other")
    return _NAMED.get((api, signal), f"{api}/{signal}")


@dataclass
class _Extra:
    client: str = ""
    lost: dict[str, int] = field(default_factory=dict)   # cause -> tokens
    pages_out: int = 0
    pages_in: int = 0


@dataclass
class _Lane:
    spans: deque[tuple[float, float, int, str]] = field(default_factory=lambda: deque(maxlen=MAX_SPANS))
    marks: deque[tuple[float, int, str, str, int]] = field(default_factory=lambda: deque(maxlen=MAX_MARKS))
    warnings: deque[tuple[float, str]] = field(default_factory=lambda: deque(maxlen=MAX_WARNINGS))
    extras: OrderedDict[str, _Extra] = field(default_factory=OrderedDict)

    def extra(self, short: str) -> _Extra:
        e = self.extras.pop(short, None) or _Extra()
        self.extras[short] = e  # most recently touched last
        while len(self.extras) > MAX_SESSIONS:
            self.extras.popitem(last=False)
        return e


class Board:
    """Per server: the recent holders of each slot, the marks, the sessions' extras, the warnings."""

    def __init__(self) -> None:
        self.lanes: dict[str, _Lane] = {}

    def _lane(self, server: str) -> _Lane:
        lane = self.lanes.get(server)
        if lane is None:
            lane = self.lanes[server] = _Lane()
        return lane

    def report(self, r: Report, now: float) -> None:
        lane = self._lane(r.upstream)
        short = r.ticket.session.short
        lane.extra(short).client = client_kind(r.path, r.ticket.session.source)
        if r.slot is not None:
            lane.spans.append((round(now - r.seconds, 3), round(now, 3), r.slot, short))

    def event(self, e: Event, now: float, warning: str | None = None) -> None:
        """`warning`: the event's log line when it is a warning (worded by `slotlogic.wording`)."""
        if warning is not None:
            self._lane(e.upstream).warnings.append((round(now, 3), warning))
        if isinstance(e, Paged):
            lane = self._lane(e.upstream)
            if e.out is not None and e.out_tokens is not None:
                lane.marks.append((round(now, 3), e.slot, "page-out", e.out, e.out_tokens))
                lane.extra(e.out).pages_out += 1
            if e.into is not None and e.in_tokens is not None:
                lane.marks.append((round(now, 3), e.slot, "seed" if e.seed else "page-in", e.into, e.in_tokens))
                if not e.seed:
                    lane.extra(e.into).pages_in += 1
        elif isinstance(e, TokensLost) and e.tokens:  # at its answer, or once its cause was asked of the server
            lane = self._lane(e.upstream)
            x = lane.extra(e.session)
            x.lost[e.cause.value] = x.lost.get(e.cause.value, 0) + e.tokens
            if e.slot is not None:
                lane.marks.append((round(now, 3), e.slot, "loss", e.session, e.tokens))
        elif isinstance(e, CheckpointDone) and e.outcome.restored:
            self._lane(e.upstream).marks.append((round(now, 3), e.slot, "prefix", "", e.prompt_n))

    def view(self, server: str, now: float) -> dict[str, Any]:
        """The page's part of one server's status: the last HORIZON_S seconds, the sessions' extras."""
        lane = self.lanes.get(server)
        if lane is None:
            return {"now": round(now, 3), "horizon_s": HORIZON_S, "spans": [], "marks": [], "warnings": [],
                    "sessions": {}}
        since = now - HORIZON_S
        return {
            "now": round(now, 3),
            "horizon_s": HORIZON_S,
            "spans": [{"start": a, "end": b, "slot": s, "session": k} for a, b, s, k in lane.spans if b >= since],
            "marks": [{"t": t, "slot": s, "kind": kind, "session": k, "tokens": n}
                      for t, s, kind, k, n in lane.marks if t >= since],
            "warnings": [{"t": t, "line": line} for t, line in lane.warnings if now - t < WARNING_S],
            "sessions": {k: {"client": x.client, "lost_by_cause": dict(x.lost), "pages_out": x.pages_out,
                             "pages_in": x.pages_in} for k, x in lane.extras.items()},
        }
