"""One placement of a session at a time on one server.

Why: two requests of one session can arrive together (a client's retry, two windows that open with the same
prompt, so the same content key). Each would get its own placement from the core, and the core keeps only a
session's newest one (`slotlogic/placements.py`): the first one's pin would then be out of order, and both requests
went out unpinned through the fail-open path. So a session's second request waits here until the first one is
placed, then asks the core again, which now answers from memory (the session is on its slot, `Keeper.resume`),
or places it anew when the first went elsewhere or failed. Only the slow path passes here: a known session's turn
never takes this lock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from slotlogic.decisions import NeedSlot

T = TypeVar("T")


class Placings:
    def __init__(self) -> None:
        self._turns: dict[str, tuple[asyncio.Lock, int]] = {}  # session key -> its lock, the requests at it

    def __len__(self) -> int:
        return len(self._turns)

    async def one_at_a_time(self, need: NeedSlot, again: Callable[[NeedSlot], T | NeedSlot],
                            place: Callable[[NeedSlot, bool], Awaitable[T]]) -> T:
        """`place(need, waited)` with no other placement of the session under way; after a wait, `again(need)`
        first: the core's answer from memory, or the `NeedSlot` to place (`waited`: what was asked before is old)."""
        key = need.ticket.session.key
        lock, waiting = self._turns.get(key, (asyncio.Lock(), 0))
        self._turns[key] = (lock, waiting + 1)
        waited = lock.locked()
        try:
            async with lock:
                if waited:
                    answer = again(need)
                    if not isinstance(answer, NeedSlot):
                        return answer
                    need = answer
                return await place(need, waited)
        finally:
            lock, waiting = self._turns[key]
            if waiting > 1:
                self._turns[key] = (lock, waiting - 1)
            else:
                del self._turns[key]
