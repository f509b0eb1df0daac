"""Which models a request is about to unload, and which of their slots to page out first.

Why: a server that holds a bounded number of models (llama-swap's swap groups, llama-server's router mode with
`--models-max`) unloads a model to load another, and every slot of the unloaded model is lost: each of its
conversations prefills from zero on its next turn. Saved before the swap, each one is paged back in when its
session returns (the page index survives the swap; a page restores only under the identity that wrote it,
`paging.restorable`). Pure: the driver asks the swapper what is loaded, and performs the saves within a bound.
docs/model-swaps.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from slotlogic.ledger import tolerance
from slotlogic.paging import MIN_TOKENS, PageRecord, restorable

HOLD_SECONDS = 20.0   # the longest a request that swaps a model out waits for that model's pages to be written
MAX_TOGETHER = 256    # pairs of models learned to stay loaded together (a bound: the names are the swapper's)


@dataclass(frozen=True)
class SwapFacts:
    """What is known of one swapper when a request for `model` comes. `loaded`: the models loaded now, as the
    swapper says (llama-swap's `/running`, the router's `/models`). `max_loaded`: the router's `--models-max`
    (None: llama-swap, whose default group holds one model at a time). `recency`: the router's loaded models,
    least recently used first (it unloads the least recently used). `together`: pairs of models seen loaded at
    the same time (another swap group, or a group with `swap: false`): loading one leaves the other."""

    model: str
    loaded: frozenset[str]
    max_loaded: int | None = None
    recency: tuple[str, ...] = ()
    together: frozenset[frozenset[str]] = frozenset()


def unloads(f: SwapFacts) -> frozenset[str]:
    """The loaded models that loading `f.model` unloads: none when it is loaded already; with a router's cap, the
    least recently used beyond it; with llama-swap, every loaded model not seen loaded together with it."""
    if not f.model or f.model in f.loaded or not f.loaded:
        return frozenset()
    if f.max_loaded is not None:
        if f.max_loaded <= 0 or len(f.loaded) < f.max_loaded:
            return frozenset()
        order = [m for m in f.recency if m in f.loaded]
        order += sorted(f.loaded - set(order))
        return frozenset(order[:len(f.loaded) - f.max_loaded + 1])
    return frozenset(m for m in f.loaded if frozenset((m, f.model)) not in f.together)


def learn(together: frozenset[frozenset[str]], loaded: Iterable[str]) -> frozenset[frozenset[str]]:
    """`together` with every pair of `loaded` (models the swapper showed loaded at once), bounded."""
    names = sorted(set(loaded))
    pairs = {frozenset((a, b)) for i, a in enumerate(names) for b in names[i + 1:]}
    out = together | pairs
    return out if len(out) <= MAX_TOGETHER else together


@dataclass(frozen=True)
class Held:
    """One slot as the ledger has it: the session whose current conversation it holds, and how many tokens."""

    slot: int
    session: str | None
    tokens: int


def to_save(held: Sequence[Held], pages: Mapping[str, PageRecord], identity: str) -> list[Held]:
    """The slots to page out before their model is unloaded: each holding a session's conversation long enough
    to be worth a page (`paging.MIN_TOKENS`), unless a restorable page of that session already holds all of it."""
    out = []
    for h in held:
        if not h.session or h.tokens < MIN_TOKENS:
            continue
        rec = pages.get(h.session)
        if restorable(rec, identity) and rec is not None and rec.n_tokens + tolerance(h.tokens) >= h.tokens:
            continue
        out.append(h)
    return out
