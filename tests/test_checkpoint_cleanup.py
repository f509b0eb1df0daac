"""Checkpoint cleanup: a table of file sets → deletions."""

import pytest

from slotlogic.checkpoint_cleanup import DAY, FileInfo, plan_cleanup

NOW = 100 * DAY
A, B, C, D = (f"prefix-{c * 16}.bin" for c in "abcd")


def f(name, age_days, size=100):
    return FileInfo(name, size, NOW - age_days * DAY)


CASES = [
    # files, index, current, keep_recent, max_bytes, expected deletions, why
    ([f(A, 40), f(B, 50), f(C, 60), f(D, 70)], {}, set(), 1, 0, [D, C, B], "keep the most recent one only"),
    ([f(A, 40), f(B, 50)], {}, {B}, 0, 0, [A], "the current fingerprint is always kept"),
    ([f(A, 40), f(B, 5)], {}, set(), 0, 0, [A], "used within the TTL (mtime) is kept"),
    ([f(A, 40), f(B, 40)], {A: {"last_used": NOW - 1 * DAY}}, set(), 0, 0, [B], "index last_used beats mtime"),
    ([f(A, 1), f("notes.bin", 90), f("prefix-XYZ.bin", 90), f("prefix-abc.bin", 90)], {}, set(), 0, 0, [],
     "only prefix-<16 hex>.bin files are ever touched"),
    ([f(A, 40), f(B, 50)], None, set(), 0, 0, [], "a corrupt index disables cleanup"),
    ([f(A, 1, 600), f(B, 2, 600), f(C, 3, 600)], {}, set(), 3, 1000, [C, B], "size cap deletes oldest kept"),
    ([f(A, 1, 600), f(B, 2, 600)], {}, {B}, 3, 700, [A], "the cap never deletes a current file"),
]


@pytest.mark.parametrize(("files", "index", "current", "keep", "cap", "expected", "why"), CASES,
                         ids=[c[-1] for c in CASES])
def test_cleanup_table(files, index, current, keep, cap, expected, why):
    got = plan_cleanup(files, index, current=current, now=NOW, ttl_days=30, keep_recent=keep, max_bytes=cap)
    assert sorted(got) == sorted(expected), why
