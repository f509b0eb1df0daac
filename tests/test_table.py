"""The in-memory session table: the hot path's lookup, touches, displacement, forgetting."""

from slotlogic.table import SessionTable


def test_session_table_hot_path_and_drain():
    t = SessionTable(ttl=120)
    assert t.live("a", 0.0) is None
    t.assign("a", 2, 0.0, prefix=None)
    t.use("a", 1.0)
    t.use("a", 2.0)
    assert t.live("a", 100.0).slot == 2
    assert t.live("a", 200.0) is None  # expired after the TTL
    touches = t.drain()
    assert touches["a"].requests == 2 and touches["a"].last_used == 2.0 and t.drain() == {}
    assert t.forget("a") and not t.forget("a")


def test_displacement_follows_answers_not_starts():
    t = SessionTable(ttl=120)
    t.assign("a", 0, 0.0, prefix=None)
    t.answered("a", 0, 1.0)
    assert not t.displaced("a", 0)
    t.assign("b", 0, 2.0, prefix=None)  # b's request is on its way to slot 0
    assert t.displaced("a", 0)
    t.answered("b", 0, 3.0)
    t.answered("a", 1, 4.0)  # an answer from another slot does not make slot 0 a's again
    assert t.displaced("a", 0)
    t.answered("a", 0, 5.0)
    assert not t.displaced("a", 0) and t.holders[0] == "a"


def test_the_side_call_slot_is_reserved_only_while_side_calls_come():
    t = SessionTable(ttl=120)
    assert not t.reserving(0.0)
    t.side_call(10.0)
    assert t.reserving(20.0) and not t.reserving(130.0)


def test_forget_all_and_dispatch_order():
    t = SessionTable(ttl=120)
    t.assign("a", 1, 0.0, prefix=None)
    t.dispatch("a", 1)
    t.dispatch("", 1)  # a side call left for slot 1 after a's request
    assert t.dispatched == {1: ""}
    t.forget_all()
    assert t.sessions == {} and t.holders == t.running == t.dispatched == {}


def test_a_claim_lasts_the_ttl_after_the_answer_not_after_the_request_start():
    """A 126 s prefill with a 120 s TTL (seen with Codex on a loaded machine) must not expire the session."""
    t = SessionTable(ttl=120)
    t.assign("a", 0, 0.0, prefix=None)
    t.answered("a", 0, 126.0)
    assert t.live("a", 200.0).slot == 0 and t.live("a", 246.0) is None
    assert t.drain()["a"].last_used == 126.0  # the shared claim is refreshed by the next flush
