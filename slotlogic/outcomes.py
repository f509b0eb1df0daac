"""What one server's answers teach (pure): per-session counters, the loss meter's settlement, the server's prefill
rate, and affinity's learned slots.

Why apart: the keeper decides where a request goes; this part reads what came back. An answer settles the slot's
promise in the ledger (a shortfall is a loss, typed by cause), adds to its session's counters (the status view and
the exit summary), moves the server's prefill rate on, and, under affinity, teaches the slot llama-server chose.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Any, Protocol

from slotlogic import affinity, anthropic, anthropic_answer, costs, numbers, shared, wait
from slotlogic.answers import Observation
from slotlogic.board import client_kind
from slotlogic.decisions import Report, Ticket
from slotlogic.events import ContextOverflow, Event, SlotLearned, TokensLost
from slotlogic.ledger import Cause, Ledger, Loss, found_empty, tolerance
from slotlogic.reasons import Why
from slotlogic.server import ServerInfo
from slotlogic.stats import SessionStats
from slotlogic.table import SessionTable

RATE_MIN_TOKENS = 64  # a shorter prefill's rate is mostly the request's fixed overhead
RATE_WEIGHT = 0.3     # of the newest answer in the prefill rate's moving average
MAX_STATS = 1024  # sessions whose counters the status view and the summary show; the least recently answered go


class OutcomesHost(Protocol):
    """What the outcomes read of their keeper: the server's slot count as last seen."""

    @property
    def total_slots(self) -> int | None: ...


