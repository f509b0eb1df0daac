"""The pure server choice and health back-off of `slotlogic.routing`."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from slotlogic import routing
from slotlogic.ranking import SlotView
from slotlogic.routing import (
    PROBE_MAX,
    Change,
    Health,
    RouteWhy,
    ServerView,
    backoff,
    choose,
    holds_prefix_free,
    slot_counts,
)


def test_a_known_session_stays_home_while_its_server_is_up():
    servers = [ServerView(0, free=0), ServerView(1, free=4)]
    assert choose(servers, home=0).why is RouteWhy.HOME and choose(servers, home=0).index == 0
    down = [ServerView(0, up=False), ServerView(1, free=1)]
    assert choose(down, home=0, was_down=True).index == 1


def test_a_new_session_prefers_its_prefix_then_a_checkpoint_then_the_least_loaded():
    assert choose([ServerView(0, free=2), ServerView(1, free=1, same_prefix=True)]).why is RouteWhy.SAME_PREFIX
    assert choose([ServerView(0, free=2), ServerView(1, free=1, checkpoint=True)]) .index == 1
    assert choose([ServerView(0, free=1, idle=2), ServerView(1, free=2, idle=2)]).index == 1
    assert choose([ServerView(0, free=1, queued=3), ServerView(1, free=1, queued=0)]).index == 1
    assert choose([ServerView(0, free=1, owned=True), ServerView(1, free=2)]).why is RouteWhy.OWNED
    full_prefix = [ServerView(0, free=0, same_prefix=True), ServerView(1, free=1)]
    assert choose(full_prefix).why is RouteWhy.LEAST_LOADED


def test_side_calls_go_to_the_least_loaded_and_nothing_goes_to_a_down_server():
    assert choose([ServerView(0, busy=2), ServerView(1)], side=True).why is RouteWhy.SIDE_CALL
    assert choose([ServerView(0, up=False), ServerView(1, up=False)]) is None


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 4), st.integers(0, 4), st.integers(0, 3)), min_size=1,
                max_size=5))
def test_never_a_down_server_and_a_free_slot_wins_over_none(specs):
    servers = [ServerView(i, up=u, free=f, idle=f + b, busy=b, queued=q) for i, (u, f, b, q) in enumerate(specs)]
    choice = choose(servers)
    ups = [v for v in servers if v.up]
    if not ups:
        assert choice is None
        return
    assert choice is not None and servers[choice.index].up
    if any(v.free for v in ups):
        assert servers[choice.index].free > 0


def test_slot_counts_and_prefix_from_slot_views():
    views = [SlotView(0, n_tokens=10, prefix="p"), SlotView(1, busy=True), SlotView(2, last_used=99.0, owner="x"),
             SlotView(3)]
    assert slot_counts(views, 100.0, 120.0) == (2, 3, 1)
    assert slot_counts(views, 100.0, 120.0, exclude=(3,)) == (1, 3, 1)
    assert holds_prefix_free(views, "p", 100.0, 120.0) and not holds_prefix_free(views, "q", 100.0, 120.0)


def test_health_goes_down_once_backs_off_and_comes_back():
    h = Health()
    assert h.failed(10.0) is Change.WENT_DOWN and h.failed(11.0) is Change.NONE
    assert not h.due(11.5) and h.due(11.0 + backoff(2))
    assert backoff(1) < backoff(2) < backoff(3) and backoff(50) == PROBE_MAX
    assert h.ok(20.0) is Change.CAME_BACK and h.up and h.failures == 0


def test_a_session_whose_conversation_a_server_keeps_goes_back_there():
    """Sim seed 201: a session paged out on one server was placed on the other (free-same-prefix) and prefilled
    its conversation again. Its page there outranks a free slot with its prefix elsewhere (not an owned slot)."""
    from slotlogic.routing import RouteWhy, ServerView, choose
    views = [ServerView(0, free=0, idle=2, kept=True), ServerView(1, free=2, idle=2, same_prefix=True)]
    assert choose(views).why is RouteWhy.KEPT
    assert choose(views).index == 0
    owned = [ServerView(0, kept=True), ServerView(1, owned=True)]
    assert choose(owned).index == 1 and choose(owned).why is RouteWhy.OWNED
    assert choose([ServerView(0, up=False, kept=True), ServerView(1)]).index == 1  # never a down server


def test_a_session_goes_back_to_the_server_that_knows_it_before_the_one_that_parsed_it():
    # another candidate knows it: that keeper answers from its memory (the parsing one would have pinned it)
    assert routing.go_back([False, True, True], 2, True, True) == routing.GoBack(1)
    assert routing.go_back([False, True], 1, True, True) == routing.GoBack(None)    # only the parsing server
    assert routing.go_back([False, True], 1, True, False) is None                    # ... which is down: choose
    assert routing.go_back([False, False], None, True, True) == routing.GoBack(None)  # parsed off the list
    assert routing.go_back([False, False], 0, False, True) is None                   # new to every server
    assert routing.failed_over(None, False) is False                                 # no server before
    assert routing.failed_over(True, False) is False and routing.failed_over(False, False) is True
    assert routing.failed_over(True, True) is True                                   # could not reach it


def test_a_full_server_is_chosen_again_only_for_what_needs_no_free_slot():
    a, b = routing.ServerView(0, free=1, idle=2, kept=True), routing.ServerView(1, free=1, idle=2)
    assert routing.choose([a, b]).why is RouteWhy.KEPT and routing.wants_free([a, b], a, side=False)
    shown = [routing.full(a), b]
    assert routing.choose(shown) == routing.RouteChoice(1, RouteWhy.LEAST_LOADED)
    assert not routing.wants_free(shown, b, side=True)                               # a side call never
    assert not routing.wants_free([routing.full(a), routing.full(b)], a, side=False)  # nowhere free: any slot


def test_a_new_session_goes_where_another_session_holds_more_of_its_prompt_than_a_checkpoint_gives():
    """A subagent whose sibling is prefilling their family prompt on server 0 (one free slot left) goes there to
    copy it, not to the idle server 1 to prefill it again; the most shared wins; only with a free slot; a share a
    checkpoint gives anyway (or too small to be worth a save and a restore) is no source."""
    sibling = [ServerView(0, free=1, busy=1, source=4000), ServerView(1, free=2)]
    assert choose(sibling) == routing.RouteChoice(0, RouteWhy.SOURCE)
    both = [ServerView(0, free=1, source=3000), ServerView(1, free=2, source=4000)]
    assert choose(both).index == 1
    assert choose([ServerView(0, free=0, busy=2, source=4000), ServerView(1, free=2)]).why is RouteWhy.LEAST_LOADED
    assert choose([ServerView(0, free=1, source=4000, same_prefix=True), ServerView(1, free=2, same_prefix=True)]
                  ).why is RouteWhy.SAME_PREFIX                      # nothing to copy beats a copy
    assert routing.beyond(4000, 3000) == 4000 and routing.beyond(3100, 3000) == 0 and routing.beyond(200, 0) == 0
    assert routing.full(sibling[0]).source == 0
