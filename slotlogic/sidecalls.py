"""Side calls: one-off requests with their own system prompt (pi's compaction, OpenCode's title generator,
Qwen Code's memory extraction after every turn).

Each would otherwise be a new "session", evicting a working session's slot (OpenCode's title call even
carries the main session's headers). Seed 003 sends them to one reserved slot; we do the same when there are
≥ 2 slots. Calls of one kind share their long system prompt, so that slot mostly keeps it warm for the next.
What each client sends: docs/clients.md.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

DEFAULT_SIDE_PATTERNS = (
    r"^You are a context summarization assistant",                       # pi: compaction
    r"(?i)^\s*summari[sz]e the (following )?conversation",
    r"(?i)^Generate a (short|concise) title",
    r"^You are a title generator",                                       # OpenCode: the session's title
    r"^You are now acting as the managed memory extraction subagent",    # Qwen Code: memory after each turn
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
