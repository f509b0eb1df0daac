"""Seeds taken from pages being written: a seed's source whose slot another placement took, to page it out,
is restored from that page once it is recorded, on this server or on another of the pool (one save dir).

Why apart: the slot moves (`slotkeeper.drivers.slot_moves`) plan a seed from a live slot; when the copy is
refused (the slot's lock is another placement's), these wait for that placement's page instead of letting the
new session prefill what the seed held.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from slotkeeper.drivers.bounds import left, within
from slotkeeper.drivers.page_runner import PageOutcome
from slotlogic.ledger import Fence
from slotlogic.paging import PageAsk, PagePlan, PageRecord, restorable

if TYPE_CHECKING:
    from slotkeeper.drivers.slot_moves import SlotMover

COMING_WAIT = 2.0  # seconds a placement waits for the page-out of a seed's source to start (`save_begun`)


async def save_begun(mover: SlotMover, source: str, slot: int, by: float | None) -> bool:
    """Whether `source`'s page-out by this process is under way. When a placement of ours has claimed its slot
    (`Seeds.taken`), that placement pages it out first, so its save starts within moments: waited for at most
    `COMING_WAIT` (within the request's bound), or until a page of it is there already."""
    if source not in mover.pages.saving and not mover.keeper.pager.seeds.taken(source, slot):
        return False

    def recorded() -> bool:
        page = mover.keeper.pager.page_of(source)
        return page is not None and page.n_tokens > 0

    return await mover.pages.save_begins(source, within(COMING_WAIT, by), recorded)


async def seed_from_its_page(mover: SlotMover, ask: PageAsk, plan: PagePlan, out: PageOutcome, fence: Fence | None,
                              by: float | None) -> tuple[PagePlan, PageOutcome]:
    """A live seed that was not copied: another placement took its slot, to page its conversation out, between
    this plan and the copy (the copy never writes a slot another placement holds). Once that page is recorded it
    is the seed, restored without a save; else the plan stands as run (nothing restored). Without it the part of
    the prompt the seed held is prefilled again."""
    assert plan.seed is not None
    source = plan.seed.source
    if await save_begun(mover, source, ask.slot, by):
        await mover.pages.settled(source, left(by))
    again = mover.keeper.pager.page_plan(replace(ask, sent=mover.pages.last_sent.get(ask.slot),
                                                 ours=mover.gate.last_started.get(ask.slot)))
    # the seed was the session's own live conversation: its page is then planned as its own, not as a seed
    own = source == ask.session_key and again.seed is None and again.restore_for == source
    if (not own and (again.seed is None or again.seed.source != source or again.seed.slot is not None)) \
            or again.restore_file is None or not mover.keeper.turns.fence_holds(fence):
        return plan, out
    return await _restore_only(mover, plan, again, out, record=True)


async def seed_from_peer_page(mover: SlotMover, plan: PagePlan, out: PageOutcome, fence: Fence | None,
                              by: float | None) -> tuple[PagePlan, PageOutcome]:
    """A copy of another server's slot that was refused: a placement there holds the slot, to page its
    conversation out first. Once that page is recorded it is the seed, restored here as it is (`peer_page`).
    Without it the family's part of the prompt is prefilled cold while the parent's page is written moments
    later."""
    assert plan.seed is not None and plan.seed.server is not None
    seed, peer = plan.seed, mover.elsewhere.peer(plan.seed.server) if mover.elsewhere is not None else None
    until = worth_until(mover, seed.chars, by)
    rec = await peer_page(peer, seed.source, mover.keeper.page_identity, until) if peer is not None else None
    if rec is None or not mover.keeper.turns.fence_holds(fence):
        return plan, out
    again = replace(plan, seed=replace(seed, slot=None, page=rec), seed_file=None, restore_for=seed.source,
                    restore_file=rec.file, restore_tokens=rec.n_tokens)
    return await _restore_only(mover, plan, again, out, record=False)  # another server's page: nothing to record


async def _restore_only(mover: SlotMover, plan: PagePlan, again: PagePlan, out: PageOutcome, *,
                        record: bool) -> tuple[PagePlan, PageOutcome]:
    """Run `again`'s restore alone: the holder's page-out ran with the first `plan`, and the outcome keeps that
    save. Returns the plan as it ran (its holder's save and the new restore) and the outcome."""
    restore = replace(again, save_for=None, save_file=None)
    more = await mover.pages.run(restore)
    if record:
        await mover.record_pages(restore, more)
    more.saved_tokens, more.saved_bytes = out.saved_tokens, out.saved_bytes
    return replace(again, save_for=plan.save_for, save_file=plan.save_file), more


async def peer_page(peer: SlotMover, source: str, identity: str, by: float | None) -> PageRecord | None:
    """`source`'s page on `peer` (another server of the pool), once written when a placement there is writing it
    now, if this server can restore it (`identity`). The servers of a pool share one save dir: it is restored here
    as it is and stays that server's page (nothing here records or deletes it)."""
    if peer.pages is None:
        return None
    if await save_begun(peer, source, -1, by):
        await peer.pages.settled(source, left(by))
    rec = peer.keeper.pager.page_of(source)
    return rec if restorable(rec, identity) else None


def worth_until(mover: SlotMover, gain: int, by: float | None) -> float:
    """Until when (monotonic) a page that would spare `gain` characters of prefill is worth waiting for: twice
    what prefilling them takes at the measured rate, as for a busy live source (`paging.keep_waiting`), never
    past the request's bound `by`. A save waits for the other slots' prompt batch, so a page may come late."""
    until = time.monotonic() + 2 * mover.keeper.pager.seeds.worth(gain)
    return until if by is None else min(by, until)
