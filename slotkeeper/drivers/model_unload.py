"""Whether a swapper's model (llama-swap, a router's `--models-max`) is unloaded, as this proxy knows it.

Why apart: the probe must not ask an unloaded model's `/props` (through the swapper that loads it again), and a
request of ours that swaps the model out tells it first (`slotkeeper.drivers.swap_guard`): the probe then stays
quiet a few seconds, as the swapper, asked before that request reached it, still lists the model loaded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from slotlogic.events import Event, ModelUnloaded
from slotlogic.keeper import Keeper


class ModelUnload:
    def __init__(self, url: str, keeper: Keeper, emit: Callable[[Event], None]) -> None:
        self.url = url
        self.keeper = keeper
        self.emit = emit
        self.unloaded = False
        self.quiet_until = 0.0  # monotonic: a model a request of ours swapped out is not probed before this
        self.props_lock = asyncio.Lock()  # held while the probe's `/props` is out (a swap's guard waits for it)

    def quiet_now(self) -> bool:
        return time.monotonic() < self.quiet_until

    def quiet(self, seconds: float) -> None:
        """A request of ours is about to swap this model out: no `/props` for `seconds` (it would load it back)."""
        self.quiet_until = max(self.quiet_until, time.monotonic() + seconds)

    def note(self, quiet: float = 0.0, *, swapped: bool = False) -> None:
        """The model is unloaded (seen by the probe, or about to be by a request that swaps it out): its slots
        are empty; it is not asked again until its swapper says it is loaded. `quiet`: seconds the probe leaves
        it alone even so. `swapped`: a request of ours swaps it out now (a placement may have seen it loaded
        again since the last unload, so its slots are emptied again)."""
        self.quiet(quiet)
        if not self.unloaded or swapped:
            self.keeper.facts.unloaded()
            if not self.unloaded and not swapped:  # a swap of ours has its own line
                self.emit(ModelUnloaded(self.url))
            self.unloaded = True
