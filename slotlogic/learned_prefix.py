"""Stable prefixes learned from traffic, for clients whose system prompt has no known marker.

Why: a prefix checkpoint needs to know where the part every session shares ends, and most clients put their
per-session part anywhere; two sessions of one client show it anyway. A prefix is learned from two sessions'
first system messages in one context (their common prefix, cut back to a line end), kept as a digest and a
length, never the text; the sample texts compared live only in memory, bounded in count and bytes, each kept
once with its latest senders. docs/checkpoints.md explains the rules.
"""

from __future__ import annotations

import hashlib
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from slotlogic import session as sess
from slotlogic.prefix import First, StablePrefix, first_system

MAX_LEARNED = 64
MAX_SAMPLES = 8
MAX_SENDERS = 32  # sessions remembered per sample text (Rule 5)
MAX_CONTEXTS = 32
MAX_SAMPLE_BYTES = 32 << 20  # the sample texts of every context together (their in-memory size)
MAX_TEXT_BYTES = MAX_SAMPLE_BYTES // 8  # one system message worth learning from, at most
MIN_CHARS = 256


@dataclass(frozen=True)
class Learned:
    """One learned stable prefix: where it applies (context), how long it is, what it hashes to."""

    context: str
    length: int
    digest: str
    last_seen: float


def _context(first: First) -> str:
    return sess.digest("learned-context", first.role, sess.canonical(first.tools),
                       sess.canonical(first.template_kwargs), first.route)


def text_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def common_length(a: str, b: str) -> int:
    """How many leading characters two strings share (a binary search over slice comparisons, in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def stable_cut(a: str, b: str, min_chars: int) -> int | None:
    """The length of the stable prefix two system messages share: the whole text when they are equal, else
    their common prefix cut back to the end of a line (trailing whitespace dropped); None when shorter than
    `min_chars`."""
    if a == b:
        n = len(a.rstrip())
        return n if n >= min_chars else None
    common = common_length(a, b)
    line_end = a.rfind("\n", 0, common)  # a line break inside the shared part: a line end in both texts
    if line_end < 0:
        return None
    n = len(a[:line_end].rstrip())
    return n if n >= min_chars else None


class PrefixLearner:
    def __init__(self, min_chars: int = MIN_CHARS) -> None:
        self.min_chars = min_chars
        self.learned: OrderedDict[tuple[str, int, str], Learned] = OrderedDict()
        self.samples: OrderedDict[str, Samples] = OrderedDict()  # context -> its sample texts
        self.sample_bytes = 0  # sys.getsizeof of every sample text

    def find(self, body: dict[str, Any], now: float) -> StablePrefix | None:
        """The longest learned prefix this body's first system message starts with."""
        first = first_system(body)
        if first is None:
            return None
        context = _context(first)
        best: Learned | None = None
        for rec in self.learned.values():
            if rec.context != context or rec.length > len(first.text):
                continue
            if (best is None or rec.length > best.length) and text_digest(first.text[:rec.length]) == rec.digest:
                best = rec
        if best is None:
            return None
        self._remember(Learned(best.context, best.length, best.digest, now))
        return StablePrefix(first.text[:best.length], first.role, first.tools, first.template_kwargs, first.route)

    def observe(self, session: str, body: dict[str, Any], now: float) -> Learned | None:
        """A new session's first system message: compared with the other sessions' of the same context; the
        prefix learned from it, if any (new or seen again)."""
        first = first_system(body)
        if first is None or len(first.text) < self.min_chars or sys.getsizeof(first.text) > MAX_TEXT_BYTES:
            return None
        context = _context(first)
        seen = self.samples.setdefault(context, Samples())
        self.samples.move_to_end(context)
        self.sample_bytes -= seen.drop(session)  # observed again: compared as new
        best = None
        for text in seen.values():
            n = stable_cut(first.text, text, self.min_chars)
            if n is not None and (best is None or n > best):
                best = n
        self.sample_bytes += seen.add(session, first.text)
        while len(seen) > MAX_SAMPLES:
            self.sample_bytes -= seen.drop_oldest()
        while len(self.samples) > MAX_CONTEXTS or (self.sample_bytes > MAX_SAMPLE_BYTES and self.samples):
            oldest_context = next(iter(self.samples))
            texts = self.samples[oldest_context]
            if texts and (len(self.samples) <= MAX_CONTEXTS):
                self.sample_bytes -= texts.drop_oldest()
                if texts:
                    continue
            self.sample_bytes -= sum(sys.getsizeof(text) for text in self.samples.pop(oldest_context).values())
        if best is None:
            return None
        rec = Learned(context, best, text_digest(first.text[:best]), now)
        self._remember(rec)
        return rec

    def sharers(self, prefix: StablePrefix) -> list[tuple[str, int]]:
        """Sessions whose first system message, as observed, shares a part of `prefix` in the same context, with
        how many of its characters: all of it for those that start with it, else their common part cut back to a
        line end (a token boundary), when at least `min_chars` long. A copy of their slot gives that much of it."""
        first = First(prefix.text, prefix.role, prefix.tools, prefix.template_kwargs, prefix.route)
        out = []
        seen = self.samples.get(_context(first))
        for text in seen.values() if seen is not None else ():
            n = len(prefix.text) if text.startswith(prefix.text) else stable_cut(prefix.text, text, self.min_chars)
            if n is not None:
                out.extend((s, min(n, len(prefix.text))) for s in seen.senders(text))
        return out

    def share_of(self, prefix: StablePrefix, session: str) -> int:
        """How many of `prefix`'s characters `session`'s first system message starts with (`sharers`; 0: none)."""
        return max((n for other, n in self.sharers(prefix) if other == session), default=0)

    def load(self, records: list[Learned]) -> None:
        """Learned prefixes from the shared state (another process, or this one before a restart)."""
        for rec in sorted(records, key=lambda r: r.last_seen):
            key = (rec.context, rec.length, rec.digest)
            mine = self.learned.get(key)
            if mine is None or mine.last_seen < rec.last_seen:
                self._remember(rec)

    def records(self) -> list[Learned]:
        return list(self.learned.values())

    def _remember(self, rec: Learned) -> None:
        key = (rec.context, rec.length, rec.digest)
        self.learned[key] = rec
        self.learned.move_to_end(key)
        while len(self.learned) > MAX_LEARNED:
            self.learned.popitem(last=False)


