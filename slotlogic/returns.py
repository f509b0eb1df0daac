"""When a session is expected back: its own turn gap, measured, and how surely it is back soon.

Rule 1: pure; times come in as facts (the session table's request and answer times).
Rule 2: one number per session, its *turn gap*: the seconds from an answer's end to the session's next request
        (an agent's tool run and thinking), an exponentially weighted mean of the gaps seen, so one long pause
        moves it but does not replace it.

Theory of operation
-------------------
An agent's session comes back about one turn gap after its last answer. Writing over a conversation costs its
tokens when the owner comes back while another session holds its slot, and the sooner the owner is due, the
surer that is; the one due back last is the cheapest to evict (Belady's choice, estimated). So the measure,
`wanted`, is 1 when the owner is due now and falls with the distance from that moment: before it, the time
left; after it, the time overdue measured in the session's own gaps (an owner absent far longer than its habit,
a parent waiting for a subagent or a user who left, is likely away longer still). A session whose gap is not
measured yet is taken to come back at once, so only its idle time counts.
"""

from __future__ import annotations

GAP_SHARE = 0.3  # the newest gap's share of a session's turn gap
MIN_GAP = 1.0  # seconds: the least gap an absence is measured in (a session that calls back at once)


def next_gap(gap: float | None, seen: float) -> float:
    """The session's turn gap after one more gap `seen` (seconds from its answer's end to its next request)."""
    seen = max(0.0, seen)
    return seen if gap is None else gap + GAP_SHARE * (seen - gap)


def wanted(last_seen: float, gap: float | None, now: float, horizon: float) -> float:
    """How surely the session is back soon, 1 when it is due now: before its expected return (`gap` after it
    was `last_seen`) 1 / (1 + left / horizon); after it 1 / (1 + overdue / its own gap), since an absence is
    long or short by the session's own habit (an agent calling back within a second and silent for five has
    likely finished). Without a measured gap, due at once: 1 / (1 + idle / horizon)."""
    since = max(0.0, now - last_seen)
    if gap is None:
        return 1.0 / (1.0 + since / horizon)
    if since <= gap:
        return 1.0 / (1.0 + (gap - since) / horizon)
    return 1.0 / (1.0 + (since - gap) / max(gap, MIN_GAP))
