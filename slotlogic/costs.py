"""Page or recompute: what a slot move costs, from the speeds measured on the running server.

Why: a page-in is not always cheaper than a prefill (a small model on a CPU keeps little KV and prefills
slowly; a large one on a GPU the reverse), so each move compares its two estimates: `overhead + bytes /
throughput` against `a·n + b·n²/2` for the prefill, with `a` and `b` fitted to the answers' own counts and
speeds (`PrefillFit`). Until a speed is measured every decision is `None` (page whenever possible). Pure,
counts and seconds only. docs/paging.md ("Page or recompute") explains the estimates.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from slotlogic import numbers
from slotlogic.paging import PagePlan

WEIGHT = 0.3         # of the newest answer in each moving average
FORGET = 0.95        # of the older answers in the prefill fit's sums (the newest counts 1)
FIT_MIN = 3          # answers the prefill fit needs before its depth term is used
MIN_TOKENS = 64      # a shorter file's time is mostly the request's fixed overhead: not a throughput sample
MIN_MS = 0.05        # a timing below this is the clock's resolution, not a measurement
OVERHEAD_WINDOW = 8  # the restores whose fixed overhead is the smallest of (a busy server queues the others)


class Direction(Enum):
    SAVE = "save"
    RESTORE = "restore"


class Move(Enum):
    """Which move a choice is about (the log line and the JSONL record name it)."""

    PAGE_IN = "page-in"          # a session's own page (or a seed's) into its slot, against prefilling it
    PAGE_OUT = "page-out"        # a slot's holder saved, against letting it go (prefilled when it comes back)
    LIVE_SEED = "live-seed"      # another live slot saved and restored here, against prefilling what it shares
    PREFIX = "prefix"            # a prefix checkpoint restored, against warming the prefix up


@dataclass(frozen=True)
class SlotFileAnswer:
    """One successful slot save or restore, as the server answered it."""

    direction: Direction
    tokens: int
    bytes: int
    ms: float
    wall_ms: float | None = None  # the call as the proxy timed it (None: not timed)

    @classmethod
    def parse(cls, action: str, data: Any, wall_ms: float | None = None) -> SlotFileAnswer | None:
        """`data`: the JSON answer of `POST /slots/{id}?action=save|restore`; None when it is not a usable one."""
        if not isinstance(data, dict) or action not in ("save", "restore"):
            return None
        count, size, timing = ("n_saved", "n_written", "save_ms") if action == "save" else \
            ("n_restored", "n_read", "restore_ms")
        tokens, n_bytes = numbers.count(data.get(count)), numbers.count(data.get(size))
        timings = data.get("timings")
        ms = numbers.millis(timings.get(timing)) if isinstance(timings, dict) else None
        if not tokens or not n_bytes or ms is None:
            return None
        return cls(Direction(action), tokens, n_bytes, ms, wall_ms)


@dataclass(frozen=True)
class Rates:
    """The speeds a decision uses; None: not measured yet."""

    prefill_tps: float | None = None      # prompt tokens a second at the start of a context
    save_bps: float | None = None         # bytes a second written by a slot save
    restore_bps: float | None = None      # bytes a second read by a slot restore
    kv_bytes_per_token: float | None = None
    prefill_depth: float | None = None    # context depth at which a token costs twice as much (None: no slowdown)
    overhead_s: float = 0.0               # a slot call's fixed time beyond the server's own (HTTP), not queueing
    decode_tps: float | None = None       # generated tokens a second (answers' `predicted_per_second`)

    def prefill_s(self, tokens: int) -> float:
        """Seconds to prefill `tokens` into an empty slot."""
        assert self.prefill_tps
        deeper = tokens / (2 * self.prefill_depth) if self.prefill_depth else 0.0
        return tokens / self.prefill_tps * (1 + deeper)

    @property
    def measured(self) -> bool:
        return bool(self.prefill_tps and self.restore_bps)

    @property
    def decode_cost(self) -> float | None:
        """Prefill tokens one generated token costs (prefill speed ÷ decode speed; None: not both measured)."""
        return self.prefill_tps / self.decode_tps if self.prefill_tps and self.decode_tps else None

    def as_dict(self) -> dict[str, float | None]:
        """For the status view: rounded, None where not measured."""
        return {"prefill_tok_s": _round(self.prefill_tps, 1),
                "save_mb_s": _round(self.save_bps and self.save_bps / 1e6, 1),
                "restore_mb_s": _round(self.restore_bps and self.restore_bps / 1e6, 1),
                "kv_bytes_per_token": _round(self.kv_bytes_per_token, 0),
                "prefill_depth_tokens": _round(self.prefill_depth, 0),
                "move_overhead_ms": round(self.overhead_s * 1000, 1)}


class PrefillFit:
    """Least squares of `t = a·n + b·n·(c + n/2)` over the answers (n = prompt_n, c = cache_n, t = n / prompt
    speed), the older ones forgotten by FORGET per answer: the per-token cost `a` and its growth with depth `b`."""

    def __init__(self) -> None:
        self.sums = [0.0] * 5  # x1², x1·x2, x2², x1·t, x2·t
        self.n = 0

    def note(self, prompt_n: int, cache_n: int, tok_s: float) -> None:
        if prompt_n <= 0 or numbers.rate(tok_s) is None or numbers.count(prompt_n) is None \
                or numbers.count(cache_n) is None:
            return
        x1, x2, t = float(prompt_n), prompt_n * (cache_n + prompt_n / 2), prompt_n / tok_s
        new = (x1 * x1, x1 * x2, x2 * x2, x1 * t, x2 * t)
        sums = [FORGET * old + v for old, v in zip(self.sums, new, strict=True)]
        if all(math.isfinite(v) for v in sums):   # an overflow would leave the fit NaN for good
            self.sums = sums
            self.n += 1

    def solve(self) -> tuple[float, float] | None:
        """(a, b) in seconds, b > 0; None when the answers do not tell depth apart (similar sizes) yet."""
        s11, s12, s22, s1t, s2t = self.sums
        det = s11 * s22 - s12 * s12
        if self.n < FIT_MIN or det <= 1e-9 * s11 * s22:
            return None
        a, b = (s22 * s1t - s12 * s2t) / det, (s11 * s2t - s12 * s1t) / det
        return (a, b) if a > 0 and b > 0 else None


class Speeds:
    """The save and restore throughput and the KV bytes per token of one server: moving averages of its
    answers. The prefill speed is the keeper's (`Keeper.prefill_estimate`), passed in with `rates`."""

    def __init__(self) -> None:
        self.save_bps: float | None = None
        self.restore_bps: float | None = None
        self.kv_bytes_per_token: float | None = None
        self._overheads: deque[float] = deque(maxlen=OVERHEAD_WINDOW)
        self.decode_tps: float | None = None
        self.samples = {Direction.SAVE: 0, Direction.RESTORE: 0}
        self.fit = PrefillFit()

    def prefill(self, prompt_n: int | None, cache_n: int | None, tok_s: float | None) -> None:
        """One answer's prompt speed (`timings`): into the prefill fit."""
        if prompt_n and tok_s and prompt_n >= MIN_TOKENS:
            self.fit.note(prompt_n, cache_n or 0, tok_s)

    def decode(self, tok_s: float | None) -> None:
        """One answer's generation speed (`timings.predicted_per_second`)."""
        if tok_s:
            self.decode_tps = _avg(self.decode_tps, tok_s)

    def note(self, answer: SlotFileAnswer) -> bool:
        """Take one answer in; True when it was the first sample of its direction (worth a log line)."""
        if answer.tokens < MIN_TOKENS:
            return False
        self.kv_bytes_per_token = _avg(self.kv_bytes_per_token, answer.bytes / answer.tokens)
        if answer.ms < MIN_MS:
            return False
        bps = answer.bytes / (answer.ms / 1000)
        if answer.wall_ms is not None and answer.direction is Direction.RESTORE:  # a save may wait for the slot
            # A call's time beyond the server's own is its fixed cost plus its wait in the server's queue behind
            # the batch running then (a long prefill can make a half-second restore take many seconds). A
            # prefill started at that moment would wait for the same batch, so only the fixed part weighs a
            # move against a prefill: the smallest of the last few.
            self._overheads.append(max(0.0, answer.wall_ms - answer.ms) / 1000)
        if answer.direction is Direction.SAVE:
            self.save_bps = _avg(self.save_bps, bps)
        else:
            self.restore_bps = _avg(self.restore_bps, bps)
        self.samples[answer.direction] += 1
        return self.samples[answer.direction] == 1

    def rates(self, prefill_tps: float | None) -> Rates:
        """The speeds now; `prefill_tps`: the keeper's measured average, used until the fit has depth."""
        fit = self.fit.solve()
        tps, depth = (1 / fit[0], fit[0] / fit[1]) if fit is not None else (prefill_tps, None)
        return Rates(tps, self.save_bps, self.restore_bps, self.kv_bytes_per_token, depth,
                     min(self._overheads, default=0.0), self.decode_tps)

    def forget(self) -> None:
        """Another model or server: its sizes and speeds are not ours."""
        self.__init__()  # type: ignore[misc]


