"""A refused copy of another server's slot falls back to that server's page of the same session
(`slotkeeper.drivers.seed_pages.seed_from_peer_page`): the drivers' glue, with the core's answers stubbed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from slotkeeper.drivers.page_runner import PageOutcome, PageRunner
from slotkeeper.drivers.seed_pages import seed_from_peer_page
from slotlogic.paging import PagePlan, PageRecord, Seed

IDENTITY = "model+build"
PEER = "http://peer:8080"


class Pages:
    """This server's page runner: what it is asked to run."""

    def __init__(self) -> None:
        self.ran: list[PagePlan] = []

    async def run(self, plan: PagePlan) -> PageOutcome:
        self.ran.append(plan)
        return PageOutcome(restored_tokens=plan.restore_tokens)


def movers(page: dict[str, PageRecord], tmp_path: Any) -> tuple[Any, Any]:
    """(this server's mover, the peer's): the peer's page index is `page`, which the test fills in."""
    peer_pages = PageRunner(client=None, save_dir=str(tmp_path), max_bytes=1 << 30, emit=lambda e: None)  # type: ignore[arg-type]
    peer = SimpleNamespace(pages=peer_pages, keeper=SimpleNamespace(pager=SimpleNamespace(
        page_of=page.get, seeds=SimpleNamespace(taken=lambda source, slot: False))))
    recorded: list[Any] = []
    mover = SimpleNamespace(
        pages=Pages(), elsewhere=SimpleNamespace(peer=lambda url: peer if url == PEER else None),
        keeper=SimpleNamespace(page_identity=IDENTITY,
                               pager=SimpleNamespace(seeds=SimpleNamespace(worth=lambda gain: 5.0)),
                               turns=SimpleNamespace(fence_holds=lambda fence: True)),
        record_pages=lambda plan, out: recorded.append(plan))
    mover.recorded = recorded
    return mover, peer


def copy_plan() -> PagePlan:
    """A new session's plan: the holder of its slot paged out, and a copy of `src`'s live slot on the peer."""
    return PagePlan(3, save_for="holder", save_file="page-holder.bin", restore_for="src", restore_file="seed.bin",
                    seed=Seed("src", 4_000, slot=1, server=PEER), seed_file="seed.bin")


async def test_a_refused_copy_restores_the_page_the_other_server_is_writing_of_the_same_session(tmp_path):
    """bench subagents-2x2 seed 10: the copy of the parent's slot was refused (a placement there held the slot
    to page the parent out), and the family's 426 tokens were prefilled cold while that page was written 1.7 s
    later. The page, once recorded, is the seed: restored here as it is, with the holder's save kept, and not
    recorded here (it stays the other server's)."""
    page: dict[str, PageRecord] = {}
    mover, peer = movers(page, tmp_path)
    writing = peer.pages.save_starts("src")  # the placement there is paging src out now

    async def written() -> None:
        await asyncio.sleep(0.05)
        page["src"] = PageRecord("page-src.bin", 1_000, 1.0, 23_000_000, IDENTITY)
        peer.pages.save_ends("src", writing)

    done = asyncio.create_task(written())
    out = PageOutcome(saved_tokens=900)  # the holder's save ran; the copy did not (`seed_tokens` None)
    plan, more = await seed_from_peer_page(mover, copy_plan(), out, None, None)
    await done
    assert [(p.save_for, p.restore_file, p.restore_tokens) for p in mover.pages.ran] == [(None, "page-src.bin", 1_000)]
    assert plan.seed is not None and plan.seed.page == page["src"] and plan.seed.slot is None
    assert (plan.save_for, plan.restore_file) == ("holder", "page-src.bin")
    assert (more.restored_tokens, more.saved_tokens) == (1_000, 900)
    assert mover.recorded == []


async def test_no_page_coming_or_one_from_another_build_leaves_the_plan_as_it_ran(tmp_path):
    page: dict[str, PageRecord] = {}
    mover, _ = movers(page, tmp_path)
    out = PageOutcome(saved_tokens=900)
    plan = copy_plan()
    assert await seed_from_peer_page(mover, plan, out, None, None) == (plan, out)  # nothing written: at once
    page["src"] = PageRecord("page-src.bin", 1_000, 1.0, 23_000_000, "another build")
    assert await seed_from_peer_page(mover, plan, out, None, None) == (plan, out)
    assert mover.pages.ran == []