class Samples:
    """One context's sample texts, each kept once with the sessions that sent it (Rule 5); the least recently
    observed text first. Sizes returned are `sys.getsizeof` of the texts added or dropped."""

    def __init__(self) -> None:
        self._texts: OrderedDict[str, OrderedDict[str, None]] = OrderedDict()  # text -> its senders, latest last
        self._of: dict[str, str] = {}  # session -> the text it sent

    def __len__(self) -> int:
        return len(self._texts)

    def __contains__(self, session: object) -> bool:
        return session in self._of

    def values(self) -> list[str]:
        """The distinct texts, least recently observed first."""
        return list(self._texts)

    def senders(self, text: str) -> list[str]:
        return list(self._texts.get(text, ()))

    def add(self, session: str, text: str) -> int:
        """`session` sent `text`: the bytes newly kept (0 when the text is kept already)."""
        senders = self._texts.get(text)
        if senders is None:
            senders = self._texts[text] = OrderedDict()
            size = sys.getsizeof(text)
        else:
            self._texts.move_to_end(text)
            size = 0
        senders[session] = None
        self._of[session] = text
        while len(senders) > MAX_SENDERS:
            del self._of[senders.popitem(last=False)[0]]
        return size

    def drop(self, session: str) -> int:
        """Forget `session`'s sample: the bytes freed (its text goes with its last sender)."""
        text = self._of.pop(session, None)
        if text is None:
            return 0
        senders = self._texts[text]
        senders.pop(session, None)
        if senders:
            return 0
        del self._texts[text]
        return sys.getsizeof(text)

    def drop_oldest(self) -> int:
        """Forget the least recently observed text and its senders: the bytes freed."""
        text, senders = self._texts.popitem(last=False)
        for session in senders:
            self._of.pop(session, None)
        return sys.getsizeof(text)
