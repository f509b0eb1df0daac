"""The first-token watch's reading of `/slots` polls, its stall verdict and the deadline (pure, clock passed in)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from slotlogic.watch import End, Poll, State, Watch, WatchSettings


def slot(i, busy=False, prompt=0, processed=0, decoded=0, task=1):
    return {"id": i, "is_processing": busy, "id_task": task, "n_prompt_tokens": prompt,
            "n_prompt_tokens_processed": processed, "next_token": [{"n_decoded": decoded}]}


S = WatchSettings(interval=15, poll_timeout=3, first_token_timeout=60, deadline=0)


def test_a_pinned_request_queued_behind_an_earlier_one_then_prefilling():
    w = Watch(S, started=0.0, slot=1, stream=True)
    p, end = w.polled([slot(0), slot(1, busy=True, prompt=900, decoded=40)], 15.0, ahead=1)
    assert (p.state, p.slot, p.waited, end) == (State.QUEUED, 1, 15.0, None)
    p, _ = w.polled([slot(0), slot(1, busy=True, prompt=3000, processed=2048)], 30.0)
    assert (p.state, p.slot, p.processed, p.total) == (State.PREFILLING, 1, 2048, 3000)


def test_decoding_on_our_slot_means_another_request_for_a_stream_and_ours_otherwise():
    live = [slot(0, busy=True, prompt=50, decoded=12)]
    assert Watch(S, 0.0, 0, stream=True).polled(live, 15.0)[0].state is State.QUEUED
    assert Watch(S, 0.0, 0, stream=False).polled(live, 15.0)[0].state is State.GENERATING


def test_our_slot_idle_while_others_work_is_queued_behind_the_one_furthest_along():
    p, _ = Watch(S, 0.0, 0).polled([slot(0), slot(1, busy=True, decoded=3), slot(2, busy=True, decoded=9)], 15.0)
    assert (p.state, p.slot) == (State.QUEUED, 2)


def test_a_pending_request_is_queued_when_every_slot_works_and_prefilling_on_a_fresh_task_otherwise():
    w = Watch(S, 0.0, None)
    assert w.polled([slot(0, busy=True, decoded=5), slot(1, busy=True, decoded=2)], 15.0)[0].slot == 0
    p, _ = w.polled([slot(0), slot(1, busy=True, prompt=700)], 30.0)
    assert (p.state, p.slot, p.total) == (State.PREFILLING, 1, 700)


def test_a_poll_that_times_out_is_busy_and_unavailable_slots_are_unknown():
    w = Watch(S, 0.0, 0)
    assert w.polled(Poll.TIMEOUT, 15.0) == (w.progress, None) and w.progress.state is State.BUSY
    assert w.polled(None, 30.0)[0].state is State.UNKNOWN


def test_stalled_only_after_the_timeout_with_every_slot_idle_and_nothing_moving():
    w = Watch(S, 0.0, 0)
    idle = [slot(0, prompt=10), slot(1)]
    p, end = w.polled(idle, 15.0)
    assert (p.state, p.idle_for, end) == (State.STALLED, 0.0, None)
    assert w.polled(idle, 30.0)[0].idle_for == 15.0
    moved = [slot(0, prompt=10, task=2), slot(1)]          # a task ran and finished in between: not stalled
    assert w.polled(moved, 45.0)[0].idle_for == 0.0
    assert w.polled(Poll.TIMEOUT, 60.0)[0].state is State.BUSY    # busy restarts the clock too
    for t in (75.0, 90.0, 105.0, 120.0):
        p, end = w.polled(moved, t)
        assert end is None, t
    p, end = w.polled(moved, 135.0)
    assert (p.idle_for, end, w.next_wake()) == (60.0, End.STALLED, None)


def test_no_stall_verdict_when_the_timeout_is_off_or_the_first_byte_came():
    w = Watch(WatchSettings(interval=1, first_token_timeout=0), 0.0, 0)
    assert all(w.polled([slot(0)], float(t))[1] is None for t in range(1, 100))


def test_wakes_and_the_deadline():
    w = Watch(WatchSettings(interval=15, deadline=40), started=100.0, slot=0)
    assert w.next_wake() == 115.0 and not w.poll_due(114.0) and w.poll_due(115.0)
    w.polled([slot(0, busy=True)], 115.0)
    assert w.next_wake() == 130.0
    w.got_first_byte()
    assert w.next_wake() == 140.0 and not w.poll_due(200.0)
    assert w.due(139.9) is None and w.due(140.0) is End.DEADLINE and w.next_wake() is None
    assert Watch(WatchSettings(interval=0, deadline=0), 0.0, 0).next_wake() is None


polls = st.one_of(st.just(Poll.TIMEOUT), st.none(),
                  st.lists(st.builds(slot, st.integers(0, 3), st.booleans(), st.integers(0, 50), st.integers(0, 50),
                                     st.integers(0, 5), st.integers(0, 3)), max_size=4))


@settings(max_examples=300, deadline=None)
@given(seq=st.lists(polls, max_size=30), slot_id=st.one_of(st.none(), st.integers(0, 3)), stream=st.booleans())
def test_any_poll_sequence_gives_a_reading_and_ends_only_a_long_stall(seq, slot_id, stream):
    w = Watch(WatchSettings(interval=10, first_token_timeout=30), 0.0, slot_id, stream=stream)
    quiet_since = None
    previous = None
    for i, answer in enumerate(seq):
        now = 10.0 * (i + 1)
        p, end = w.polled(answer, now, ahead=i % 2)
        all_idle = isinstance(answer, list) and answer and not any(e["is_processing"] for e in answer)
        if not all_idle:
            quiet_since = None
        elif quiet_since is None or (previous is not None and answer != previous):
            quiet_since = now
        previous = answer if isinstance(answer, list) and answer else previous
        assert p.waited == now and isinstance(p.state, State)
        if end is not None:
            assert end is End.STALLED and quiet_since is not None and now - quiet_since >= 30
            break


def test_our_own_slot_running_our_task_with_no_progress_for_the_wedge_limit_is_wedged():
    """Rule 6 (mix-4 run K: a llama-server spun on one slot, its counters frozen, for 20 minutes)."""
    s = WatchSettings(interval=15, wedged_timeout=60)
    w = Watch(s, 0.0, 1)
    frozen = [slot(0), slot(1, busy=True, prompt=989, processed=2046, task=690)]
    for t in (15.0, 30.0, 45.0, 60.0):
        assert w.polled(frozen, t)[1] is None, t
    p, end = w.polled(frozen, 75.0)
    assert (p.state, end, w.next_wake()) == (State.PREFILLING, End.WEDGED, None)


def test_our_slot_waiting_while_the_server_evaluates_another_slots_prompt_is_no_wedge():
    """The server fills each prompt batch slot by slot: on a loaded machine our slot's counters stood still for
    186 s while another slot's long prompt was evaluated, and the watchdog ended our request as wedged (bench
    mix-4 under a load of 10 on 2 cores). Progress on any busy slot is the server working; with every other
    slot idle or frozen too, it is still a wedge."""
    s = WatchSettings(interval=15, wedged_timeout=60)
    ours = slot(1, busy=True, prompt=9000, processed=0, task=700)
    w = Watch(s, 0.0, 1)
    for i, t in enumerate(range(15, 300, 15)):
        other = slot(0, busy=True, prompt=30000, processed=512 * (i + 1), task=699)
        assert w.polled([other, ours], float(t))[1] is None, t
    stuck = Watch(s, 0.0, 1)
    other = slot(0, busy=True, prompt=30000, processed=512, task=699)
    ends = [stuck.polled([other, ours], float(t))[1] for t in range(15, 90, 15)]
    assert ends[-1] is End.WEDGED


def test_progress_a_request_ahead_or_a_slow_batch_is_no_wedge():
    s = WatchSettings(interval=15, wedged_timeout=60)
    moving = Watch(s, 0.0, 1)
    for i, t in enumerate((15.0, 30.0, 45.0, 60.0, 75.0, 90.0)):
        assert moving.polled([slot(1, busy=True, prompt=9000, processed=2048 * (i // 2 + 1))], t)[1] is None
    behind = Watch(s, 0.0, 1)   # the frozen task is an earlier request of ours: ending this one frees nothing
    assert all(behind.polled([slot(1, busy=True, prompt=900, processed=512)], t, ahead=1)[1] is None
               for t in (15.0, 45.0, 90.0, 150.0))
    slow = Watch(s, 0.0, 1, batch_seconds=40.0)  # 2048 tokens at 51 tok/s: counters move every 40 s
    assert slow.wedge_limit == 120.0
    frozen = [slot(1, busy=True, prompt=9000, processed=2048)]
    assert all(slow.polled(frozen, t)[1] is None for t in (15.0, 60.0, 120.0))
    assert slow.polled(frozen, 135.0)[1] is End.WEDGED
    off = Watch(WatchSettings(interval=15), 0.0, 1)
    assert all(off.polled(frozen, float(t))[1] is None for t in range(15, 1000, 15))
