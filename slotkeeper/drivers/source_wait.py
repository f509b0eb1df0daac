"""A new session waits for the slot it would start from (`SlotMover.moves_for`, before the slot's paging lock).

Why apart: the slot moves' driver pages and warms; this is the wait before them, when the conversation a new
session would copy is still being computed on a slot of this server (two sessions that start together). What is
worth waiting for, and how long, is the core's (`slotlogic.seeds.Seeds.busy_source`, `slotlogic.paging`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from dataclasses import replace
from typing import TYPE_CHECKING

from slotlogic import paging, server
from slotlogic.events import SourceAwaited
from slotlogic.paging import PageAsk

if TYPE_CHECKING:
    from slotkeeper.drivers.slot_moves import SlotMover

SOURCE_POLL = 0.2      # seconds between `/slots` looks while a new session waits for the slot it would copy
MIN_SLEEP = 0.001      # a wait's last sliver below this is not slept (nor polled for)


async def await_source(mover: SlotMover, ask: PageAsk, by: float | None = None) -> PageAsk:
    """Before the slot's paging lock: when the conversation this new session would start from is on a slot
    still running a request, or about to (two sessions that start together), wait for that slot to go idle,
    within the time prefilling the copied part would take (`Pager.busy_source`); `ask` with its views as
    they are then, and never past `by` (monotonic: the request's wait bound). A shared store never seeds from a
    live slot (other proxies may page it), so it never waits."""
    assert mover.pages is not None
    if mover.store.remote:
        return ask
    pages, slot, views = mover.pages, ask.slot, ask.views
    # A slot whose paging lock is held is as good as busy: its placement's request is on its way there.
    busy = [replace(v, busy=True) if not v.busy and pages.busy(v.id) else v for v in views]
    found = mover.keeper.pager.busy_source(replace(ask, views=busy, sent=pages.last_sent.get(slot)))
    if found is None:
        return ask
    source = found.slot
    started = time.monotonic()
    deadline = started + found.budget
    idle, paged, entry = False, False, None
    # a sliver of the budget left is not worth one more look, but a source still prefilling what we would
    # copy is (paging.keep_waiting)
    while not idle and (by is None or time.monotonic() < by) and paging.keep_waiting(
            found, entry, time.monotonic() - started, deadline - time.monotonic() - MIN_SLEEP):
        left = deadline - time.monotonic()
        poll = min(SOURCE_POLL, left) if left >= MIN_SLEEP else SOURCE_POLL
        await asyncio.sleep(poll if by is None else max(0.0, min(poll, by - time.monotonic())))
        if pages.busy(source) and found.session in pages.saving:
            # the placement that took the source's slot pages it out: its page is the seed (giving up here
            # would prefill what the page is about to hold)
            await pages.settled(found.session, None if by is None else max(0.0, by - time.monotonic()))
            paged = True
            break
        live = await mover.client.slots()
        if live is None:
            break
        idle = not pages.busy(source) and mover.keeper.pager.seeds.source_idle(source, live)
        entry = next((e for e in live if isinstance(e, dict) and e.get("id") == source), None)
    mover.emit(SourceAwaited(mover.url, slot, source, time.monotonic() - started, idle or paged))
    return replace(ask, views=[replace(v, busy=False) if v.id == source else v for v in views]) if idle else ask


async def await_idle(mover: SlotMover, slots: Collection[int], by: float) -> bool:
    """With the slot's paging lock held and its requests of ours started, before a bounded placement plans its
    moves: whether `slots` are all idle at the server by `by` (monotonic). A slot action on a slot still running a
    request waits in the server's queue until that request ends, and cannot be called back then (the server
    writes the file whenever the slot frees), so none is sent before (it would wait out a long prefill there).
    The moves are planned after this wait, from the slot as it is then (planned before it, a page could be
    recorded for a holder the slot no longer held). False: still busy at `by`, nothing sent. No `/slots`
    answer: it goes on as before."""
    while slots:
        live = await mover.client.slots()
        if live is None or not any(server.running(live, slot) for slot in slots):
            return True
        left = by - time.monotonic()
        if left <= 0:
            return False
        await asyncio.sleep(min(SOURCE_POLL, left))
    return True
