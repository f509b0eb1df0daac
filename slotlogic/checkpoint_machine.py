"""Prefix checkpoints as a sans-IO state machine: restore, verify, rebuild a shared prefix before a new session.

Why sans-IO: `Orchestrator.next_action()` returns the step (restore, verify, warm, save, erase) and the driver
(`slotkeeper/drivers/checkpoint_runner.py`) feeds the server's answer back with `feed()`, so every failure
(400 on restore, 501 without --slot-save-path, time-outs, a failed verification) is tested without a server.
Fail open: every path ends in DONE, and the request goes out as it would without checkpoints.
`TRANSITIONS` is the whole graph; docs/checkpoints.md explains the gates and when each runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from slotlogic import numbers
from slotlogic.prefix import StablePrefix

PROBE_USER = "Reply with OK."
SAVE_SLACK = 2  # tokens a save may hold beyond what the warm-up left (the server's own bookkeeping)


class Phase(Enum):
    START = "start"
    RESTORING_BASE = "restoring-base"
    RESTORING = "restoring"
    VERIFY_IDENTICAL = "verify-identical"
    VERIFY_DIVERGENT = "verify-divergent"
    ERASING = "erasing"
    WARMING = "warming"
    SAVING = "saving"
    DONE = "done"


class Outcome(Enum):
    """How a prefix preparation ended (the JSONL log's `outcome`)."""

    HIT = "hit"                                   # the slot held the prefix already
    RESTORED = "restored"                         # a file restored and verified
    RESTORED_UNVERIFIED = "restored-unverified"   # restored, but a verification could not confirm it
    WARMED_SAVED = "warmed-saved"                 # prefilled and saved to a file
    WARMED = "warmed"                             # prefilled, nothing persisted
    FAILED = "failed"

    @property
    def restored(self) -> bool:
        return self in (Outcome.RESTORED, Outcome.RESTORED_UNVERIFIED)


class NoteKind(Enum):
    """One step of the machine worth a log line (the text is `slotlogic.wording`'s)."""

    HIT = "hit"
    COLD = "cold"
    BASE_RESTORED = "base-restored"
    RESTORED = "restored"
    NO_FILE = "no-file"
    VERIFY_DID_NOT_RUN = "verify-did-not-run"
    REJECTED = "rejected"
    DIVERGENT_DID_NOT_RUN = "divergent-did-not-run"
    CANNOT_RESUME = "cannot-resume"
    VERIFIED = "verified"
    TRUSTED = "trusted"          # restored as when it was verified on this server process: no gates again
    WARM_FAILED = "warm-failed"
    WARMED = "warmed"
    SAVED = "saved"
    SAVE_FAILED = "save-failed"
    SAVE_MISMATCH = "save-mismatch"  # the file holds another count than the warm-up left: another request ran


@dataclass(frozen=True)
class Note:
    kind: NoteKind
    slot: int
    filename: str = ""
    tokens: int | None = None                    # n_restored / n_saved / prompt_n of a warm-up
    cached: int | None = None                    # cache_n of a warm-up
    identical: tuple[int, int] | None = None     # (cache_n, total) of the identical gate
    divergent: tuple[int, int] | None = None
    gate: float = 0.0
    failure: Failure | None = None               # why an HTTP step failed


@dataclass(frozen=True)
class Failure:
    """An HTTP step that did not succeed: status 0 = unreachable or timed out; the server's error type."""

    status: int
    error_type: str | None = None

    @classmethod
    def of(cls, status: int, data: Any) -> Failure:
        err = data.get("error") if isinstance(data, dict) else None
        kind = err.get("type") if isinstance(err, dict) else None
        return cls(status, kind if isinstance(kind, str) else None)


class ActionKind(Enum):
    RESTORE = "restore"
    SAVE = "save"
    ERASE = "erase"
    WARM = "warm"
    VERIFY = "verify"

    @property
    def slot_action(self) -> bool:
        """A `POST /slots/{id}?action=…` call (the rest are pinned chat completions)."""
        return self in (ActionKind.RESTORE, ActionKind.SAVE, ActionKind.ERASE)


@dataclass(frozen=True)
class Action:
    """One HTTP call for the driver: restore | save | erase (POST /slots/{slot}?action=…), or warm | verify
    (a chat completion pinned to `slot`, body given)."""

    kind: ActionKind
    slot: int
    filename: str | None = None
    body: dict[str, Any] | None = None
    path: str = "/v1/chat/completions"  # warm and verify: the prefix's own route


@dataclass(frozen=True)
class Result:
    """What the driver saw: HTTP status (0 = unreachable or timed out) and the parsed JSON answer."""

    status: int
    data: Any = None

    @property
    def ok(self) -> bool:
        return self.status == 200

    def failure(self) -> Failure:
        return Failure.of(self.status, self.data)

    def timings(self) -> tuple[int, int] | None:
        """(cache_n, prompt_n) of a completion: its `timings`, or the usage of a `/v1/responses` answer (which
        has none: `input_tokens` in all, `input_tokens_details.cached_tokens` of them from the cache)."""
        data = self.data if isinstance(self.data, dict) else {}
        t = data.get("timings")
        if isinstance(t, dict) and _int(t, "cache_n") is not None and _int(t, "prompt_n") is not None:
            return t["cache_n"], t["prompt_n"]
        usage = data.get("usage")
        details = usage.get("input_tokens_details") if isinstance(usage, dict) else None
        total, cached = _int(usage, "input_tokens"), _int(details, "cached_tokens")
        if total is not None and cached is not None and cached <= total:
            return cached, total - cached
        return None


class Verdict(Enum):
    """How one action went, as its phase's handler reads the answer."""

    OK = "ok"
    FAIL = "fail"
    LOW = "low"   # a verification below its bar


# (phase, verdict) → next phase.
TRANSITIONS: dict[tuple[Phase, Verdict], Phase] = {
    (Phase.RESTORING_BASE, Verdict.OK): Phase.WARMING,
    (Phase.RESTORING_BASE, Verdict.FAIL): Phase.WARMING,
    (Phase.RESTORING, Verdict.OK): Phase.VERIFY_IDENTICAL,
    (Phase.RESTORING, Verdict.FAIL): Phase.WARMING,
    (Phase.VERIFY_IDENTICAL, Verdict.OK): Phase.VERIFY_DIVERGENT,
    (Phase.VERIFY_IDENTICAL, Verdict.LOW): Phase.ERASING,
    (Phase.VERIFY_IDENTICAL, Verdict.FAIL): Phase.DONE,
    (Phase.VERIFY_DIVERGENT, Verdict.OK): Phase.DONE,
    (Phase.VERIFY_DIVERGENT, Verdict.LOW): Phase.DONE,
    (Phase.VERIFY_DIVERGENT, Verdict.FAIL): Phase.DONE,
    (Phase.ERASING, Verdict.OK): Phase.WARMING,
    (Phase.ERASING, Verdict.FAIL): Phase.WARMING,
    (Phase.WARMING, Verdict.OK): Phase.SAVING,  # or DONE when persistence is off (see _after_warm)
    (Phase.WARMING, Verdict.FAIL): Phase.DONE,
    (Phase.SAVING, Verdict.OK): Phase.DONE,
    (Phase.SAVING, Verdict.FAIL): Phase.DONE,
}


@dataclass
class Orchestrator:
    slot: int
    prefix: StablePrefix
    filename: str
    persist: bool
    holds_prefix: bool = False
    file_known: bool = False
    base: str | None = None      # a known file holding a part of the prefix, or all (restored before a warm-up)
    copied: bool = False         # the slot holds a copy of a conversation that starts with the prefix (a seed):
                                 # the warm-up runs on it; a base restored first would wipe all it holds
    verified_tokens: int | None = None  # the file passed both gates on this server process, unchanged since:
                                        # the n_restored it had then
    gate: float = 0.9
    phase: Phase = Phase.START
    outcome: Outcome | None = None
    notes: list[Note] = field(default_factory=list)  # what happened, in order (logged by the driver)
    spent_prefill: int = 0                            # prompt_n paid by warm-ups and probes
    saved_tokens: int | None = None                   # n_saved of a successful save
    restored_tokens: int | None = None
    identical: tuple[int, int] | None = None          # (cache_n, total) of the identical gate
    divergent: tuple[int, int] | None = None
    missing_save_path: bool = False
    file_bad: bool = False
    warmed_to: int | None = None                      # tokens the slot held after the warm-up (cache_n + prompt_n)
    save_mismatch: bool = False                       # the save held something else: the file must go

    def __post_init__(self) -> None:
        if self.holds_prefix:
            self.outcome = Outcome.HIT
            self._note(NoteKind.HIT)
            self.phase = Phase.DONE
        elif self.persist and self.file_known:
            self.phase = Phase.RESTORING
        else:
            self._note(NoteKind.COLD)
            self.phase = Phase.RESTORING_BASE if self.persist and self.base and not self.copied else Phase.WARMING

    # -------------------------------------------------------------------------------- driver interface

    def next_action(self) -> Action | None:
        p, s = self.phase, self.slot
        if p is Phase.RESTORING_BASE:
            return Action(ActionKind.RESTORE, s, filename=self.base)
        if p is Phase.RESTORING:
            return Action(ActionKind.RESTORE, s, filename=self.filename)
        route = self.prefix.path
        if p is Phase.VERIFY_IDENTICAL:
            return Action(ActionKind.VERIFY, s, body=self.prefix.warmup_body(), path=route)
        if p is Phase.VERIFY_DIVERGENT:
            return Action(ActionKind.VERIFY, s, body=self.prefix.warmup_body(PROBE_USER), path=route)
        if p is Phase.ERASING:
            return Action(ActionKind.ERASE, s)
        if p is Phase.WARMING:
            return Action(ActionKind.WARM, s, body=self.prefix.warmup_body(), path=route)
        if p is Phase.SAVING:
            return Action(ActionKind.SAVE, s, filename=self.filename)
        return None

    def feed(self, result: Result) -> None:
        phase = self.phase
        if phase in (Phase.START, Phase.DONE):
            raise RuntimeError(f"no action pending in phase {phase.value}")
        verdict = _HANDLERS[phase](self, result)
        nxt = TRANSITIONS[(phase, verdict)]
        if phase is Phase.WARMING and verdict is Verdict.OK and not self.persist:
            nxt = Phase.DONE
        if phase is Phase.RESTORING and verdict is Verdict.OK and self.trusted:
            nxt, self.outcome = Phase.DONE, Outcome.RESTORED
            self._note(NoteKind.TRUSTED, tokens=self.restored_tokens)
        self.phase = nxt
        if nxt is Phase.DONE and self.outcome is None:
            self.outcome = Outcome.WARMED if phase is Phase.WARMING and verdict is Verdict.OK else Outcome.FAILED

    # -------------------------------------------------------------------------------- per-phase verdicts

    @property
    def trusted(self) -> bool:
        """The file restored now as it did when it passed both gates on this server process."""
        return self.verified_tokens is not None and self.restored_tokens == self.verified_tokens

    @property
    def verified(self) -> bool:
        """Both gates passed in this run (the driver remembers the file for this server process)."""
        return any(n.kind is NoteKind.VERIFIED for n in self.notes)

    def _on_restoring_base(self, r: Result) -> Verdict:
        if r.ok:
            self._note(NoteKind.BASE_RESTORED, filename=self.base or "", tokens=_int(r.data, "n_restored"))
            return Verdict.OK
        return Verdict.FAIL

    def _on_restoring(self, r: Result) -> Verdict:
        if r.ok:
            self.restored_tokens = _int(r.data, "n_restored")
            self._note(NoteKind.RESTORED, filename=self.filename, tokens=self.restored_tokens)
            return Verdict.OK
        self.missing_save_path |= r.status == 501
        self._note(NoteKind.NO_FILE, failure=r.failure())
        self._note(NoteKind.COLD)
        return Verdict.FAIL

    def _probe(self, r: Result) -> tuple[int, int] | None:
        """(cache_n, total) of a verification request, its prefill counted; None when it did not run."""
        t = r.timings() if r.ok else None
        if t is None:
            return None
        self.spent_prefill += t[1]
        return t[0], t[0] + t[1]

    def _on_verify_identical(self, r: Result) -> Verdict:
        self.identical = self._probe(r)
        if self.identical is None:
            self._note(NoteKind.VERIFY_DID_NOT_RUN, failure=r.failure())
            self.outcome = Outcome.RESTORED_UNVERIFIED
            return Verdict.FAIL
        cache_n, total = self.identical
        if cache_n < self.gate * total:
            self.file_bad = True
            self._note(NoteKind.REJECTED, identical=self.identical, gate=self.gate)
            return Verdict.LOW
        return Verdict.OK

    def _on_verify_divergent(self, r: Result) -> Verdict:
        self.divergent = self._probe(r)
        if self.divergent is None:
            self._note(NoteKind.DIVERGENT_DID_NOT_RUN, identical=self.identical, failure=r.failure())
            self.outcome = Outcome.RESTORED
            return Verdict.FAIL
        if self.divergent[0] == 0:
            self._note(NoteKind.CANNOT_RESUME, identical=self.identical, divergent=self.divergent)
            self.outcome = Outcome.RESTORED_UNVERIFIED
            return Verdict.LOW
        self._note(NoteKind.VERIFIED, identical=self.identical, divergent=self.divergent)
        self.outcome = Outcome.RESTORED
        return Verdict.OK

    def _on_erasing(self, r: Result) -> Verdict:
        return Verdict.OK if r.ok else Verdict.FAIL

    def _on_warming(self, r: Result) -> Verdict:
        t = r.timings() if r.ok else None
        if t is None:
            self._note(NoteKind.WARM_FAILED, failure=r.failure())
            self.outcome = Outcome.FAILED
            return Verdict.FAIL
        self.spent_prefill += t[1]
        self.warmed_to = t[0] + t[1]
        self._note(NoteKind.WARMED, tokens=t[1], cached=t[0])
        return Verdict.OK

    def _on_saving(self, r: Result) -> Verdict:
        saved = _int(r.data, "n_saved") if r.ok else None
        if saved is not None and self.warmed_to is not None and not \
                self.warmed_to <= saved <= self.warmed_to + SAVE_SLACK:
            # Another request ran on the slot between the warm-up and the save (a session pinned outside the
            # slot's plan): the file named for one client's prefix would hold another client's conversation,
            # and be restored without its gates as a file this runner had saved itself.
            self.file_bad = self.save_mismatch = True
            self._note(NoteKind.SAVE_MISMATCH, filename=self.filename, tokens=saved, cached=self.warmed_to)
            self.outcome = Outcome.WARMED
            return Verdict.FAIL
        if r.ok:
            self.saved_tokens = saved
            self._note(NoteKind.SAVED, filename=self.filename, tokens=self.saved_tokens)
            self.outcome = Outcome.WARMED_SAVED
            return Verdict.OK
        self.missing_save_path |= r.status == 501
        self._note(NoteKind.SAVE_FAILED, failure=r.failure())
        self.outcome = Outcome.WARMED
        return Verdict.FAIL

    # -------------------------------------------------------------------------------- helpers

    def _note(self, kind: NoteKind, **kw: Any) -> None:
        self.notes.append(Note(kind, self.slot, **kw))


def _int(data: Any, key: str) -> int | None:
    """A count of a server's answer, in range (`numbers.count`); None otherwise."""
    return numbers.count(data.get(key)) if isinstance(data, dict) else None


# Each phase's handler of its action's answer: a table, not a method looked up by its name.
_HANDLERS: dict[Phase, Callable[[Orchestrator, Result], Verdict]] = {
    Phase.RESTORING_BASE: Orchestrator._on_restoring_base,
    Phase.RESTORING: Orchestrator._on_restoring,
    Phase.VERIFY_IDENTICAL: Orchestrator._on_verify_identical,
    Phase.VERIFY_DIVERGENT: Orchestrator._on_verify_divergent,
    Phase.ERASING: Orchestrator._on_erasing,
    Phase.WARMING: Orchestrator._on_warming,
    Phase.SAVING: Orchestrator._on_saving,
}
