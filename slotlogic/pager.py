"""The pager of one server's core: what to save and restore around a slot's new owner, and the page index.

Why apart: the keeper decides requests; the pager decides slot moves (page-outs, page-ins, seeds, the page
index in the shared state), asked by the driver once a slot's turn has come. Same rules as the keeper: pure,
typed facts in and typed plans out (`slotlogic.paging`). It reads the session table, the ledger and the
learned prefixes it is given, and what the keeper knows of the server (`PagerHost`), and owns only the page
index (as of the last state transaction) and the counter that makes its page file names unique.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from slotlogic import costs, handover, paging, shared
from slotlogic import lead as leads
from slotlogic.decisions import NeedSlot, Report
from slotlogic.learned_prefix import PrefixLearner
from slotlogic.ledger import Ledger, tolerance
from slotlogic.page_names import PageNames
from slotlogic.ranking import SlotView
from slotlogic.seeds import Seeds
from slotlogic.settings import SESSION_KEEP_SECONDS, Settings
from slotlogic.table import SessionTable


class PagerHost(Protocol):
    """What the pager reads of its keeper: the server as last seen, this process's name, the prefill speed."""

    @property
    def page_identity(self) -> str: ...

    @property
    def instance(self) -> str: ...

    def prefill_estimate(self) -> float | None: ...

    def rates(self) -> costs.Rates: ...