@dataclass(frozen=True)
class Choice:
    """One move decided by its cost: both estimates, in seconds, and which won."""

    move: Move
    tokens: int
    bytes: int
    move_s: float       # the save and/or restore
    prefill_s: float    # prefilling the same tokens (now, or when the conversation comes back)
    session: str = ""   # the session key whose conversation moves ("": a prefix)
    spares: int = 0     # tokens the move spares prefilling, when fewer than it moves (0: all of them)

    @property
    def worth(self) -> bool:
        return self.move_s < self.prefill_s


def size(tokens: int, n_bytes: int, rates: Rates) -> int:
    """A file's bytes: as recorded, else tokens times the measured KV bytes per token (0: unknown)."""
    if n_bytes > 0:
        return n_bytes
    return int(tokens * rates.kv_bytes_per_token) if rates.kv_bytes_per_token else 0


def page_in(tokens: int, n_bytes: int, rates: Rates, move: Move = Move.PAGE_IN) -> Choice | None:
    """Restore a page of `tokens` (`n_bytes`), or prefill them? None: not measured (restore, as ever)."""
    b = size(tokens, n_bytes, rates)
    if not rates.measured or tokens <= 0 or b <= 0:
        return None
    assert rates.prefill_tps and rates.restore_bps
    return Choice(move, tokens, b, rates.overhead_s + b / rates.restore_bps, rates.prefill_s(tokens))


