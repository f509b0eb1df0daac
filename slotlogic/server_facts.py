"""What one server is, as the proxy last saw it (pure): its `/props`, its slot count, whether `/v1/messages`
honours `id_slot`, and what a new `/props` means (a restart, a resized pool, a new model).

Why apart: the keeper places requests with these facts; this part decides what a change of them does to the
ledger (a restart loses every slot's content, except what a request sent since wrote) and to the session table
(every session placed again once, so its page or prefix is restored first).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from slotlogic import kv_types, shared
from slotlogic.answers import Observation
from slotlogic.decisions import Ticket
from slotlogic.events import Event, PoolResized, RestoreJudged, RestoresBroken, ServerRestarted
from slotlogic.ledger import MAX_SLOTS as MAX_LEDGER
from slotlogic.ledger import Cause, Entry, Holds, Ledger, pages_void, written_since_restart
from slotlogic.model_facts import ReuseKind
from slotlogic.ranking import Policy
from slotlogic.reasons import Unpinned
from slotlogic.restore_health import RestoreHealth, RestoreKind
from slotlogic.server import CacheMode, ServerInfo
from slotlogic.settings import CheckpointMode, Settings
from slotlogic.table import Assignment, SessionTable


class ServerFacts:
    def __init__(self, settings: Settings, upstream: str, table: SessionTable, ledger: Ledger) -> None:
        self.settings = settings
        self.upstream = upstream
        self.table = table
        self.ledger = ledger
        self.server: ServerInfo | None = None   # the last `/props` seen
        self.total_slots: int | None = None     # the last known slot count
        self.messages_native: bool | None = None  # the server honours id_slot on /v1/messages (probed)
        # (media_marker, "K/V"): the KV cache types a save's size showed that server process (`slotlogic.kv_types`)
        self.kv_learned: tuple[str | None, str] | None = None
        # A restart noticed without `/slots`: each emptied slot's entry before it, its epoch after the reset and
        # its owner's table entry, until `/slots` can say which of them a request wrote on the new server.
        self._unconfirmed: dict[int, tuple[Entry, int, Assignment | None]] = {}
        self.cache_mode: CacheMode | None = None  # probed at start and after a restart, or seen in a loss
        self.restores = RestoreHealth()  # whether this server process's restores take (judged from answers)

    def passes_through(self) -> bool:
        """The one gate of the server's cache mode: on a server that clears idle slots into its RAM prompt cache
        (`CacheMode.IDLE_CLEARED`) requests go out as the client sent them, with no pinning, paging or prefix
        restores: every one of those is emptied before it is used, and the server's own slot choice with its RAM
        cache serves the same traffic with fewer prefilled tokens (docs/performance.md, "Server defaults")."""
        return self.cache_mode is CacheMode.IDLE_CLEARED

    def passing(self) -> Unpinned | None:
        """Why every request goes as it came (observed only): the policy is off, or the server's cache mode
        empties any slot of ours; None: requests are placed."""
        if self.settings.policy is Policy.OFF:
            return Unpinned.POLICY_OFF
        return Unpinned.IDLE_CLEARED if self.passes_through() else None

    def mode_unknown(self) -> bool:
        """The server's cache mode is not known yet (probe it)."""
        return self.cache_mode is None

    def cache_mode_found(self, mode: CacheMode) -> bool:
        """What the probe or a loss showed; True when it is news (worth one log line)."""
        news, self.cache_mode = mode is not self.cache_mode, mode
        return news

    def with_kv(self, info: ServerInfo) -> ServerInfo:
        """`info` (a `/props` just parsed) with its KV cache types: what this server process's saves showed,
        else the option's (`slots_cache_type`). A restarted server's are learned again."""
        learned = self.kv_learned
        s = self.settings
        kv = learned[1] if learned is not None and learned[0] == info.media_marker else \
            kv_types.label(s.cache_type_k, s.cache_type_v)
        return replace(info, kv_cache=kv)

    def kv_seen(self, kv: tuple[str, str]) -> bool:
        """A save's size showed the server's KV cache types: pages and checkpoints are recorded under them from
        now on; True when they differ from what was assumed (worth a warning)."""
        info, label = self.server, kv_types.label(*kv)
        if info is None or info.kv_cache == label:
            return False
        self.kv_learned = (info.media_marker, label)
        self.server = replace(info, kv_cache=label)
        return True

    def unloaded(self) -> None:
        """Its model was unloaded (a model swap: llama-swap, a router's `--models-max`): the process is gone and
        every slot with it, as after a restart, which `/props` can only show once the model is loaded again (by
        then a returning session's placement would trust the slot it left). Every session passes the slow path
        once, where its page, written before the swap, is restored."""
        if self.ledger.total:
            self.ledger.resize(self.ledger.total, Cause.RESTART)
        self._unconfirmed = {}
        self.table.forget_all()

    def _restarted(self, info: ServerInfo, live: Sequence[Mapping[str, Any]] | None) -> None:
        """Every slot emptied, but those `/slots` shows a request of ours wrote since (sent before the restart was
        noticed). Without `/slots` that is not known yet: what each slot held is kept aside until it is."""
        kept = written_since_restart(self.ledger, live, self.table.running)
        before = {s: self.ledger.entry(s) for s in range(self.ledger.total)} if live is None else {}
        self.ledger.resize(info.total_slots, Cause.RESTART, keep=kept)
        self.messages_native = None  # another build may be running now
        self.cache_mode = None  # and may run with other flags
        self.restores.reset()  # whose restores may take
        self._unconfirmed = {s: (e, self.ledger.entry(s).epoch, self.table.sessions.get(e.owner or ""))
                             for s, e in before.items() if e.owner and e.holds is Holds.SESSION and s not in kept}
        if self.settings.checkpoints is not CheckpointMode.OFF or self.settings.paging:
            # Route every session through the slow path once, so its page or prefix is restored first.
            self.table.forget_all(keep={self.ledger.entry(s).owner or "" for s in kept})

    def _confirm(self, live: Sequence[Mapping[str, Any]]) -> None:
        """`/slots` answers again after a restart noticed without it: a slot that holds at least what its owner's
        last request left there, idle, was written on the new server; its conversation is its owner's again."""
        by_id = {e.get("id"): e for e in live if isinstance(e, Mapping)}
        for slot, (before, epoch, seat) in self._unconfirmed.items():
            entry = by_id.get(slot)
            n = entry.get("n_prompt_tokens") if entry is not None else None
            if entry is None or entry.get("is_processing") or not isinstance(n, int) or isinstance(n, bool):
                continue
            if 0 < before.tokens <= n + 1 and self._reinstate(slot, before, epoch, seen=True) and seat is not None:
                self.table.readmit(before.owner or "", seat)
        self._unconfirmed = {}

    def may_still_hold(self, slot: int, key: str) -> bool:
        """After a restart noticed without `/slots`, `key`'s emptied slot may hold its conversation after all (its
        last request may have run on the new server), as long as nothing was written there since: going back to
        it loses nothing either way, where a slot chosen anew evicts someone."""
        found = self._unconfirmed.get(slot)
        return found is not None and found[0].owner == key and self.ledger.entry(slot).epoch == found[1]

    def go_back(self, slot: int) -> None:
        """Its owner goes back to a slot `may_still_hold` says may hold its conversation: the ledger holds it
        there again on trust (a loss there is still the restart's), so no prefix is restored over it."""
        found = self._unconfirmed.pop(slot, None)
        if found is not None:
            self._reinstate(slot, found[0], found[1], seen=False)

    def _reinstate(self, slot: int, before: Entry, reset_epoch: int, *, seen: bool) -> bool:
        """`before`'s owner holds `slot` again, unless anything was written there since the restart's reset.
        `seen`: `/slots` shows it there; else it goes back on trust, and a loss there is still the restart's."""
        if self.ledger.entry(slot).epoch != reset_epoch or not before.owner:
            return False
        self.ledger.write(slot, Holds.SESSION, before.owner, before.tokens)
        if seen:
            self.ledger.gone.pop(before.owner, None)
        return True

    def written_over(self, slot: int, key: str) -> bool:
        """`slot` no longer holds `key`'s conversation as far as this process knows (its claim is not resumed)."""
        return self.ledger.moved_on(slot, key) and not self.may_still_hold(slot, key)

    def restore_judged(self, slot: int, kind: RestoreKind, restored: int, cache_n: int | None,
                       reuse: ReuseKind | None = None) -> list[Event]:
        """A restore of `restored` tokens into `slot` and what the request on them found cached (`cache_n`):
        its judgement for the JSONL log, and one `RestoresBroken` when it made this server's restores broken
        (`reuse`: what the model check knows of the model, which names the fix)."""
        health = self.restores
        was = health.last
        news = health.judge(kind, restored, cache_n)
        if health.last is was or health.last is None:
            return []
        last = health.last
        events: list[Event] = [RestoreJudged(self.upstream, slot, kind.value, last.restored, last.cached, last.took)]
        if news:
            pages_void(self.ledger)
            seen = health.broken_by
            events.append(RestoresBroken(self.upstream, tuple(j.kind.value for j in seen),
                                         tuple(j.restored for j in seen), tuple(j.cached for j in seen), reuse,
                                         bool(self.settings.swa_full)))
        return events

    def served_with(self, settings: Settings) -> Settings:
        """The settings this server is served with (`RestoreHealth.effective`)."""
        return self.restores.effective(settings)

    def restores_view(self) -> dict[str, object]:
        return self.restores.view()

    def answer_after_restore(self, ticket: Ticket, obs: Observation, reuse: ReuseKind | None = None) -> list[Event]:
        """The answer of a request a restore was made for (`Ticket.restore`): judged, unless it failed, or its
        prompt does not start with its previous request's (an edited conversation reuses less of any page)."""
        if ticket.restore is None or ticket.slot is None or obs.error_type is not None or ticket.extends is False:
            return []
        kind, restored = ticket.restore
        return self.restore_judged(ticket.slot, kind, restored, obs.cache_n, reuse)

    def page_identity(self) -> str:
        """What a page written now must match to be restored later (`ServerInfo.page_identity`)."""
        return self.server.page_identity(self.settings.server_id) if self.server else ""

    def messages_probed(self, honoured: bool | None) -> None:
        """What the probe found: whether the server honours id_slot on /v1/messages (None: unknown)."""
        self.messages_native = honoured

    def props_seen(self, info: ServerInfo) -> bool:
        """A background `/props` answer: True when it shows a server not seen yet, restarted (another
        `media_marker`) or resized, which the driver records in the shared state (`note_server`); else it is
        simply this server's latest facts."""
        known = self.server
        changed = known is None or bool(info.media_marker and known.media_marker
                                        and info.media_marker != known.media_marker) or (
            self.total_slots is not None and info.total_slots != self.total_slots)
        if not changed:
            self.server, self.total_slots = info, info.total_slots
        return changed

    def _taught(self, total: int) -> dict[int, Entry]:
        """Before the first `/props` of this server, the slots whose answers named them (requests sent with
        `id_slot: -1` while it could not be asked) and hold their session's conversation: sizing the ledger
        keeps them, else each of those sessions is placed anew beside its own conversation. (A restart the
        `/props` shows is handled as any restart.)"""
        return {s: e for s in range(min(self.ledger.total, total))
                if (e := self.ledger.entry(s)).owner and self.ledger.conversation_on(s) == e.owner}

    def note_server(self, state: shared.ServerState, info: ServerInfo,
                    live: Sequence[Mapping[str, Any]] | None = None, *, me: str | None = None,
                    now: float | None = None) -> list[Event]:
        """Fold a `/props` answer into the shared state and this process's memory. `live`: `/slots` as read with
        it; after a restart, a slot it shows holding what our last request there left was written since the
        restart (a request that went out before the restart was noticed) and is kept. `me`, `now`: this process
        and the time (a restart voids the claims of processes gone, `shared.note_server`)."""
        known = self.server.media_marker if self.server is not None else None
        change = shared.note_server(state, info, me, now)
        # Restarted for this process too when the shared state had the new marker already: another proxy of
        # this state saw the restart first (else this proxy's ledger keeps promising the emptied slot, and the
        # meter calls the restart's loss `unknown`).
        restarted = change.restarted or bool(known and info.media_marker and info.media_marker != known
                                             and not change.resized)
        events: list[Event] = []
        if restarted:
            events.append(ServerRestarted(self.upstream))
            self._restarted(info, live)
        elif live is not None and self._unconfirmed:
            self._confirm(live)
        if change.resized:
            events.append(PoolResized(self.upstream, info.total_slots))
            self.table.forget_all()
        if change.resized or (self.ledger.total != min(info.total_slots, MAX_LEDGER) and not change.restarted):
            taught = self._taught(info.total_slots) if self.server is None and not change.resized else {}
            self.ledger.resize(info.total_slots, Cause.MODEL_CHANGE if change.resized else None)
            for slot, e in taught.items():
                self.ledger.write(slot, e.holds, e.owner, e.tokens)
        self.server = info
        self.total_slots = info.total_slots
        return events
