"""Pending, then pinned (`slots_policy=affinity`): llama-server chooses a new session's slot, the proxy keeps it.

Rule 1: a session with no live slot of its own — its first request, its first after a pool resize or a
        restart, and its first after another session took its slot — goes out *pending*: `id_slot: -1` and
        `cache_prompt: true`, so llama-server chooses the slot by prompt similarity (or LRU), where its RAM
        prompt cache can also bring back an evicted conversation (docs/llama-server.md, slot selection).
Rule 2: the slot that ran it is learned from the answer without changing what the client receives, and the
        session is pinned there for the rest of its life (the hot path, as with `auto`).
Rule 3: only a slot in `0 … total_slots-1`, from an answer without an error, is ever learned.

How the slot is learned depends on the route (`Learn`), measured on llama-server (xllamacpp 2026.10):
- `/completion`, `/completions`, `/infill` echo `id_slot` themselves (streams: in the final event);
- chat and `/v1/completions` do not, but a request with `"verbose": true` gets a `"__verbose"` member (the
  native final answer, with `id_slot`); the proxy adds the field and strips the member from the answer
  (`slotlogic.verbose`): ~2 KB plus the prompt's text, once per session;
- `/v1/responses` ignores `verbose`: after the answer, `/slots` is read once and the idle slot whose token
  count is the answer's total (prompt + generated − 1, the last token is never evaluated) is the one. With
  two such slots nothing is learned and the next request is pending again.
A client that sent its own `verbose` keeps it: `true` is read and left in the answer; `false` makes the
proxy fall back to `/slots`.
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
