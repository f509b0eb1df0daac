"""Where a new session's prompt already is on one server: how much of it a copy would give it.

Why: with several servers, a new session placed on the server where another session holds (or is computing)
the same leading messages, or a part of the same system prompt, starts from a copy of it (`Pager.page_plan`'s
seeds); placed on another server it prefills all of it again. Routing weighs this next to load
(`routing.ServerView.source`). Pure: the server's session table, ledger and page index come in.
"""

from __future__ import annotations

from collections.abc import Mapping

from slotlogic import lead as leads
from slotlogic import paging
from slotlogic.decisions import NeedSlot
from slotlogic.learned_prefix import PrefixLearner
from slotlogic.ledger import Ledger
from slotlogic.table import SessionTable


def shared_chars(need: NeedSlot, table: SessionTable, ledger: Ledger, pages: Mapping[str, paging.PageRecord],
                 identity: str, learner: PrefixLearner) -> int:
    """The most characters of `need`'s prompt that one session of this server shares and still has here: its
    conversation in a slot (or on its way there: it was placed, its request runs) or its restorable page;
    shared as leading messages (`slotlogic.lead`) or as a part of the stable prefix (`PrefixLearner.sharers`)."""
    key = need.ticket.session.key

    def here(other: str) -> bool:
        a = table.sessions.get(other)
        return other != key and (ledger.where(other) is not None or paging.restorable(pages.get(other), identity)
                                 or (a is not None and table.running.get(a.slot) == other))

    best = 0
    mine = leads.of(need.body)
    if mine is not None:
        for other, a in table.sessions.items():
            if a.lead is not None and here(other):
                best = max(best, leads.shared(mine, a.lead)[1])
    if need.stable is not None:
        best = max([best] + [chars for other, chars in learner.sharers(need.stable) if here(other)])
    return best
