"""The page budget in force for one server's save dir, and with that dir out of reach the size of the ring of
page names (`slotlogic.paging.ring_file`).

Why here: the budget sized from the model (`slotlogic.paging.auto_budget`) needs the save dir's free space, read
once when paging starts (never on a request's path), and the sizes the core knows as they are learned.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable
from pathlib import Path

from slotlogic import paging

MAX_RING = 4096           # page names of a save dir out of reach, at most
FILE_HEADER_BYTES = 4096  # a slot file's bytes beyond its tokens' KV (a generous bound)


class PageBudget:
    def __init__(self, save_dir: Path | None, max_bytes: int) -> None:
        self.save_dir = save_dir
        self.max_bytes = max_bytes  # the user's budget (or the floor, when `auto`)
        self.auto = False           # sized from the model and the slots
        # the slots, a slot's context and the KV bytes a token as known now
        self.sizes: Callable[[], tuple[int | None, int | None, float | None]] = lambda: (None, None, None)
        self._free: int | None = None
        with contextlib.suppress(OSError):
            self._free = shutil.disk_usage(save_dir).free if save_dir is not None else None

    def bytes(self) -> int:
        """The page budget in bytes: the user's, or sized from the model and the slots."""
        return paging.auto_budget(*self.sizes(), self._free) if self.auto else self.max_bytes

    def ring_size(self) -> int:
        """With the save dir out of reach, how many page names the budget allows: each file may grow to a full
        context of KV, so that many full files fit. Until a save has shown the KV size, one a slot and one more
        (what evicting every slot once needs; within a budget sized from the model, which holds two a slot).
        0: names unbounded."""
        if self.save_dir is not None:
            return 0
        slots, n_ctx, per_token = self.sizes()
        if not n_ctx or not per_token:
            return (slots or 0) + 1
        return max(1, min(MAX_RING, self.bytes() // int(n_ctx * per_token + FILE_HEADER_BYTES)))


def checkpoint_buckets(cap: int, n_ctx: int | None, per_token: float | None) -> int:
    """With the save dir out of reach, how many checkpoint names the checkpoint cap allows: that many files of a
    full context fit (one until a save has shown the KV size; no cap: the page ring's bound)."""
    if not n_ctx or not per_token:
        return 1
    if cap <= 0:
        return MAX_RING
    return max(1, min(MAX_RING, cap // int(n_ctx * per_token + FILE_HEADER_BYTES)))
