"""Which page files a save may write and which it must leave alone.

Why: plans on different slots run at once. A plan that makes room for its save must not delete the page another
plan is about to restore (that restore would fail and its session prefill everything), and with the save dir out
of this machine's reach (`slots_save_remote`) a save cannot delete anything: it takes a name from a bounded ring
and overwrites it, so the files on the server's disk stay within the page budget by construction. Pure.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import replace

from slotlogic import paging


class PageNames:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.reading: Counter[str] = Counter()  # file -> plans of this process about to restore it
        self.writing: Counter[str] = Counter()  # ring names plans of this process are saving into

    def reads(self, plan: paging.PagePlan) -> frozenset[str]:
        """The file `plan` will restore (its session's page or a seed's), kept from every budget sweep and from
        the ring until `read_done`."""
        files = frozenset(f for f in (plan.restore_file,) if f)
        self.reading.update(files)
        return files

    def read_done(self, files: frozenset[str]) -> None:
        self.reading.subtract(files)
        self.reading = +self.reading  # counts at zero dropped

    def ring(self, size: int, index: Mapping[str, paging.PageRecord]) -> tuple[str, ...]:
        """The bounded names a save may take, best first: unused ones, then the least recently saved page's (its
        session then has none); never a page being written or about to be restored."""
        names = [paging.ring_file(self.upstream, i) for i in range(max(1, size))]
        holders = {rec.file: rec for rec in index.values()}
        busy = self.reading.keys() | self.writing.keys()
        free = [n for n in names if n not in holders and n not in busy]
        taken = sorted((holders[n].saved, n) for n in names
                       if n in holders and n not in busy and holders[n].n_tokens > 0)
        return tuple(free + [n for _, n in taken])

    def writes(self, plan: paging.PagePlan, size: int,
               index: Mapping[str, paging.PageRecord]) -> tuple[paging.PagePlan, frozenset[str]]:
        """Just before `plan` runs (nothing awaited between), its ring names held for it until `write_done`:
        a name another plan of this process took since this one was made (or a name not of the ring) is swapped
        for a free one, or the save is left out when none is. `size` 0: names are not bounded, nothing held."""
        if size <= 0:
            return plan, frozenset()
        held, bounded = set(self.writing), {paging.ring_file(self.upstream, i) for i in range(max(1, size))}
        for attr in ("save_file", "seed_file"):
            name = getattr(plan, attr)
            if name is None:
                continue
            if name in held or name not in bounded:  # taken since the plan was made, or not one of the ring's
                free = [n for n in self.ring(size, index) if n not in held]
                if not free:
                    plan = plan.without_seed() if attr == "seed_file" else replace(plan, save_for=None, save_file=None)
                    continue
                moved = {attr: free[0]} | ({"restore_file": free[0]} if plan.restore_file == name else {})
                plan, name = replace(plan, **moved), free[0]
            held.add(name)
        files = frozenset(f for f in (plan.save_file, plan.seed_file) if f)
        self.writing.update(files)
        return plan, files

    def write_done(self, files: frozenset[str]) -> None:
        self.writing.subtract(files)
        self.writing = +self.writing
