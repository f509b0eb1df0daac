"""Side calls: short requests with their own system prompt (pi's compaction/summarisation, title generation).

They carry no session header and would otherwise be a new "session" each time, evicting a working
session's slot. Seed 003 sends them to one reserved slot; we do the same when there are ≥ 2 slots.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

DEFAULT_SIDE_PATTERNS = (
    r"^You are a context summarization assistant",
    r"(?i)^\s*summari[sz]e the (following )?conversation",
    r"(?i)^Generate a (short|concise) title",
)


def compile_patterns(patterns: Iterable[str]) -> list[re.Pattern[str]]:
    """Compile, raising ValueError naming the bad pattern."""
    out = []
    for p in patterns:
        try:
            out.append(re.compile(p))
        except re.error as e:
            raise ValueError(f"bad side-call pattern {p!r}: {e}") from e
    return out


def is_side_call(system: str | None, patterns: Iterable[re.Pattern[str]]) -> bool:
    if not system:
        return False
    return any(p.search(system) for p in patterns)


def side_slot(total_slots: int, configured: int = -1) -> int | None:
    """The reserved slot: the configured one, else the highest id; None with fewer than 2 slots."""
    if total_slots < 2:
        return None
    if 0 <= configured < total_slots:
        return configured
    return total_slots - 1
