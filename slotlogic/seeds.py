"""Where a new session's start comes from: another session's conversation it shares the most with (a seed),
live in a slot of this server, paged out, or live on another server of the pool, and whether a busy one is worth
waiting for. Read by the pager (`Pager.page_plan`, `Pager.busy_source`); pure, as the pager is."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from slotlogic import lead as leads
from slotlogic import paging
from slotlogic import prefix as pfx
from slotlogic.decisions import NeedSlot
from slotlogic.paging import SEED_MIN_CHARS
from slotlogic.ranking import SlotView

if TYPE_CHECKING:
    from slotlogic.pager import Pager


class Seeds:
    def __init__(self, pager: Pager) -> None:
        self.p = pager  # its table, page index, prefix learner and settings, as they are at each call

    def busy_source(self, ask: paging.PageAsk, holder: str | None) -> paging.SourceWait | None:
        """The slot of the conversation `session_key` would start from if that slot were not running a request
        now (two sessions that start together: the first is still prefilling what the second would copy), and
        how long waiting for it is worth (`paging.source_wait`); None when nothing better is worth waiting for.
        Asked before the slot's paging lock is taken; `page_plan` decides again after the wait."""
        if holder == ask.session_key:
            return None
        now = self.any_seed(ask, holder)
        then = self.any_seed(ask, holder, busy_too=True)
        cold, stable_chars = ask.cold, ask.stable_chars
        if then is None or then.slot is None or (now is not None and (now.slot, now.server) == (then.slot, None)):
            return None
        gain = then.chars - (now.chars if now is not None else ask.base_chars if cold is not None else stable_chars)
        wait = self.wait_worth(then.slot, gain)
        return replace(wait, session=then.source) if wait is not None else None

    def wait_worth(self, slot: int, gain: int) -> paging.SourceWait | None:
        """Waiting for a busy `slot` whose copy would spare `gain` characters: worth what prefilling them takes
        at the measured rate (`paging.source_wait`, `paging.keep_waiting`); None when not worth any."""
        wait = self.worth(gain)
        if wait <= 0:
            return None
        return paging.SourceWait(slot, wait, gain // paging.CHARS_PER_TOKEN, self.p.settings.seed_wait,
                                 self.p.host.rates().decode_cost)

    def worth(self, gain: int) -> float:
        """Seconds worth waiting for a source (a slot, a page) whose copy spares `gain` characters: what
        prefilling them takes at the measured rate, at most `seed_wait` (`paging.source_wait`); 0: none."""
        return paging.source_wait(gain, self.p.host.prefill_estimate(), self.p.settings.seed_wait)

    def source_idle(self, source: int, live: Sequence[object]) -> bool:
        """The slot waited for (`busy_source`) is idle now: `/slots` says so and no request this process sent
        there is still unanswered (an answer completes a moment after the slot goes idle)."""
        return source not in self.p.table.running and any(
            isinstance(e, Mapping) and e.get("id") == source and not e.get("is_processing") for e in live)

    def any_seed(self, ask: paging.PageAsk, holder: str | None, busy_too: bool = False) -> paging.Seed | None:
        """What `page_plan` would seed the slot with (`busy_too`: if every live source here were idle). A source on
        another server (`ask.elsewhere`) when it gives a seed's worth more than this server does."""
        slot, key, views = ask.slot, ask.session_key, ask.views
        seed = self._seed(slot, key, holder, ask.view, views, ask.stable_chars, busy_too)
        if seed is None and ask.cold is not None:
            seed = self._prefix_seed(slot, key, holder, views, ask.cold, busy_too, self._held(ask, holder))
        far, beat = ask.elsewhere, ask.base_chars if ask.cold is not None else ask.stable_chars
        if far is not None and not busy_too and far.chars >= max(beat, seed.chars if seed else 0) + SEED_MIN_CHARS:
            return far
        return seed

    def source_for(self, need: NeedSlot, total: int, before: int | None) -> tuple[paging.Seed, bool] | None:
        """For another server of the pool placing `need` (its placement numbered `before`): the session of this
        server it would copy the most of (leading messages, or a part of its stable prefix), idle in its slot,
        running its request there, or placed there before `need` (the pool numbers its placements: of two, only
        the later waits for the earlier); with whether that slot still runs (the other server waits for it).
        A session displaced from its slot here is a source too, by its page (`slot` None): restorable, or being
        written by the placement that took its slot (the other server waits for it, `PoolSeeds.find`)."""
        key, mine, views = need.ticket.session.key, leads.of(need.body), [SlotView(i) for i in range(total)]
        shares = dict(self.p.learner.sharers(need.stable)) if need.stable is not None else {}
        best: tuple[paging.Seed, bool] | None = None
        for other, a in self.p.table.sessions.items():
            lead = leads.shared(mine, a.lead)[1] if mine is not None and a.lead is not None else 0
            chars = max(lead, shares.get(other, 0))
            if other == key or chars <= (best[0].chars if best else 0):
                continue
            live = self._idle_on(other, -1, views, busy_too=True, before=before)
            if live is not None:
                seed = paging.Seed(other, chars, live, prefix=chars > lead, server=self.p.upstream)
                best = (seed, live in self.p.table.running)
            elif self.paged(other):
                best = (paging.Seed(other, chars, prefix=chars > lead, server=self.p.upstream), False)
        return best

    def paged(self, key: str) -> bool:
        """`key`'s page here is restorable, or being written now (recorded, not saved yet; or its slot taken by a
        placement that pages it out first)."""
        rec = self.p.index.get(key)
        if paging.restorable(rec, self.p.page_identity) or (rec is not None and rec.n_tokens == 0):
            return True
        # a session placed whose first request has not been answered has no conversation to page out yet
        return self.p.ledger.conversations.get(key, 0) >= paging.MIN_TOKENS and self.taken(key, -1)

    def _seed(self, slot: int, key: str, holder: str | None, view: SlotView, views: Sequence[SlotView],
              stable_chars: int, busy_too: bool = False) -> paging.Seed | None:
        """The conversation `key` should start from, if any: a live session of ours idle on another slot (the
        last sent there, by `/slots` not busy) or a page, whichever shares the most of its leading messages."""
        mine = self.p.table.sessions.get(key)
        if mine is None or mine.lead is None:
            return None
        left = self.p.table.sessions.get(holder or "")
        have = leads.shared(mine.lead, left.lead)[1] if left is not None and view.n_tokens != 0 else 0
        table = self.p.table
        candidates = [(other, a.lead, self._idle_on(other, slot, views, busy_too, table.order(key)))
                      for other, a in table.sessions.items() if other not in (key, holder) and a.lead is not None]
        return paging.choose_seed(mine.lead, candidates, self.p.index, self.p.page_identity,
                                  beat=max(have, stable_chars))

    def _held(self, ask: paging.PageAsk, holder: str | None) -> int:
        """How much of `ask.cold` the slot gives anyway: its holder's conversation stays there once paged out
        (a sibling of the same family holds all of it)."""
        if holder is None or ask.cold is None or ask.view.n_tokens == 0:
            return 0
        return self.p.learner.share_of(ask.cold, holder)

    def _prefix_seed(self, slot: int, key: str, holder: str | None, views: Sequence[SlotView],
                     cold: pfx.StablePrefix, busy_too: bool = False, held: int = 0) -> paging.Seed | None:
        """The session that shares the most of `cold` (all of it: its first system message starts with it; or a
        part of it, as a subagent of another family shares the base prompt): its restorable page (no save needed),
        else its live slot when idle (another of ours). A subagent's family prefix is its parent's, paged out or
        waiting on its slot: copying it in spares prefilling the part a base checkpoint does not hold; a part
        copied spares that part, the warm-up prefills the rest. None unless it shares more than the slot's holder
        (`held`): a restore takes milliseconds, the part only it shares a prefill."""
        best: paging.Seed | None = None
        for other, chars in self.p.learner.sharers(cold):
            if other in (key, holder) or chars <= held or (best is not None and chars <= best.chars):
                continue
            if paging.restorable(self.p.index.get(other), self.p.page_identity):
                best = paging.Seed(other, chars, prefix=True)
            elif (live := self._idle_on(other, slot, views, busy_too, self.p.table.order(key))) is not None:
                best = paging.Seed(other, chars, live, prefix=True)
        return best

    def _idle_on(self, key: str, slot: int, views: Sequence[SlotView], busy_too: bool = False,
                 before: int | None = None) -> int | None:
        """The slot `key` holds, other than `slot`: its request was the last this process sent there and its
        answer completed there, and `/slots` says the slot is idle (`busy_too`: or running `key`'s request, or
        about to: `key` was placed there before the placement numbered `before`). A session placed whose request
        has not gone out yet holds nothing now."""
        table = self.p.table
        a = table.sessions.get(key)
        if a is None or a.slot == slot or a.slot >= len(views) or table.holders.get(a.slot) != key:
            return None
        if busy_too and table.running.get(a.slot) == key and table.placed_before(key, before):
            return a.slot  # its request is on its way there, or running
        if table.dispatched.get(a.slot) != key:
            return None
        if busy_too:
            return a.slot if table.running.get(a.slot) in (None, key) else None
        return a.slot if not views[a.slot].busy and a.slot not in table.running else None

    def share(self, need: NeedSlot) -> int:
        """How much of a new session's prompt this server holds, for routing (`routing.ServerView.source`): with
        several servers, placed where another session holds (or is computing) its leading messages or a part of
        its system prompt, it starts from a copy; elsewhere it prefills all of it again. The most characters one
        session shares and still has here: its conversation in a slot (or on its way there: placed, its request
        running) or its restorable page; as leading messages (`slotlogic.lead`) or a part of the stable prefix
        (`PrefixLearner.sharers`)."""
        p, key = self.p, need.ticket.session.key

        def here(other: str) -> bool:
            a = p.table.sessions.get(other)
            return other != key and (p.ledger.where(other) is not None
                                     or paging.restorable(p.index.get(other), p.page_identity)
                                     or (a is not None and p.table.running.get(a.slot) == other))

        best = 0
        mine = leads.of(need.body)
        if mine is not None:
            for other, a in p.table.sessions.items():
                if a.lead is not None and here(other):
                    best = max(best, leads.shared(mine, a.lead)[1])
        if need.stable is not None:
            best = max([best] + [chars for other, chars in p.learner.sharers(need.stable) if here(other)])
        return best

    def page_coming(self, ask: paging.PageAsk, holder: str | None, have: paging.Seed | None) -> str | None:
        """A session whose page is being written now (`ask.paging_out`, or recorded and not saved yet: the
        placement that took its slot pages it out) and would seed `ask` with a seed's worth more than `have` or
        the slot gives: worth waiting for, its save takes milliseconds (`SlotMover.page`)."""
        key, p = ask.session_key, self.p
        beat = max(have.chars if have is not None else 0, ask.base_chars if ask.cold is not None else ask.stable_chars)
        shares = dict(p.learner.sharers(ask.cold)) if ask.cold is not None else {}
        mine = p.table.sessions.get(key)
        if mine is not None and mine.lead is not None:
            for other, a in p.table.sessions.items():
                if a.lead is not None:
                    shares[other] = max(shares.get(other, 0), leads.shared(mine.lead, a.lead)[1])
        coming = [(chars, other) for other, chars in shares.items() if other not in (key, holder)
                  and (other in ask.paging_out or ((rec := p.index.get(other)) is not None and rec.n_tokens == 0)
                       or self.taken(other, ask.slot))
                  and chars >= beat + SEED_MIN_CHARS]
        return max(coming)[1] if coming else None

    def taken(self, other: str, slot: int) -> bool:
        """`other`'s current conversation is on a slot (not `slot`) that another placement has claimed: that
        placement pages it out before it writes the slot, so its page is coming. Two subagents of one parent
        placed at once: one takes the parent's slot, the other would copy whatever else shares the base prompt
        (and the family's part of the prefix would be prefilled once for each)."""
        where = self.p.ledger.where(other)
        return where is not None and where != slot and any(c != other for c in self.p.ledger.claims_on(where))
