"""Paging with a save dir the proxy cannot read (`slots_save_remote`): llama-server's `--slot-save-path` on
another host or in another container. Pages go through the server's own save and restore only; their names
come from a bounded ring that saves overwrite, so the server's disk stays within the page budget without any
delete; sizes come from the answers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.sim.sweep import run_shape
from bench.sim.traffic import shape_for
from slotlogic import paging
from slotlogic.page_names import PageNames
from slotlogic.paging import PagePlan, PageRecord

UP = "http://127.0.0.1:8080"


def test_two_plans_running_at_once_never_save_into_one_ring_name():
    """Two slots' plans made from the same page index pick the same free name; the second to run takes another
    (before, two saves wrote one file at once in the simulator, and a session's page was the other's)."""
    names = PageNames(UP)
    ring = names.ring(3, {})
    assert ring == tuple(paging.ring_file(UP, i) for i in range(3))
    a = PagePlan(0, save_for="a", save_file=ring[0])
    b = PagePlan(1, save_for="b", save_file=ring[0])
    a2, held_a = names.writes(a, 3, {})
    b2, held_b = names.writes(b, 3, {})
    assert a2.save_file == ring[0] and b2.save_file == ring[1] and held_a.isdisjoint(held_b)
    c2, _ = names.writes(PagePlan(2, save_for="c", save_file=ring[0]), 3, {})
    assert c2.save_file == ring[2]
    d2, held_d = names.writes(PagePlan(3, save_for="d", save_file=ring[0]), 3, {})
    assert d2.save_for is None and d2.save_file is None and held_d == frozenset()  # no name left: not saved
    names.write_done(held_a)
    assert names.ring(3, {}) == (ring[0],)


def test_the_oldest_page_gives_its_name_up_and_never_one_being_restored_or_written():
    names = PageNames(UP)
    r = [paging.ring_file(UP, i) for i in range(2)]
    index = {"old": PageRecord(r[0], 500, 10.0, 1000), "new": PageRecord(r[1], 500, 20.0, 1000)}
    assert names.ring(2, index) == (r[0], r[1])          # all taken: the least recently saved first
    reading = names.reads(PagePlan(0, restore_for="old", restore_file=r[0]))
    assert names.ring(2, index) == (r[1],)
    names.read_done(reading)
    index["being-written"] = PageRecord(paging.ring_file(UP, 2), 0, 30.0, 0)
    assert paging.ring_file(UP, 2) not in names.ring(3, index)


SEEDS = [s for s in range(40) if (sh := shape_for(s)).setup.paging and sh.setup.servers == 1
         and sh.setup.proxies == 1][:8]


@pytest.mark.parametrize("seed", SEEDS)
def test_out_of_reach_pages_and_checkpoints_as_well_as_in_reach(seed):
    """The simulator's paging shapes, the proxy reading the save dir or not: at most 0.05 more tokens prefilled
    against the limit, no token lost unlabelled, and on the server's disk never a page file outside the
    ring's names (prefix checkpoints: a bounded set of names too, each kept by its checkpoint while it holds it;
    before, a checkpoint took another name each time the count of names grew, and was built again)."""
    sh = shape_for(seed)
    opts = (*sh.setup.options, ("slots_page_max_mb", 64))
    local, _ = run_shape(replace(sh, setup=replace(sh.setup, options=opts)))
    remote, rig = run_shape(replace(sh, setup=replace(sh.setup, options=opts, remote_save=True)))
    assert remote.error is None and remote.lost == 0, [x.line() for x in remote.losses]
    assert remote.ratio <= local.ratio + 0.05, (remote.ratio, local.ratio)  # (the timing differs: some do better)
    full = sh.setup.n_ctx * 256 + 4096 + 4096   # the simulator's bytes a token, the file header, the bound's
    ring = {paging.ring_file(u, i) for u in rig.servers for i in range((64 << 20) // full)}
    written = {e.tag for s in rig.servers.values() for e in s.events if e.kind == "save"}
    pages = {w for w in written if w and w.startswith("page-")}
    assert pages <= ring, pages - ring
    checkpoints = {w for w in written if w and w.startswith("prefix-")}
    assert len(checkpoints) <= max(1, (2048 << 20) // full), checkpoints
