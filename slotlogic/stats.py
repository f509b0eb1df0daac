"""Per-session counters for the status view and the summary at shutdown: the server's own numbers, added up."""

from __future__ import annotations

from dataclasses import dataclass

from slotlogic.answers import Observation


@dataclass
class SessionStats:
    requests: int = 0
    prefill: int = 0
    cached: int = 0
    saved_s: float = 0.0   # prefill seconds the cached tokens would have cost (the server's fitted rate)
    seconds: float = 0.0   # what its requests took, arrival to answer (wall clock)
    slot: int | None = None
    source: str = ""
    lost: int = 0          # tokens the loss meter counted (slotlogic/ledger.py), every cause
    lost_unexpected: int = 0
    answered: float = 0.0  # when its last answer came (wall clock; the table's `done` goes with a new placement)

    def count_loss(self, tokens: int, expected: bool) -> None:
        """A settled loss of this session (at its answer, or once its cause was asked of the server)."""
        self.lost += tokens
        self.lost_unexpected += 0 if expected else tokens

    def unclaimed(self, seconds: float) -> float:
        """The most seconds saved a new answer that took `seconds` may add: what this session's requests took in
        all, less what they were already said to have saved. A saved figure is an estimate (what the cached
        tokens would have cost); bounded by the wall time the user waited for the same requests, it never
        claims more than a clock could check."""
        return max(0.0, self.seconds + seconds - self.saved_s)

    def add(self, obs: Observation, slot: int | None, source: str, saved_s: float = 0.0,
            seconds: float = 0.0) -> None:
        """`saved_s`: the prefill seconds its cached tokens would have cost (`Outcomes.saved_seconds`), within
        `unclaimed`; `seconds`: what the request took."""
        self.requests += 1
        self.seconds += seconds
        if obs.prompt_n is not None:
            self.prefill += obs.prompt_n
        if obs.cache_n is not None:
            self.cached += obs.cache_n
        self.saved_s += saved_s
        self.slot = slot if slot is not None else self.slot
        self.source = source

    @property
    def reuse(self) -> float | None:
        total = self.prefill + self.cached
        return self.cached / total if total else None
