"""Per-session counters for the status view and the summary at shutdown: the server's own numbers, added up."""

from __future__ import annotations

from dataclasses import dataclass

from slotlogic.answers import Observation


@dataclass
class SessionStats:
    requests: int = 0
    prefill: int = 0
    cached: int = 0
    saved_s: float = 0.0   # prefill seconds the cached tokens would have cost at the server's own speed
    slot: int | None = None
    source: str = ""
    lost: int = 0          # tokens the loss meter counted (slotlogic/ledger.py), every cause
    lost_unexpected: int = 0
    answered: float = 0.0  # when its last answer came (wall clock; the table's `done` goes with a new placement)

    def count_loss(self, tokens: int, expected: bool) -> None:
        """A settled loss of this session (at its answer, or once its cause was asked of the server)."""
        self.lost += tokens
        self.lost_unexpected += 0 if expected else tokens

    def add(self, obs: Observation, slot: int | None, source: str, *, fallback_pps: float | None = None) -> None:
        """`fallback_pps`: the measured prefill speed (start-up probe), for answers without timings (Anthropic,
        /v1/responses)."""
        self.requests += 1
        if obs.prompt_n is not None:
            self.prefill += obs.prompt_n
        if obs.cache_n is not None:
            self.cached += obs.cache_n
            speed = obs.prompt_per_second or fallback_pps
            if speed:
                self.saved_s += obs.cache_n / speed
        self.slot = slot if slot is not None else self.slot
        self.source = source

    @property
    def reuse(self) -> float | None:
        total = self.prefill + self.cached
        return self.cached / total if total else None
