"""Whether one server's restores take (pure): a slot restore that answers 200 is only trusted once the request
after it found the restored tokens cached.

Why: some llama-server builds answer a restore with the saved counts (and `/slots` shows the tokens) while
the next request on that slot prefills everything again; on sliding-window and hybrid models a restore drops
the slot's context checkpoints, so a prompt that steps back even one token is prefilled from zero. Every
page-in or prefix restore on such a server costs a save, a restore and the whole prefill anyway. So each
restore is judged by the answer that follows it (`cache_n` against the tokens restored, all a prefix of that
request's prompt); two in a row that did not take make the server's restores broken: no paging and no prefix
restores on it until it restarts (another process may be another build, or run with other flags), and its
saves are priced at nothing (`effective`). docs/reliability.md, "Restores that do not take".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from slotlogic.settings import CheckpointMode, Settings

TOOK_SHARE = 0.5   # of the restored tokens the next request must find cached for the restore to have taken
FAILS_TO_BREAK = 2  # restores in a row that did not take before the server's restores are called broken
MIN_RESTORED = 64   # a shorter restore says little (the request's own rollback, a template's last tokens)


class RestoreKind(Enum):
    PAGE = "page-in"    # a session's own page
    PREFIX = "prefix"   # a prefix checkpoint


class Health(Enum):
    UNKNOWN = "unknown"  # no restore judged yet on this server process
    TAKES = "takes"      # the last restore judged took
    BROKEN = "broken"    # restores answer but do not take: paging and prefix restores are off for this server


@dataclass(frozen=True)
class Judged:
    """One restore and the request after it."""

    kind: RestoreKind
    restored: int   # tokens the restore answered it put in the slot (`n_restored`)
    cached: int     # `cache_n` of the request that followed
    took: bool


def took(restored: int, cache_n: int) -> bool:
    """The request after a restore of `restored` tokens (a prefix of its prompt) found most of them cached."""
    return cache_n >= TOOK_SHARE * restored


class RestoreHealth:
    """The verdict of one server process. Reset when the server restarts (`reset`)."""

    def __init__(self) -> None:
        self._clear()

    def _clear(self) -> None:
        self.health = Health.UNKNOWN
        self.streak = 0          # restores in a row that did not take
        self.took = 0
        self.failed = 0
        self.last: Judged | None = None
        self.broken_by: tuple[Judged, ...] = ()  # the restores that made the verdict

    @property
    def broken(self) -> bool:
        return self.health is Health.BROKEN

    def judge(self, kind: RestoreKind, restored: int, cache_n: int | None) -> bool:
        """The answer of the request that followed a restore of `restored` tokens of its prompt. Returns True when
        this answer made the server's restores broken (worth one log line and a new configuration). A short
        restore, an answer without `cache_n`, or one on a server already judged broken teaches nothing."""
        if self.broken or cache_n is None or restored < MIN_RESTORED:
            return False
        seen = Judged(kind, restored, cache_n, took(restored, cache_n))
        self.last = seen
        if seen.took:
            self.took += 1
            self.streak = 0
            self.health = Health.TAKES
            return False
        self.failed += 1
        self.streak += 1
        self.broken_by = (*self.broken_by[-(FAILS_TO_BREAK - 1):], seen) if FAILS_TO_BREAK > 1 else (seen,)
        if self.streak >= FAILS_TO_BREAK:
            self.health = Health.BROKEN
            return True
        return False

    def reset(self) -> bool:
        """The server restarted (a new process: maybe another build, other flags): asked again. True when it
        had been judged broken (paging and prefix restores come back)."""
        was = self.broken
        self._clear()
        return was

    def effective(self, settings: Settings) -> Settings:
        """The settings this server is served with: as configured, or, with broken restores, no paging and prefix
        checkpoints warmed in memory only (a save whose restore keeps nothing is worth nothing)."""
        if not self.broken:
            return settings
        cp = CheckpointMode.MEMORY if settings.checkpoints is CheckpointMode.DISK else settings.checkpoints
        return replace(settings, paging=False, checkpoints=cp)

    def view(self) -> dict[str, object]:
        """The status view's part (counts only)."""
        last = self.last
        return {"health": self.health.value, "took": self.took, "did_not_take": self.failed,
                "last": None if last is None else {"kind": last.kind.value, "restored": last.restored,
                                                   "cached": last.cached}}
