"""Seeds from another server of the pool: a new session copies a slot of another server instead of prefilling
what that slot holds (or is computing) again.

Why: a client's sessions land on every server of a pool, and the first on each would prefill the shared
prompt once more. The servers share one save dir, so the other server's slot is saved under its own paging
lock into a file this server restores, deleted once restored (nobody's page). Only servers whose files this
one can restore count, and a merely placed session is a source only when placed first, so two never wait for
each other. What a source is and whether it pays is `slotlogic.seeds`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from slotkeeper.drivers.seed_pages import peer_page, worth_until
from slotlogic import paging
from slotlogic.decisions import NeedSlot
from slotlogic.events import SourceAwaited
from slotlogic.paging import SEED_MIN_CHARS, PageAsk, Seed

if TYPE_CHECKING:
    from slotkeeper.drivers.slot_moves import SlotMover

POLL = 0.2  # seconds between the other server's `/slots` looks while its source slot runs its request


class PoolSeeds:
    def __init__(self, mover: SlotMover, peers: Callable[[], Sequence[SlotMover]]) -> None:
        self.mover = mover
        self.peers = peers  # the other servers' movers, as the pool has them now

    def peer(self, url: str) -> SlotMover | None:
        return next((p for p in self.peers() if p.url == url), None)

    async def find(self, need: NeedSlot, ask: PageAsk, by: float | None = None, wait: bool = True) -> PageAsk:
        """`ask` with the best source on another server (`elsewhere`), once its slot there is idle; waited for
        within what prefilling the copied part would take (`paging.source_wait`, `paging.keep_waiting`). A source
        displaced from its slot there is its page, once written (`seed_pages.peer_page`, within `by`). Without
        `wait`: only a source there now (an idle slot, a written page)."""
        me = self.mover.keeper
        best: tuple[Seed, bool, SlotMover] | None = None
        for peer in self.peers():
            total = peer.keeper.total_slots
            if not total or peer.pages is None or peer.keeper.page_identity != me.page_identity:
                continue
            found = peer.keeper.pager.source_for(need, total, me.pager.order(need.ticket.session.key))
            if found is not None and (best is None or found[0].chars > best[0].chars):
                best = (*found, peer)
        if best is None:
            return ask
        seed, busy, peer = best
        gain = seed.chars - (ask.base_chars if ask.cold is not None else ask.stable_chars)
        if gain < SEED_MIN_CHARS:
            return ask
        if seed.slot is None:
            until = worth_until(self.mover, gain, by) if wait else time.monotonic()
            page = await peer_page(peer, seed.source, me.page_identity, until)
            return replace(ask, elsewhere=replace(seed, page=page)) if page is not None else ask
        if busy and not wait:
            return ask
        if busy:
            wait = self.mover.keeper.pager.wait_worth(seed.slot, gain)
            if wait is None or not await self._wait(seed, peer, wait, ask.slot):
                return ask
        return replace(ask, elsewhere=seed)

    async def _wait(self, seed: Seed, peer: SlotMover, wait: paging.SourceWait, slot: int) -> bool:
        """Wait for `seed`'s slot on `peer` to finish its request; whether it did in time."""
        assert seed.slot is not None
        started, idle, entry = time.monotonic(), False, None
        while not idle and paging.keep_waiting(wait, entry, time.monotonic() - started,
                                               wait.budget - (time.monotonic() - started)):
            await asyncio.sleep(POLL)
            live = await peer.client.slots()
            if live is None:
                break
            idle = peer.keeper.pager.source_idle(seed.slot, live)
            entry = next((e for e in live if isinstance(e, dict) and e.get("id") == seed.slot), None)
        self.mover.emit(SourceAwaited(self.mover.url, slot, seed.slot, time.monotonic() - started, idle, peer.url))
        return idle

    async def copy(self, url: str, slot: int, file: str, source: str) -> tuple[int, int] | None:
        """Save `slot` of the pool's server at `url` into `file` (its tokens and bytes), under that server's lock
        for the slot and once every request it sent there reached it, if it still holds `source`'s conversation
        there; None when it cannot."""
        peer = self.peer(url)
        if peer is None or peer.pages is None:
            return None
        return await peer.pages.copy_out(slot, file, source=source)
