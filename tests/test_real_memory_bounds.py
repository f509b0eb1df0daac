"""The memory-bounds class of `make reliability`, scaled down (`Sizes.small()`: every line, event, answer and
system message still past its cap), on real mitmdump processes: every attack of issue 20 items 1-6, 15 and
16 leaves the proxy alive, under 300 MB of peak RSS growth, with every health answer within 1 s, and its
client gets what it should (the soak runs the same attacks at full size)."""

from __future__ import annotations

import shutil

import pytest

from bench import memory_bounds as mb
from bench.reliability import Soak

pytestmark = pytest.mark.real


def test_every_attack_stays_under_its_cap_alive_and_answering():
    soak = Soak(1)
    try:
        row = mb.run(soak, sizes=mb.Sizes.small())
    finally:
        soak.close()
        shutil.rmtree(soak.root, ignore_errors=True)
    attacks = row.notes["attacks"]
    items = {a["item"] for a in attacks}
    assert {"1", "2", "3", "4", "5", "6", "15", "16"} <= items, items
    assert len(attacks) + len(row.notes["skipped"]) == len(mb.attack_names())
    assert row.failed == [], row.notes["table"]
    for a in attacks:
        assert a["alive"] and a["growth_mb"] <= mb.CAP_MB and a["health_late"] == 0, a
        assert a["health_max_s"] <= mb.HEALTH_S and a["outcome"].startswith("ok"), a
