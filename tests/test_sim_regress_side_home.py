"""Regression: the shrunk program of tests/test_sim_stateful.py's ledger failure, replayed without hypothesis.

Two servers of two slots, no paging: a session, its subagent (on the other server), then two title calls of one
side-call home. The pool sends each side call to the least loaded server, so the home's first call (title.0.*)
runs on slot 1 of :8081 and its second (title.1.*) on slot 1 of :8080. Each server's ledger says exactly what
its slot 1 holds: the 29 prompt tokens of the call that ran there. The two calls share a prompt (the title
system prompt, 23 tokens), not a conversation, so :8081's slot holds 23 tokens of the newer call's: the
invariant must judge a ledger entry by the call that ran on that slot, not by the home's newest call anywhere.
"""

from __future__ import annotations

import logging
from typing import Any

from tests.test_sim_stateful import SlotTraffic


class _Draw:
    """`st.data()` as the shrunk program drew it: one fixed value."""

    def __init__(self, value: int) -> None:
        self.value = value

    def draw(self, strategy: Any) -> int:
        return self.value


def test_a_side_call_home_on_two_servers_is_judged_by_the_call_on_each_slot() -> None:
    log = logging.getLogger("slotkeeper")
    level = log.level
    log.setLevel(logging.ERROR)
    m = SlotTraffic()
    try:
        m.deploy(slots=2, paging=False, proxies=1, servers=2)
        steps = [lambda: m.new_session(marker=False, stream=False),
                 lambda: m.subagent(data=_Draw(0), turns=1),
                 lambda: m.side_call(data=_Draw(0)),
                 lambda: m.side_call(data=_Draw(1))]
        for step in steps:
            step()
            m.belief_matches_the_slots()
            m.nothing_lost_unknowingly()
        assert m.rig is not None
        titles = [(o.tag, o.server, o.done.slot if o.done else None, o.meta.get("session"))
                  for o in m.rig.outcomes if o.tag.startswith("title.")]
        assert len(titles) == 2 and titles[0][3] == titles[1][3]  # one home, two calls
    finally:
        m.teardown()
        log.setLevel(level)
