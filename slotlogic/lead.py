"""Leads: how far a new session's prompt runs along another session's conversation, message by message.

Why: sessions of one client in one folder share far more than a system prompt, and a conversation moves
between slots in milliseconds, so a new session can start from a copy of the one it shares the most with
(`paging.Seed`). A lead is a chain of digests over the leading messages (no text; unrendered `id` fields left
out) with their cumulative lengths, bounded by `MAX_ITEMS`. Too high an estimate costs a save and a restore,
never a wrong answer. docs/paging.md ("Seeds") explains when a seed is used.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slotlogic.session import canonical, digest, message_text

MAX_ITEMS = 32  # 4,096 remembered sessions x 32 digests: ~12 MB at most
MAX_MESSAGES = 20_000  # a longer message list is not followed (no real conversation has it; each costs a digest)
UNRENDERED = frozenset({"id"})  # Responses items carry per-session ids the template never renders


@dataclass(frozen=True)
class Lead:
    digests: tuple[str, ...]  # digest of messages[0..i], tools and template kwargs
    chars: tuple[int, ...]    # text characters of messages[0..i]


def of(body: Mapping[str, Any]) -> Lead | None:
    """The lead of a chat body (`messages`) or a Responses body (`input` items); None for anything else."""
    items = body.get("messages")
    if not isinstance(items, list):
        items = body.get("input")
    if not isinstance(items, list) or not items:
        return None
    chain = digest("lead", canonical(body.get("tools") or None), canonical(body.get("chat_template_kwargs") or None))
    digests: list[str] = []
    chars: list[int] = []
    total = 0
    for item in items[:MAX_ITEMS]:
        if not isinstance(item, Mapping):
            break
        rendered = {k: v for k, v in item.items() if k not in UNRENDERED}
        chain = digest(chain, canonical(rendered))
        total += len(message_text(item.get("content")))
        digests.append(chain)
        chars.append(total)
    return Lead(tuple(digests), tuple(chars)) if digests else None


def shared(a: Lead | None, b: Lead | None) -> tuple[int, int]:
    """(messages, characters) the two leads share from the start."""
    if a is None or b is None:
        return 0, 0
    n = 0
    for x, y in zip(a.digests, b.digests, strict=False):
        if x != y:
            break
        n += 1
    return n, (a.chars[n - 1] if n else 0)


Mark = tuple[int, str]  # (messages, digest over all of them): a request's conversation, no text kept


def extends(body: Mapping[str, Any], previous: Mark | None) -> tuple[bool | None, Mark | None]:
    """Whether `body`'s messages start with every message of the session's previous request (`previous`), and
    this request's own mark. None: not known (no previous mark, or not a message list). One pass of digests:
    the same cost as the parse that preceded it, on the slow path only."""
    items = body.get("messages")
    if not isinstance(items, list):
        items = body.get("input")
    if not isinstance(items, list) or len(items) > MAX_MESSAGES:
        return None, None
    chain = digest("conversation", canonical(body.get("tools") or None))
    at_previous = None
    for i, item in enumerate(items):
        if previous is not None and i == previous[0]:
            at_previous = chain
        rendered = {k: v for k, v in item.items() if k not in UNRENDERED} if isinstance(item, Mapping) else item
        chain = digest(chain, canonical(rendered))
    if previous is not None and previous[0] == len(items):
        at_previous = chain
    mark = (len(items), chain)
    if previous is None:
        return None, mark
    return at_previous == previous[1], mark
