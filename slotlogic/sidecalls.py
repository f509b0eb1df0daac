"""Side calls: one-off requests with their own system prompt (pi's compaction, OpenCode's title generator,
Qwen Code's memory extraction after every turn).

Each would otherwise be a new "session", evicting a working session's slot (OpenCode's title call even
carries the main session's headers), so with ≥ 2 slots they go to a reserved slot (credits: docs/design.md).
Calls of one kind share their long system prompt, so that slot mostly keeps it warm for the next; each kind
has a home of its own (`home`): with paging, another kind's content there is paged out first and this kind's
paged back in, so OpenCode's title calls and Qwen Code's memory calls no longer erase each other.
What each client sends: docs/clients.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence

from slotlogic.ledger import Ledger
from slotlogic.session import SessionId, digest

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


def home(signature: str | None, key: SessionId) -> SessionId:
    """A side call's home: one per side-call prompt (its system prompt, tools and template arguments, so per
    client and per kind), under which its slot content is kept, paged out and back in like a session's
    conversation, so one client's side calls never erase another's. `key` (the session it came with) when the
    call has no system prompt to name it by."""
    if signature is None:
        return key
    return SessionId(digest("side-home", signature), "side:prompt")


def at_home(slot: int | None, key: str, ledger: Ledger, writes: bool, paging: bool, paged: bool) -> bool:
    """A side call of home `key` may go to `slot` with no move first (from memory): no placement is under way
    there, no other proxy writes it (`writes`), and the slot holds its home's content, or (with paging) no
    conversation to page out and no page of its home to bring back (`paged`). Otherwise its placement pages the
    slot's holder out and its home's page in."""
    if slot is None or ledger.claimed(slot) or not writes:
        return False
    there = ledger.conversation_on(slot)
    return there == key or not (paging and (there is not None or paged))


SLOTS_PER_SIDE_SLOT = 6  # one more side slot per this many slots (a large pool serves several clients' kinds)
MAX_SIDE_SLOTS = 3


def side_slots(total_slots: int, configured: int = -1) -> tuple[int, ...]:
    """The reserved slots: the configured one, else the highest ids, one for 2-7 slots, two for 8-13, three from
    14 on (several clients' side-call kinds then each keep a home in a slot, not only in a page); none with
    fewer than 2 slots."""
    if total_slots < 2:
        return ()
    if 0 <= configured < total_slots:
        return (configured,)
    n = min(MAX_SIDE_SLOTS, 1 + (total_slots - 2) // SLOTS_PER_SIDE_SLOT)
    return tuple(range(total_slots - 1, total_slots - 1 - n, -1))


def home_slot(slots: Sequence[int], key: str, ledger: Ledger, writes: Callable[[int], bool], paging: bool,
              paged: bool) -> int | None:
    """The side slot a side call of home `key` goes to from memory (`at_home`): the one holding its home's
    content; else, without paging, its home's own (`_own`)."""
    if not slots:
        return None
    for slot in slots:
        if ledger.conversation_on(slot) == key and at_home(slot, key, ledger, writes(slot), paging, paged):
            return slot
    mine = _own(slots, key)
    return mine if at_home(mine, key, ledger, writes(mine), paging, paged) else None


def choose_side_slot(slots: Sequence[int], key: str, owners: Mapping[int, str | None],
                     idle: Callable[[int], bool], last_used: Callable[[int], float]) -> int:
    """A side call's placement: the side slot its home claimed (the shared state's `owners`), else an idle one,
    the least recently used first, else its home's own (`_own`)."""
    for slot in slots:
        if owners.get(slot) == key:
            return slot
    free = [s for s in slots if idle(s)]
    if free:
        return min(free, key=lambda s: (last_used(s), s))
    return _own(slots, key)


def _own(slots: Sequence[int], key: str) -> int:
    """Its home's own side slot: a stable hash of the home's key, so kinds spread over the side slots."""
    hexed = len(key) >= 8 and all(c in "0123456789abcdef" for c in key[:8])
    return slots[int(key[:8], 16) % len(slots)] if hexed else slots[0]
