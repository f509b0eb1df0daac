"""A session's return time: its measured turn gap, and how surely it is back soon (`slotlogic.returns`),
through the session table that measures it."""

from slotlogic import returns
from slotlogic.table import SessionTable


def test_the_turn_gap_is_a_weighted_mean_of_the_gaps_seen():
    assert returns.next_gap(None, 2.0) == 2.0
    gap = returns.next_gap(2.0, 12.0)  # one long pause moves it, does not replace it
    assert 2.0 < gap < 12.0
    assert returns.next_gap(gap, -1.0) < gap  # a clock step back counts as no gap


def test_an_owner_is_wanted_most_when_it_is_due():
    """Before its expected return the nearer the surer; after it, the owner's own gap sets how fast an absence
    tells that it is away (silent for 5 s is long for a session that calls back within a second)."""
    wanted = [returns.wanted(0.0, 3.0, t, 5.0) for t in (0.0, 1.5, 3.0)]
    assert wanted == sorted(wanted) and wanted[-1] == 1.0
    assert returns.wanted(0.0, 1.0, 6.0, 5.0) < returns.wanted(0.0, 4.0, 6.0, 5.0) < 1.0
    assert returns.wanted(0.0, None, 0.0, 5.0) == 1.0 > returns.wanted(0.0, None, 5.0, 5.0) == 0.5


def test_the_table_measures_a_session_gap_from_its_answer_to_its_next_request():
    table = SessionTable(ttl=120.0)
    table.assign("a", 0, 100.0, prefix=None)
    table.use("a", 100.0)
    assert table.sessions["a"].gap is None  # no answer yet: nothing measured
    table.answered("a", 0, 101.0)
    table.use("a", 103.0)
    assert table.sessions["a"].gap == 2.0
    table.use("a", 104.0)  # a second request before an answer: no gap
    assert table.sessions["a"].gap == 2.0
    table.answered("a", 0, 105.0)
    table.assign("a", 1, 106.0, prefix=None)  # displaced and placed again: the gap is measured and kept
    gap = table.sessions["a"].gap
    assert gap is not None and 1.0 < gap < 2.0
    table.use("a", 106.0)  # the placed request's pin: counted once
    assert table.sessions["a"].gap == gap
