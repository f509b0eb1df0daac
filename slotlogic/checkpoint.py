"""Prefix-checkpoint orchestration as a sans-IO state machine (seed 001, wired into slot choice).

Rule 1: everything that decides *what to do to a slot so a new session starts warm* lives here.
Rule 2: no I/O. `Orchestrator.next_action()` returns an action (restore, verify, warm, save, erase) for
        the driver to perform against llama-server; the driver feeds the HTTP outcome back with `feed()`.
        Tests replay recorded server answers (success, 400 on restore, 501 without --slot-save-path,
        timeouts, failed verification) without a server.
Rule 3: fail open. Whatever happens, the machine ends in DONE and the user's request goes out as it
        would without checkpoints; a failure only costs the prefill the request would have paid anyway.

Theory of operation
-------------------
START:    the slot already holds the prefix (in-process knowledge, confirmed alive) → DONE (hit);
          persistence on and a matching file known → RESTORING; otherwise → WARMING (cold).
RESTORING → VERIFY_IDENTICAL on 200. Any failure → WARMING (a failed restore wipes the slot, §4.5).
VERIFY_IDENTICAL: the warm-up request re-sent must come back ≥ `gate` (90%) from cache, else the file is
          bad → ERASING → WARMING (then SAVING overwrites the file).
VERIFY_DIVERGENT: the prefix plus a non-empty user message must show `cache_n > 0`; if not, say so
          loudly and keep the restore (a rebuild would produce the same state).
WARMING → SAVING when persistence is on, else DONE. SAVING failure (501: no --slot-save-path) → DONE with
          a warning; the slot is warm anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from slotlogic.prefix import StablePrefix

PROBE_USER = "Reply with OK."


class Phase(Enum):
    START = "start"
    RESTORING = "restoring"
    VERIFY_IDENTICAL = "verify-identical"
    VERIFY_DIVERGENT = "verify-divergent"
    ERASING = "erasing"
    WARMING = "warming"
    SAVING = "saving"
    DONE = "done"


@dataclass(frozen=True)
class Action:
    """One HTTP call for the driver. kind: restore | save | erase (POST /slots/{slot}?action=…),
    warm | verify (a chat completion pinned to `slot`, body given)."""

    kind: str
    slot: int
    filename: str | None = None
    body: dict[str, Any] | None = None


@dataclass(frozen=True)
class Result:
    """What the driver saw: HTTP status (0 = unreachable or timed out) and the parsed JSON answer."""

    status: int
    data: Any = None

    @property
    def ok(self) -> bool:
        return self.status == 200

    def timings(self) -> tuple[int, int] | None:
        t = self.data.get("timings") if isinstance(self.data, dict) else None
        if isinstance(t, dict) and isinstance(t.get("cache_n"), int) and isinstance(t.get("prompt_n"), int):
            return t["cache_n"], t["prompt_n"]
        return None


# (phase, verdict) → next phase. Verdicts: ok, fail, low (verification below its bar).
TRANSITIONS: dict[tuple[Phase, str], Phase] = {
    (Phase.RESTORING, "ok"): Phase.VERIFY_IDENTICAL,
    (Phase.RESTORING, "fail"): Phase.WARMING,
    (Phase.VERIFY_IDENTICAL, "ok"): Phase.VERIFY_DIVERGENT,
    (Phase.VERIFY_IDENTICAL, "low"): Phase.ERASING,
    (Phase.VERIFY_IDENTICAL, "fail"): Phase.DONE,
    (Phase.VERIFY_DIVERGENT, "ok"): Phase.DONE,
    (Phase.VERIFY_DIVERGENT, "low"): Phase.DONE,
    (Phase.VERIFY_DIVERGENT, "fail"): Phase.DONE,
    (Phase.ERASING, "ok"): Phase.WARMING,
    (Phase.ERASING, "fail"): Phase.WARMING,
    (Phase.WARMING, "ok"): Phase.SAVING,  # or DONE when persistence is off (see _after_warm)
    (Phase.WARMING, "fail"): Phase.DONE,
    (Phase.SAVING, "ok"): Phase.DONE,
    (Phase.SAVING, "fail"): Phase.DONE,
}


@dataclass
class Orchestrator:
    slot: int
    prefix: StablePrefix
    filename: str
    persist: bool
    holds_prefix: bool = False
    file_known: bool = False
    gate: float = 0.9
    phase: Phase = Phase.START
    outcome: str = ""
    lines: list[str] = field(default_factory=list)   # seed-style log lines, in order
    spent_prefill: int = 0                            # prompt_n paid by warm-ups and probes
    saved_tokens: int | None = None                   # n_saved of a successful save
    restored_tokens: int | None = None
    identical: tuple[int, int] | None = None          # (cache_n, total) of the identical gate
    divergent: tuple[int, int] | None = None
    missing_save_path: bool = False
    file_bad: bool = False

    def __post_init__(self) -> None:
        if self.holds_prefix:
            self._finish("hit", f"cache=HIT (slot {self.slot} already holds this prefix)")
        elif self.persist and self.file_known:
            self.phase = Phase.RESTORING
        else:
            self.lines.append(f"cache=MISS → warming slot={self.slot} (cold)")
            self.phase = Phase.WARMING

    # -------------------------------------------------------------------------------- driver interface

    def next_action(self) -> Action | None:
        p, s = self.phase, self.slot
        if p is Phase.RESTORING:
            return Action("restore", s, filename=self.filename)
        if p is Phase.VERIFY_IDENTICAL:
            return Action("verify", s, body=self.prefix.warmup_body())
        if p is Phase.VERIFY_DIVERGENT:
            return Action("verify", s, body=self.prefix.warmup_body(PROBE_USER))
        if p is Phase.ERASING:
            return Action("erase", s)
        if p is Phase.WARMING:
            return Action("warm", s, body=self.prefix.warmup_body())
        if p is Phase.SAVING:
            return Action("save", s, filename=self.filename)
        return None

    def feed(self, result: Result) -> None:
        phase = self.phase
        if phase in (Phase.START, Phase.DONE):
            raise RuntimeError(f"no action pending in phase {phase.value}")
        verdict = getattr(self, f"_on_{phase.name.lower()}")(result)
        nxt = TRANSITIONS[(phase, verdict)]
        if phase is Phase.WARMING and verdict == "ok" and not self.persist:
            nxt = Phase.DONE
        self.phase = nxt
        if nxt is Phase.DONE and not self.outcome:
            self.outcome = self._default_outcome(phase, verdict)

    # -------------------------------------------------------------------------------- per-phase verdicts

    def _on_restoring(self, r: Result) -> str:
        if r.ok:
            n = r.data.get("n_restored") if isinstance(r.data, dict) else None
            self.restored_tokens = n if isinstance(n, int) else None
            self.lines.append(f"RESTORE {self.filename}: n_restored={self.restored_tokens}")
            return "ok"
        self.missing_save_path |= r.status == 501
        self.lines.append(f"no checkpoint (restore {self._why(r)}) → cold build")
        self.lines.append(f"cache=MISS → warming slot={self.slot} (cold)")
        return "fail"

    def _probe(self, r: Result) -> tuple[int, int] | None:
        """(cache_n, total) of a verification request, its prefill counted; None when it did not run."""
        t = r.timings() if r.ok else None
        if t is None:
            return None
        self.spent_prefill += t[1]
        return t[0], t[0] + t[1]

    def _on_verify_identical(self, r: Result) -> str:
        self.identical = self._probe(r)
        if self.identical is None:
            self.lines.append(f"RESTORE verification failed to run ({self._why(r)}); keeping the slot as is")
            self.outcome = "restored-unverified"
            return "fail"
        cache_n, total = self.identical
        if cache_n < self.gate * total:
            self.file_bad = True
            self.lines.append(f"RESTORE rejected: identical {cache_n}/{total} < "
                              f"{self.gate:.0%} from cache → erase + cold rebuild")
            return "low"
        return "ok"

    def _on_verify_divergent(self, r: Result) -> str:
        ident = f"identical {self.identical[0]}/{self.identical[1]}" if self.identical else "identical ?"
        self.divergent = self._probe(r)
        if self.divergent is None:
            self.lines.append(f"RESTORE verified: {ident}, divergent probe did not run ({self._why(r)})")
            self.outcome = "restored"
            return "fail"
        cache_n, total = self.divergent
        if cache_n == 0:
            self.lines.append(f"RESTORE {ident} but divergent probe 0/{total}: the server cannot "
                              "resume from this state (SWA/hybrid model without checkpoints? "
                              "--checkpoint-min-step too large?); keeping it")
            self.outcome = "restored-unverified"
            return "low"
        self.lines.append(f"RESTORE verified: {ident}, divergent probe {cache_n}/{total}")
        self.outcome = "restored"
        return "ok"

    def _on_erasing(self, r: Result) -> str:
        return "ok" if r.ok else "fail"

    def _on_warming(self, r: Result) -> str:
        t = r.timings() if r.ok else None
        if t is None:
            self.lines.append(f"warm-up failed ({self._why(r)}); request proceeds cold")
            self.outcome = "failed"
            return "fail"
        self.spent_prefill += t[1]
        self.lines.append(f"warm-up done: HTTP {r.status} prompt_n={t[1]} cache_n={t[0]}")
        return "ok"

    def _on_saving(self, r: Result) -> str:
        if r.ok:
            n = r.data.get("n_saved") if isinstance(r.data, dict) else None
            self.saved_tokens = n if isinstance(n, int) else None
            self.lines.append(f"SAVED {self.filename}: n_saved={self.saved_tokens}")
            self.outcome = "warmed-saved"
            return "ok"
        self.missing_save_path |= r.status == 501
        self.lines.append(f"save failed ({self._why(r)}); the slot is warm, nothing persisted")
        self.outcome = "warmed"
        return "fail"

    # -------------------------------------------------------------------------------- helpers

    def _finish(self, outcome: str, line: str) -> None:
        self.outcome = outcome
        self.lines.append(line)
        self.phase = Phase.DONE

    @staticmethod
    def _default_outcome(phase: Phase, verdict: str) -> str:
        if phase is Phase.WARMING:
            return "warmed" if verdict == "ok" else "failed"
        return "failed"

    @staticmethod
    def _why(r: Result) -> str:
        if r.status == 0:
            return "timeout or unreachable"
        msg = ""
        if isinstance(r.data, dict) and isinstance(r.data.get("error"), dict):
            msg = str(r.data["error"].get("message", ""))[:120]
        return f"HTTP {r.status}{': ' + msg if msg else ''}"

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE
