"""A request's wait bound on the monotonic clock: when it ends, what is left of it, and a wait cut to it."""

from __future__ import annotations

import time


def deadline(bound: float) -> float | None:
    """When a request whose placement starts now has waited its bound (`slots_wait_bound`, its placement's
    waits included), on the monotonic clock; None: no bound (0)."""
    return time.monotonic() + bound if bound > 0 else None


def left(by: float | None) -> float | None:
    """The seconds until `by` (monotonic), never below 0; None: no bound."""
    return None if by is None else max(0.0, by - time.monotonic())


def within(wait: float, by: float | None) -> float:
    """`wait` seconds, or fewer when the request's bound ends sooner (`by`, monotonic)."""
    rest = left(by)
    return wait if rest is None else min(wait, rest)
