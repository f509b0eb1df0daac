"""Numbers from outside the proxy (a server's answers), checked and bounded where they enter.

Why: a server's numbers size loops and feed running averages. A slot count past any real server's sizes a loop
over every slot id (100,000,000 of them held the event loop and grew the proxy by gigabytes); a speed written
`1e400` parses as infinity, and one infinity in a moving average turns it NaN for good (every estimate after it,
and the status answer, which JSON cannot carry then). So each number is taken only when it is of the right
type, finite, and inside a range no real server leaves: anything else is treated as not said (None), and a slot
count is capped.
"""

from __future__ import annotations

import math
from typing import Any

MAX_SLOTS = 1024            # slots of one server the proxy keeps track of (a larger count is capped)
MAX_COUNT = 1 << 40         # tokens or bytes in one answer: past any context and any slot file
MAX_CTX = 1 << 28           # tokens in one slot's context
MIN_RATE = 1e-3             # tokens (or bytes) a second: slower is a broken clock, not a measurement
MAX_RATE = 1e12             # bytes a second (tokens a second are far below it)
MAX_MS = 1e9                # a server-side timing in milliseconds (~11 days)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def integer(v: Any) -> int | None:
    """`v` when it is an int (not a bool); None otherwise."""
    return v if is_int(v) else None


def count(v: Any, top: int = MAX_COUNT) -> int | None:
    """A count (tokens, bytes): an int in [0, top]; None otherwise."""
    return v if is_int(v) and 0 <= v <= top else None


def slot_id(v: Any) -> int | None:
    """A slot id: an int in [0, MAX_SLOTS); None otherwise (-1 is "none" in llama-server's answers)."""
    return v if is_int(v) and 0 <= v < MAX_SLOTS else None


def slots(v: Any) -> int | None:
    """A server's slot count: a positive int, capped at MAX_SLOTS (the proxy uses ids below it); None otherwise."""
    return min(v, MAX_SLOTS) if is_int(v) and v > 0 else None


def real(v: Any, low: float, high: float) -> float | None:
    """A finite number in [low, high] as a float; None otherwise (NaN and infinities included)."""
    if not isinstance(v, int | float) or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except OverflowError:   # an int past a float's range
        return None
    return f if math.isfinite(f) and low <= f <= high else None


def rate(v: Any) -> float | None:
    """A speed (tokens or bytes a second) from an answer: finite, in [MIN_RATE, MAX_RATE]."""
    return real(v, MIN_RATE, MAX_RATE)


def millis(v: Any) -> float | None:
    """A server-side timing in milliseconds: finite, in [0, MAX_MS]."""
    return real(v, 0.0, MAX_MS)


def finite(v: Any) -> Any:
    """`v` (the proxy's own status figures: dicts, lists, numbers) with every NaN or infinity as None."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: finite(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [finite(x) for x in v]
    return v
