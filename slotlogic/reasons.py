"""Why a request went where it went, as enums: control flow reads these, never log text.

The values are the words the per-request log line and the mitmweb comment show (`why=…`); `render` joins
them the way those lines always have (`displaced:shared`, `free-empty+paged-in`), so recorded logs and golden
files keep their meaning. Changing a value changes only what is printed.
"""

from __future__ import annotations

from enum import Enum


class Why(Enum):
    """The slot a pinned request went to, and why that one."""

    KNOWN = "known"                                 # a live session back on its own slot (the hot path)
    RESUMED = "resumed"                             # the state file says the slot is still this session's
    SIDE_CALL = "side-call"                         # a side call on the reserved slot
    FREE_SAME_PREFIX = "free-same-prefix"           # a free slot that holds the same shared prefix
    FREE_EMPTY = "free-empty"
    FREE_FEWEST_TOKENS = "free-fewest-tokens"
    EVICT_WAITING_PARENT = "evict-waiting-parent"   # the owner just answered: it waits for this subagent
    EVICT_CHEAPEST = "evict-cheapest"
    ALL_BUSY = "all-busy"                           # every slot busy, with work this process cannot size
    ALL_BUSY_SHORTEST = "all-busy-shortest-wait"    # every slot busy: the lowest expected time to first token
    SEED_FREE = "seed-free"
    SEED_CLAIMED_COLDEST = "seed-claimed-coldest"
    SHARED = "shared"                               # a displaced session stays on its own slot
    HASH_FALLBACK = "hash-fallback"                 # the server could not be asked
    CLIENT_SLOT = "client-id_slot"                  # the client chose the slot itself
    MANUAL = "manual"                               # the slots.pin command
    PENDING = "pending"                             # affinity: llama-server chooses (id_slot -1), then pinned
    SIDE_BUSY = "side-busy"                         # a side call moved to a free slot: its own was busy (wait)
    SLOT_BUSY = "slot-busy"                         # a session's turn moved: another's longer work on its slot
    WAIT_BOUND = "wait-bound"                       # moved to a free slot after waiting its bound (wait)


class Unpinned(Enum):
    """Why a request on a completion route goes out without a slot of ours (its answer is still observed)."""

    POLICY_OFF = "policy off"
    IDLE_CLEARED = "passed through: the server clears idle slots into its RAM cache"
    ROUTE = "not pinnable on this server (/v1/messages drops id_slot)"
    UNTRANSLATABLE = "passed natively: not translatable to a chat completion"
    SERVER_UNKNOWN = "unpinned: server unknown"
    FAILED = "unpinned: internal error"
    WAIT_BOUND = "wait-bound"        # held past its wait bound behind our own requests on its slot (scheduler)
    SIDE_BUSY = "side-busy"          # a side call whose slot is busy with longer work than its own prefill


class Passed(Enum):
    """Why a request is not ours at all (forwarded untouched, not observed)."""

    NOT_COMPLETION = "not a completion route"
    NOT_JSON_OBJECT = "body is not a JSON object"
    TOO_LARGE = "body too large to read (slots_max_body_mb)"
    TOO_MANY_ITEMS = "body has too many JSON objects and arrays to read"
    UNLISTED_MODEL = "no server for its model (llama-swap does not list it, or slots_swap_max_models are busy)"


def render(why: Why | None, unpinned: Unpinned | None = None, *, displaced: bool = False,
           paged_in: bool = False, seeded: bool = False) -> str:
    """The `why=` word of the log line and the comment."""
    if unpinned is not None:
        return unpinned.value
    if why is None:
        return "-"
    if why is Why.CLIENT_SLOT:
        return why.value
    text = why.value + ("+paged-in" if paged_in else "+seeded" if seeded else "")
    return f"displaced:{text}" if displaced else text