class Pager:
    def __init__(self, settings: Settings, upstream: str, table: SessionTable, ledger: Ledger,
                 learner: PrefixLearner, host: PagerHost) -> None:
        self.settings = settings
        self.upstream = upstream
        self.table = table
        self.ledger = ledger
        self.learner = learner
        self.host = host
        self.index: dict[str, paging.PageRecord] = {}  # the page index as of the last state transaction
        self._names = PageNames(upstream)  # pages plans are about to restore; the ring of a save dir out of reach
        self._seq = 0
        self._seeds = Seeds(self)

    @property
    def names(self) -> PageNames:
        return self._names

    def claim_names(self, plan: paging.PagePlan, ring: int) -> tuple[paging.PagePlan, frozenset[str]]:
        """`plan` with the ring names its saves take held for it (`PageNames.writes`)."""
        return self._names.writes(plan, ring, self.index)

    def let_go(self, key: str) -> None:
        """`key`'s conversation leaves its slot unsaved, by a cost decision: a loss by choice (`Cause.LET_GO`)."""
        self.ledger.not_paged(key)

    @property
    def seeds(self) -> Seeds:
        """Where a new session's start comes from (slotlogic/seeds.py)."""
        return self._seeds

    @property
    def page_identity(self) -> str:
        return self.host.page_identity

    def load(self, pages: Mapping[str, paging.PageRecord]) -> None:
        """The page index of a state just read or written."""
        self.index = dict(pages)

    def keeps(self, state: shared.ServerState, key: str) -> bool:
        """`key`'s conversation is on this server: a restorable page of it in `state`, or a slot still holding
        it (where routing sends it back, to be paged in rather than prefilled elsewhere)."""
        if paging.restorable(state.pages.get(key), self.page_identity, 1):
            return True
        return self.ledger.where(key) is not None

    def has(self, key: str) -> bool:
        return key in self.index

    def page_of(self, key: str) -> paging.PageRecord | None:
        """`key`'s page as the index has it (a value: never edit it)."""
        return self.index.get(key)

    def page_plan(self, ask: paging.PageAsk) -> paging.PagePlan:
        """What to page out of and into `ask.slot` before `ask.session_key`'s request goes there, asked once the
        slot's paging lock is held (every request sent to the slot before has reached the server). A session
        with no page of its own may start from a seed: another's conversation it shares more with than the
        slot gives it (docs/paging.md, "Seeds"). Each move is weighed by its cost (`slotlogic.costs.judge`)."""
        plan, holder, tokens = self._plan(ask)
        return self._judged(plan, holder, tokens)

    def _judged(self, plan: paging.PagePlan, holder: str | None, tokens: int | None) -> paging.PagePlan:
        """`plan` without the moves that cost more than the prefill they spare (`slotlogic.costs.judge`)."""
        rates = self.host.rates()
        if plan.empty or not rates.measured or not self.settings.cost_model:
            return plan
        if tokens is None and holder:
            tokens = self.ledger.conversations.get(holder) or None
        rec = self.index.get(plan.restore_for or "")
        restore_bytes = rec.bytes if rec is not None and rec.file == plan.restore_file else 0
        seed, seed_tokens = plan.seed, 0
        if seed is not None:  # another's conversation: what it spares is the part the two share
            seed_tokens = seed.chars // paging.CHARS_PER_TOKEN if seed.chars else \
                self.ledger.conversations.get(seed.source, 0)
        return costs.judge(plan, rates, holder_tokens=tokens, restore_bytes=restore_bytes, seed_tokens=seed_tokens)

    def _plan(self, ask: paging.PageAsk) -> tuple[paging.PagePlan, str | None, int | None]:
        """`page_plan` before its costs are weighed, with the slot's holder and its tokens (None: unknown)."""
        slot, session_key, view, given = ask.slot, ask.session_key, ask.view, ask.given
        model = self.page_identity
        holder, tokens = (handover.holder(given, ask.ours), None) if given is not None \
            else self._holder(slot, view, ask.sent)
        # An older copy (its conversation went on elsewhere) is nobody's page. After a handover our ledger has
        # lost sight of the slot, but the handover says whose conversation is there: only a newer copy in
        # another of our slots overrules it.
        older = self.ledger.moved_on(slot, holder) if given is None else self.ledger.where(holder) not in (None, slot) \
            if holder else False
        if holder and older:
            holder, tokens = None, 0
        rec = self.index.get(session_key)
        holds_own = (slot not in self.table.dispatched and view.owner == session_key and rec is not None
                     and (view.n_tokens or 0) >= rec.n_tokens)  # a restarted proxy, its session still there
        self._seq += 1
        salt = f"{self.host.instance}:{self._seq}"
        ring = self._names.ring(ask.ring, self.index) if self.settings.save_remote else None
        plan = paging.plan(slot, session_key, holder, tokens, self.index,
                           paging.PageFiles(self.upstream, model, salt, ring), holds_own=holds_own)
        if plan.restore_file is not None:
            return (self._current_page(plan, session_key, salt, ring) if ask.copy_live else plan), holder, tokens
        if holder == session_key or holds_own:
            return plan, holder, tokens
        if ask.copy_live:  # no page, but its conversation is whole in another slot (its claim there is still to run)
            live = self._current_page(plan, session_key, salt, ring)
            if live is not plan:
                return live, holder, tokens
        seed = self._seeds.any_seed(ask, holder)
        if seed is not None and ring is not None and seed.server is not None:
            seed = None  # another server's file is out of reach
        seeded = paging.seeded(plan, seed, self.index, self.upstream, salt, ring) if seed is not None else plan
        return seeded, holder, tokens

    def _current_page(self, plan: paging.PagePlan, key: str, salt: str,
                      ring: tuple[str, ...] | None) -> paging.PagePlan:
        """A page older than the conversation it stands for (or no page at all) is not current: when the ledger
        says the whole conversation is still in another slot (its session displaced by a claim whose request has
        not run there yet), that slot is paged out again first and the new page restored; else the old page is
        restored and the rest prefilled (the loss meter names it `stale-page`)."""
        conversation = self.ledger.conversations.get(key, 0)
        if conversation <= 0 or plan.restore_tokens + tolerance(conversation) >= conversation:
            return plan
        for other in range(self.ledger.total):
            entry = self.ledger.entry(other)
            if other != plan.slot and self.ledger.conversation_on(other) == key and entry.tokens > plan.restore_tokens:
                return paging.seeded(plan.without_seed(), paging.Seed(key, 0, other), self.index, self.upstream, salt,
                                     ring)
        return plan

    def _holder(self, slot: int, view: SlotView, sent: tuple[str, float] | None) -> tuple[str | None, int]:
        """Whose conversation `slot` holds, and how many tokens (`paging.holder_of`), given what this process
        sent there, the snapshot's claim, and `sent` (the slot's last paged send of any proxy)."""
        dispatched = self.table.dispatched
        if self.host.instance and dispatched.get(slot) is not None:
            # One writer per slot (slotlogic.handover): what another proxy did there came with its answer
            # (`given`), and since then only we wrote it. The state's newer claims say nothing of its content.
            return paging.holder_of(slot, view, dispatched)
        if view.owner is not None and view.owner not in self.table.sessions and dispatched.get(slot):
            # The snapshot names another proxy's session as the slot's newest claim (`shared.views` shows
            # a claim from the shared state only when it is newer than what this process did there): it
            # ran after our last request, and is what a save would write now, not ours.
            dispatched = {k: v for k, v in dispatched.items() if k != slot}
        if sent is not None and sent[0] != dispatched.get(slot):
            ours = self.table.sessions.get(dispatched.get(slot) or "")
            if ours is None or ours.last_used < sent[1]:  # the last paged send came after ours: its conversation
                dispatched = {**dispatched, slot: sent[0]}
        return paging.holder_of(slot, view, dispatched)

    def busy_source(self, ask: paging.PageAsk) -> paging.SourceWait | None:
        """The busy slot worth waiting for before the paging lock (`Seeds.busy_source`)."""
        if not ask.views or ask.session_key in self.index:
            return None
        return self._seeds.busy_source(ask, self._holder(ask.slot, ask.view, ask.sent)[0])

    def page_coming(self, ask: paging.PageAsk, have: paging.Seed | None) -> str | None:
        """The session whose page, being written now, would seed `ask` better than `have` (`Seeds.page_coming`)."""
        return self._seeds.page_coming(ask, self._holder(ask.slot, ask.view, ask.sent)[0], have)

    def pages_seen(self, state: shared.ServerState, session_key: str, now: float, wait: float) -> bool:
        """Take the page index of a fresh read of the shared state; True while `session_key`'s own page is
        being written by another pager (recorded, not restorable yet, for less than `wait` seconds): worth
        waiting for, a page-in beats prefilling the conversation again."""
        self.index = dict(state.pages)
        rec = state.pages.get(session_key)
        return rec is not None and rec.n_tokens == 0 and now - rec.saved < wait

    def page_intent(self, state: shared.ServerState, plan: paging.PagePlan, now: float) -> list[str]:
        """Before the save is sent: its page is in the index (not restorable yet), so a kill between the save
        and `pages_recorded` leaves no file the state does not know. Returns the replaced page's file. A name
        of the bounded ring that another session's page had goes with its record (overwritten)."""
        replaced = []
        for key, file in plan.saves:
            for other in [k for k, rec in state.pages.items() if k != key and rec.file == file]:
                del state.pages[other]
                self._dropped(other)
            old = paging.intent(state.pages, key, file, now, self.page_identity)
            if old:
                replaced.append(old)
        self.index = dict(state.pages)
        return replaced

    def pages_recorded(self, state: shared.ServerState, plan: paging.PagePlan, done: paging.PageDone, now: float,
                       budget: int, files: Mapping[str, paging.PageFile] | None) -> list[str]:
        """The page index after a paging step (the new pages; a failed save or restore dropped with its file;
        the budget applied and, given the save dir's page files, orphans swept); returns the files to delete."""
        saved_tokens, saved_bytes, restore_failed = done.saved_tokens, done.saved_bytes, done.restore_failed
        seed_saved = done.seed_saved
        doomed: list[str] = []
        for key, file in plan.saves:
            holder = key == plan.save_for and file == plan.save_file
            done = seed_saved if not holder else (saved_tokens, saved_bytes) if saved_tokens is not None else None
            rec = state.pages.get(key)
            ours = rec is not None and rec.file == file  # else another process saved it since
            if done is not None and done[0] >= paging.MIN_TOKENS and ours:
                paging.saved(state.pages, key, file, done[0], done[1], now, self.page_identity)
            else:  # a failed save (its file may be half written), one superseded, or one that found the slot
                # (next to) empty (idle clearing: recorded with 0 tokens it read as a page still being written,
                # and a placement of its session waited for it): its file goes
                if ours:
                    state.pages.pop(key)
                doomed.append(file)
        theirs = plan.seed is not None and plan.seed.page is not None  # another server's page: never ours to drop
        if restore_failed and plan.restore_for and plan.restore_file and not theirs:
            rec = state.pages.get(plan.restore_for)
            if rec is not None and rec.file == plan.restore_file:
                state.pages.pop(plan.restore_for)
            doomed.append(plan.restore_file)
        keep = frozenset(k for k in (plan.save_for, plan.restore_for) if k)
        if files is None:  # the save dir not read: our records alone
            for gone in paging.over_budget(state.pages, budget, keep=keep):
                doomed.append(state.pages.pop(gone).file)
                self._dropped(gone)
        else:  # the page just saved is the newest: it goes only when it alone is over the budget
            doomed += self._room(state, {n: f for n, f in files.items() if n not in doomed}, budget, now, 0,
                                 keep - {plan.save_for})[0]
        self.index = dict(state.pages)
        return doomed

    def page_room(self, state: shared.ServerState, plan: paging.PagePlan, now: float, budget: int,
                  files: Mapping[str, paging.PageFile]) -> tuple[list[str], bool]:
        """Before the plan's saves are recorded and sent: room in the save dir for what they will write
        (`paging.disk_room`), so the budget holds while they are written. Returns the files to delete, and whether
        the saves fit (if not, they are not made: `PagePlan.without_saves`)."""
        rates = self.host.rates()
        tokens = sum(self.ledger.conversations.get(key, 0) for key, _ in plan.saves)
        known = [(r.bytes, r.n_tokens) for r in state.pages.values() if r.bytes > 0 and r.n_tokens > 0]
        per_token = rates.kv_bytes_per_token or max((b / n for b, n in known), default=0.0)
        incoming = int(tokens * per_token) if per_token and tokens else max((f.size for f in files.values()), default=0)
        keep = frozenset(k for k in (plan.restore_for,) if k)
        doomed, fits = self._room(state, files, budget, now, incoming, keep,
                                  frozenset(f for f in (plan.restore_file,) if f))
        self.index = dict(state.pages)
        return doomed, fits

    def _room(self, state: shared.ServerState, files: Mapping[str, paging.PageFile], budget: int, now: float,
              incoming: int, keep: frozenset[str], keep_files: frozenset[str] = frozenset()) -> tuple[list[str], bool]:
        keep_files |= frozenset(self._names.reading)
        keep |= frozenset(k for k, rec in state.pages.items() if rec.file in self._names.reading)
        drop, doomed, fits = paging.disk_room(files, state.pages, budget, now, keep_seconds=SESSION_KEEP_SECONDS,
                                              incoming=incoming, keep=keep, keep_files=keep_files)
        for key in drop:
            state.pages.pop(key, None)
            self._dropped(key)
        return doomed, fits

    def _dropped(self, key: str) -> None:
        """`key`'s page goes to keep the save dir within its budget: with its conversation in no slot, its next
        turn prefills it again by that choice."""
        if self.ledger.where(key) is None:
            self.ledger.not_paged(key)

    def page_doubtful(self, report: Report) -> paging.PageCheck | None:
        """The request that followed a page-in reused less than half of the page: drop the page."""
        t = report.ticket
        rec = self.index.get(t.session.key)
        if not t.paged_in or rec is None:
            return None
        return paging.doubtful(rec.n_tokens, report.obs.cache_n)

    def page_dropped(self, state: shared.ServerState, key: str, file: str) -> list[str]:
        """Forget `key`'s page `file` (a check failed; a newer page of it stays); returns the file to delete."""
        rec = state.pages.get(key)
        if rec is not None and rec.file == file:
            del state.pages[key]
        self.index = dict(state.pages)
        return [file]

    def holds_prefix(self, need: NeedSlot, view: SlotView) -> bool:
        """The chosen slot still holds the session's stable prefix (no checkpoint work needed): another
        session's conversation with the same prefix, or this session's own (it comes back to a slot nobody
        took since, its memory entry expired): a restore would replace that conversation with the prefix."""
        key = need.ticket.session.key
        # `/slots` did not answer (a loaded machine answers it past its time-out): what the ledger says the slot
        # holds. Read as empty, the slot would get a prefix restored over the conversation it still holds.
        held = view.n_tokens if view.n_tokens is not None else self.ledger.entry(view.id).tokens
        if (held or 0) <= 0:
            return False
        holder = self.table.dispatched.get(view.id) or view.owner
        prefix = view.prefix
        if view.owner in self.table.sessions and view.owner != holder:
            # a claim of ours whose request has not gone out: the slot still holds what was sent there last,
            # not the prefix the claim names
            prefix = self.table.sessions[holder].prefix if holder in self.table.sessions else None
        # Two unknown prefixes are no match: a session displaced from its slot with no signature, finding
        # another client's conversation with none either, would take it for "holding its prefix", skip the
        # prefix restore and prefill all of it.
        if (prefix is not None and prefix == need.prefix) or view.owner == key:
            return True
        # The conversation left there (its holder was paged out, not erased) starts with all of our prefix:
        # a warm-up would cut it back to the prefix, losing the messages we share beyond it.
        if need.stable is None or holder is None:
            return False
        # A sibling's first message differs in its last line, so no message is shared, but its text starts with
        # all of our prefix (a subagent queued on its sibling's slot would restore the base prefix over the
        # sibling's conversation and prefill their family's part again)
        if self.learner.share_of(need.stable, holder) >= len(need.stable.text):
            return True
        ours, theirs = self.table.sessions.get(key), self.table.sessions.get(holder)
        if ours is None or theirs is None:
            return False
        n, chars = leads.shared(ours.lead, theirs.lead)
        return n > 0 and chars >= len(need.stable.text)