class Outcomes:
    def __init__(self, upstream: str, table: SessionTable, ledger: Ledger, host: OutcomesHost) -> None:
        self.upstream = upstream
        self.table = table
        self.ledger = ledger
        self.host = host
        self.stats: OrderedDict[str, SessionStats] = OrderedDict()
        self.learned: list[SlotLearned] = []  # affinity: slots learned from answers, for the driver to log
        self.prefill_speed: float | None = None  # the start-up probe's prefill tok/s (answers without timings)
        self.prefill_rate: float | None = None   # prompt tok/s of this server's recent answers (a moving average)
        self.speeds = costs.Speeds()  # slot save/restore throughput, KV bytes a token, the prefill fit (the drivers')
        self.idle_clearing = False  # this server was seen emptying idle slots: a slot found empty is that

    def prefill_estimate(self) -> float | None:
        """Prompt tokens a second on this server: its recent answers', else the start-up probe's."""
        return self.prefill_rate or self.prefill_speed

    def rates(self) -> costs.Rates:
        """The measured speeds a slot move's cost is weighed with (`slotlogic.costs`)."""
        return self.speeds.rates(self.prefill_estimate())

    def probed(self, prefill_tok_s: float | None) -> None:
        """The start-up probe's measured prefill speed (for answers that carry no timings)."""
        self.prefill_speed = prefill_tok_s

    def answered(self, ticket: Ticket, obs: Observation, *, path: str, seconds: float, now: float,
                 ask: bool = False) -> Report:
        """The answer moves the slot bookkeeping on (whose conversation a slot holds now) and returns the `Report`
        every view of the request is rendered from. `ask`: the server can be asked what emptied a slot; a loss
        of no known cause is then left unsettled (`settle_loss`) instead of being counted as `unknown` now."""
        slot = obs.id_slot if obs.id_slot is not None else ticket.slot
        if ticket.placed is not None:  # the server placed it: is where it ran known? (a loss's suspect if not)
            self.ledger.placed.answered(ticket.placed, learned=obs.error_type is None
                                        and affinity.valid(obs.id_slot, self.host.total_slots))
        if ticket.learn is not None and ticket.learn is not affinity.Learn.SLOTS and obs.error_type is None:
            learned = self.learn(ticket, obs.id_slot, now)
            if learned is not None:
                self.learned.append(learned)
        key = ticket.session.key
        loss = None
        if obs.error_type is None:
            ran = obs.id_slot if ticket.slot is None else None  # the server chose the slot (affinity, or unpinned)
            queued = ran is not None and self.queued_behind(ran, key)
            if ran is not None and self.ledger.entry(ran).owner != key:
                self.ledger.ran_unpinned(ran, key, queued=queued)
            if ran is not None and not queued:
                self._follow(ticket, ran, now)
            loss = self.ledger.settle(key, ticket.promise, slot, obs.cache_n, obs.prompt_n, ticket.extends)
            if queued:
                self.ledger.overrun(key)
        self.table.answered(key, slot, now)
        self._measure(obs)
        stats = self.stats.pop(key, None) or SessionStats()
        self.stats[key] = stats  # most recently answered last
        saved_s = min(self.saved_seconds(obs.cache_n), stats.unclaimed(seconds))
        stats.add(obs, slot, ticket.session.source, saved_s, seconds)
        stats.answered = now
        settled = True
        if loss is not None and loss.cause is Cause.UNKNOWN:
            if self.idle_clearing and obs.cache_n is not None and obs.cache_n <= tolerance(loss.tokens):
                loss = Loss(loss.tokens, Cause.IDLE_CLEAR)  # this server was seen emptying idle slots
            else:
                settled = not ask
        if loss is not None and settled:
            stats.count_loss(loss.tokens, loss.expected)
        while len(self.stats) > MAX_STATS:
            self.stats.popitem(last=False)
        return Report(ticket, obs, slot, path, self.upstream, seconds, loss, settled, saved_s)

    def _measure(self, obs: Observation) -> None:
        """The answer's prompt and generation speeds into the server's rate and the prefill fit."""
        pps = numbers.rate(obs.prompt_per_second)   # checked again: an infinity here stays NaN for good
        if pps and obs.prompt_n and obs.prompt_n >= RATE_MIN_TOKENS:
            old = self.prefill_rate
            self.prefill_rate = pps if old is None else old + RATE_WEIGHT * (pps - old)
            self.speeds.prefill(obs.prompt_n, obs.cache_n, pps)
        self.speeds.decode(obs.decode_per_second)

    def saved_seconds(self, cache_n: int | None) -> float:
        """What prefilling `cache_n` cached tokens from an empty slot would have cost this server: its fitted
        per-token cost and growth with depth (`costs.Rates.prefill_s`), else its measured rate. Never the answer's
        own prompt speed: a short prompt's speed is mostly the request's fixed cost, and at a fraction of the
        server's real rate it would price the cached tokens several times over. 0 while no rate is known. (The
        session's counters bound what is counted by the time its requests took: `SessionStats.unclaimed`.)"""
        rates = self.rates()
        return rates.prefill_s(cache_n) if cache_n and rates.prefill_tps else 0.0

    def found_empty(self, slot: int, key: str, saved: int, state: shared.ServerState | None = None,
                    now: float = 0.0) -> bool | None:
        """Our page-out of `key` found its slot (next to) empty where its conversation was (`ledger.found_empty`;
        with `state`, a fresh read of the shared state, also where another proxy's session ran last): the
        server emptied it, and the driver asks it why and tells `emptied`. None: ask again with `state`."""
        found = found_empty(self.ledger, slot, key, saved)
        if found is None and state is not None:
            return shared.ran_there(state, slot, key, now, self.table.ttl)
        return found

    def emptied(self, key: str, cause: Cause) -> None:
        """What emptied `key`'s slot before our page-out, as the server showed (a restart, idle clearing): its
        loss is labelled that, whatever wrote the slot next."""
        if cause is Cause.IDLE_CLEAR:
            self.idle_clearing = True
        self.ledger.emptied(key, cause)

    def emptied_elsewhere(self, state: shared.ServerState, key: str) -> None:
        """A fresh read of the shared state before `key`'s placement moves anything: another proxy's page-out of
        it found its slot emptied after its last answer here (`shared.note_emptied`): its loss is labelled so,
        not after that proxy's write (which would call idle clearing `other-process`)."""
        gone, stats = state.emptied.get(key), self.stats.get(key)
        if gone is not None and stats is not None and stats.answered <= gone.at:
            self.emptied(key, Cause(gone.cause))

    def settle_loss(self, report: Report, found: Cause | None) -> TokensLost | None:
        """The cause of an unsettled loss, once the server was asked (`found`: a restart, idle clearing; None:
        nothing explains it, `unknown`): the report says it from now on, and its `TokensLost` goes out."""
        if report.settled or report.loss is None:
            return None
        if found is Cause.IDLE_CLEAR:
            self.idle_clearing = True
        report.loss = Loss(report.loss.tokens, found or Cause.UNKNOWN)
        report.settled = True
        stats = self.stats.get(report.ticket.session.key)
        if stats is not None:
            stats.count_loss(report.loss.tokens, report.loss.expected)
        return self._lost(report)

    def _lost(self, report: Report) -> TokensLost:
        assert report.loss is not None
        t = report.ticket
        return TokensLost(self.upstream, t.session.short, report.slot, report.loss.tokens, report.loss.cause,
                          report.loss.expected, client_kind(report.path, t.session.source))

    def learn(self, ticket: Ticket, slot: int | None, now: float) -> SlotLearned | None:
        """Affinity: the slot llama-server chose for a pending request, from its answer (`slotlogic.affinity`).
        The session is pinned there from its next request on (another session pinned there is displaced, and
        goes out pending again). Side calls are nobody's session and teach nothing."""
        if ticket.learn is None or ticket.side or not affinity.valid(slot, self.host.total_slots):
            return None
        assert slot is not None
        if self.queued_behind(slot, ticket.session.key):  # what it left there is not what the slot will hold
            return None
        if ticket.placed is not None:
            self.ledger.placed.learned(ticket.placed)
        key = ticket.session.key
        known = self.table.sessions.get(key)
        self.table.assign(key, slot, now, prefix=known.prefix if known else None,
                          requests=known.requests if known else 0)
        if self.ledger.entry(slot).owner != key:
            self.ledger.ran_unpinned(slot, key)
        self.table.use(key, now)  # counts the request and marks the claim for the next flush of the state file
        return SlotLearned(self.upstream, ticket.session.short, slot, ticket.learn)

    def queued_behind(self, slot: int, key: str) -> bool:
        """A request the server placed on `slot` ran there while another session's request pinned there was
        still open (it ran first: the server places a request only on an idle slot): that request runs after
        it, so the slot holds the other session's conversation, not `key`'s."""
        running = self.table.running.get(slot)
        return running is not None and running != key

    def ran_unpinned(self, slot: int, ticket: Ticket, now: float) -> None:
        """Where a request the wait sent with `id_slot: -1` ran (`slotlogic.wait.ran`), read from `/slots`."""
        wait.ran(self.ledger, slot, ticket)
        self._follow(ticket, slot, now)

    def _follow(self, ticket: Ticket, slot: int, now: float) -> None:
        """A session's turn that the hold sent with `id_slot: -1` ran on `slot`: its conversation is there now,
        and its old slot holds it as it was a turn before, so its next turn is pinned there (going back to the
        old slot it would find only part of it). A side call's home stays where it is."""
        known = self.table.sessions.get(ticket.session.key)
        if ticket.side or ticket.unpinned not in wait.UNPINNED or known is None or known.slot == slot \
                or not affinity.valid(slot, self.host.total_slots):
            return
        key = ticket.session.key
        self.table.assign(key, slot, now, prefix=known.prefix, requests=known.requests)
        self.table.dispatch(key, slot)
        self.table.answered(key, slot, now)

    def learn_from_slots(self, ticket: Ticket, obs: Observation, live: Sequence[dict[str, Any]] | None,
                         now: float) -> SlotLearned | None:
        """Affinity on a route that does not say which slot ran it: the idle slot holding exactly this answer's
        tokens, read from `/slots` right after it."""
        if live is None or obs.error_type is not None:
            return None
        return self.learn(ticket, affinity.slot_from_slots(live, obs.tokens_total, self.host.total_slots), now)

    def warnings(self, report: Report) -> list[Event]:
        obs = report.obs
        out: list[Event] = [*self.learned]
        self.learned.clear()
        if report.loss is not None and report.settled:
            out.append(self._lost(report))
        if obs.error_type == "exceed_context_size_error":
            out.append(ContextOverflow(self.upstream, obs.n_prompt_tokens, obs.n_ctx))
        return out

    def lost_cache(self, report: Report) -> bool:
        """A known session came back to its own slot and found nothing there: worth explaining."""
        t = report.ticket
        stats = self.stats.get(t.session.key)
        return (t.why is Why.KNOWN and not t.displaced and not t.paged_in and t.slot is not None
                and report.obs.cache_n == 0 and stats is not None and stats.requests > 1)

    def idle_cleared(self, live: Sequence[dict[str, Any]], cold_slot: int, now: float,
                     held: Collection[int] = ()) -> int | None:
        """An idle slot other than `cold_slot` that holds 0 tokens where a live session of ours used it, where
        the ledger says it holds tokens (a conversation, a prefix, a side call's prompt), or that the shared
        state says another proxy's live session holds (`held`): the server empties idle slots (unified KV +
        --cache-idle-slots). None when nothing shows that."""
        for entry in live:
            sid = entry.get("id")
            if sid == cold_slot or entry.get("is_processing") or not isinstance(sid, int):
                continue
            if entry.get("n_prompt_tokens") != 0:
                continue
            if sid in held or self.ledger.entry(sid).tokens > 0 or any(
                    a.slot == sid and a.requests > 0 and now - a.last_used < self.table.ttl
                    for a in self.table.sessions.values()):
                return sid
        return None

    def answer_stream(self, ticket: Ticket) -> anthropic_answer.StreamConverter | None:
        """What turns the streamed chat answer of a translated request back into the native route's."""
        return anthropic_answer.StreamConverter() if ticket.translated else None

    def answer_body(self, ticket: Ticket, status: int, raw: bytes) -> tuple[int, bytes] | None:
        """(status, body) of the native route's answer for a translated request's non-streamed chat answer;
        None: unchanged. A 200 answer that is not a readable chat completion is a 502 with Anthropic's error
        body: the client asked for a message and would otherwise get chat JSON it cannot read."""
        if not ticket.translated:
            return None
        if status != 200:
            return status, anthropic_answer.error_body(status, raw)
        try:
            answer = json.loads(raw)
            message = anthropic_answer.from_chat(answer)
        except (ValueError, RecursionError, anthropic.TranslationError):
            return 502, anthropic_answer.error_json(anthropic_answer.UNREADABLE)
        return 200, json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode()

    def summary(self) -> dict[str, SessionStats]:
        """Each session's counters, least recently answered first (the exit summary and the status view)."""
        return dict(self.stats)

    def sessions_view(self) -> dict[str, Any]:
        """The status view's part: seconds of prefill saved, and each session's counters (hashes and counts)."""
        return {
            "speeds": self.rates().as_dict(),
            "prefill_s_saved": round(sum(st.saved_s for st in self.stats.values()), 2),
            "sessions": {k[:8]: {"slot": s.slot, "requests": s.requests, "prefill_tokens": s.prefill,
                                 "cached_tokens": s.cached,
                                 "reuse_pct": round(100 * s.reuse, 1) if s.reuse is not None else None,
                                 "saved_s": round(s.saved_s, 2), "source": s.source, "lost_tokens": s.lost,
                                 "lost_unexpected": s.lost_unexpected}
                         for k, s in self.stats.items()},
        }

    def status(self, state: shared.ServerState, now: float, server: ServerInfo | None) -> dict[str, Any]:
        """The status view of this server: its slots' claims (from the shared state) and this process's
        sessions. Hashes and counts only."""
        slots = []
        # `/props`'s count when known, else the claimed slots themselves: the state's count sizes nothing.
        for sid in range(self.host.total_slots) if self.host.total_slots else sorted(state.slots):
            rec = state.slots.get(sid)
            slots.append({"id": sid, "session": rec.owner[:8] if rec and rec.owner else None,
                          "last_used_s_ago": round(now - rec.last_used, 1) if rec else None,
                          "claimed": bool(rec and now - rec.last_used < self.table.ttl)})
        return {
            "upstream": self.upstream,
            "media_marker": server.media_marker if server else None,
            "total_slots": self.host.total_slots,
            "n_ctx_per_slot": server.n_ctx if server else None,
            "slots": slots,
            **self.sessions_view(),
        }
