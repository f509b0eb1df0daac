"""Pending, then pinned (`slots_policy=affinity`): llama-server chooses a new session's slot, the proxy keeps it.

A session with no live slot of its own goes out pending (`id_slot: -1`), so llama-server chooses by prompt
similarity and its RAM cache; the slot that ran it is learned from the answer, without changing what the
client receives, and the session stays pinned there. How depends on the route (`Learn`): an echoed `id_slot`,
the `__verbose` member the proxy asks for and strips (`slotlogic.verbose`), or one `/slots` read matching the
answer's token total. Only a valid slot from an answer without an error is learned. See docs/behaviour.md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Any

from slotlogic.endpoints import normalise_path

ECHO_PATHS = frozenset({"/completion", "/completions", "/infill"})
VERBOSE_PATHS = frozenset({"/chat/completions", "/v1/chat/completions", "/v1/completions"})


class Learn(Enum):
    """How the slot of a pending request is found out."""

    ECHO = "echo"               # the answer carries `id_slot` (native routes)
    VERBOSE = "verbose"         # the proxy added `"verbose": true`: read `__verbose.id_slot`, strip the member
    CLIENT_VERBOSE = "client"   # the client asked for `verbose` itself: read it, leave the answer alone
    SLOTS = "slots"             # match `/slots` after the answer (`/v1/responses`, or a client's verbose:false)


def method(path: str, body: Mapping[str, Any]) -> Learn:
    p = normalise_path(path)
    if p in ECHO_PATHS:
        return Learn.ECHO
    if p in VERBOSE_PATHS:
        if "verbose" not in body:
            return Learn.VERBOSE
        return Learn.CLIENT_VERBOSE if body.get("verbose") is True else Learn.SLOTS
    return Learn.SLOTS


def valid(slot: Any, total_slots: int | None) -> bool:
    return (isinstance(slot, int) and not isinstance(slot, bool) and slot >= 0
            and (total_slots is None or slot < total_slots))


def slot_from_slots(live: Sequence[Mapping[str, Any]], total_tokens: int | None,
                    total_slots: int | None) -> int | None:
    """The slot that just ran a request of `total_tokens` tokens (prompt + generated), from `/slots`: the one
    idle slot holding that many tokens minus the last one (never evaluated), or exactly that many. None when
    no slot or more than one slot fits."""
    if not isinstance(total_tokens, int) or total_tokens <= 0:
        return None
    for want in (total_tokens - 1, total_tokens):
        fits = [e.get("id") for e in live if not e.get("is_processing") and e.get("n_prompt_tokens") == want
                and valid(e.get("id"), total_slots)]
        if len(fits) == 1:
            return fits[0]
        if fits:
            return None
    return None