def page_out(tokens: int | None, rates: Rates) -> Choice | None:
    """Save a conversation of `tokens` that leaves its slot, to read it back when it returns, or let it go and
    prefill it then? None: not measured or size unknown (save, as ever)."""
    if tokens is None or tokens <= 0 or not rates.measured or not rates.save_bps or not rates.kv_bytes_per_token:
        return None
    assert rates.prefill_tps and rates.restore_bps
    b = int(tokens * rates.kv_bytes_per_token)
    return Choice(Move.PAGE_OUT, tokens, b, 2 * rates.overhead_s + b / rates.save_bps + b / rates.restore_bps,
                  rates.prefill_s(tokens))


def live_seed(tokens: int, rates: Rates) -> Choice | None:
    """Copy a live slot here (its save, then the restore) to spare prefilling the `tokens` they share?"""
    choice = page_out(tokens, rates)
    return None if choice is None else Choice(Move.LIVE_SEED, choice.tokens, choice.bytes, choice.move_s,
                                              choice.prefill_s)


def prefix_restore(tokens: int, n_bytes: int, rates: Rates) -> Choice | None:
    """Restore a prefix checkpoint, or warm the prefix up (prefill it)? None: not measured (restore)."""
    return page_in(tokens, n_bytes, rates, Move.PREFIX)


def _avg(old: float | None, new: float) -> float | None:
    """The moving average with `new` in; a sample that is not a finite positive speed leaves it as it was (one
    infinity would make it NaN for good)."""
    if numbers.real(new, 0.0, numbers.MAX_RATE) is None:
        return old
    return new if old is None else old + WEIGHT * (new - old)


def _round(v: float | None, digits: int) -> float | None:
    return None if v is None else round(v, digits)


def judge(plan: PagePlan, rates: Rates, *, holder_tokens: int | None, restore_bytes: int,
          seed_tokens: int) -> PagePlan:
    """`plan` without the moves that cost more than the prefill they spare, each weighed move in
    `plan.choices`: the holder's page-out (`holder_tokens`: its conversation, None: unknown), the restore of a
    page file (`restore_bytes` as recorded, 0: unknown), a live seed's save and restore (`seed_tokens` it
    spares). A move whose estimate cannot be made stays (Rule 2)."""
    choices: list[Choice] = []
    if plan.save_for is not None:
        out = page_out(holder_tokens, rates)
        if out is not None:
            choices.append(replace(out, session=plan.save_for))
            if not out.worth:
                plan = replace(plan, save_for=None, save_file=None)
    if plan.restore_file is not None:
        live = plan.seed is not None and plan.seed.slot is not None
        c = live_seed(seed_tokens, rates) if live else page_in(plan.restore_tokens, restore_bytes, rates)
        if c is not None and plan.seed is not None and not live and 0 < seed_tokens < c.tokens:
            c = replace(c, prefill_s=rates.prefill_s(seed_tokens), spares=seed_tokens)  # only what it shares
        if c is not None:
            choices.append(replace(c, session=plan.restore_for or ""))
            if not c.worth:
                plan = plan.without_seed() if plan.seed is not None else replace(
                    plan, restore_for=None, restore_file=None, restore_tokens=0)
    return replace(plan, choices=tuple(choices)) if choices else plan
