"""What every proxy process shares about one llama-server's slot space: the state document's content, as data.

Pure: the stores read and write it under their lock. Tolerant: a document written by another version or
another tool yields the parts that make sense, every value range-checked, and never raises. Two maps: `slots`
(each slot's newest claim) and `sessions` (each session's slot, so a restarted proxy keeps its sessions); a
session owns its slot while the newest claim is its own. The hot path reads `slotlogic.table.SessionTable`,
never this.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from slotlogic import handover
from slotlogic.handover import Handover
from slotlogic.learned_prefix import MAX_LEARNED, Learned
from slotlogic.numbers import MAX_SLOTS, count, integer, real
from slotlogic.paging import FILE_RE as PAGE_FILE_RE
from slotlogic.paging import PageRecord
from slotlogic.ranking import SlotView
from slotlogic.server import ServerInfo
from slotlogic.table import Assignment, SessionTable

FORMAT_VERSION = 1
# Only `/props` sizes anything: a slot count or id in the state is a hint at most, dropped past `MAX_SLOTS`.
MAX_MARKER = 128  # a media_marker longer than this read from the store is not one


@dataclass(frozen=True)
class SlotRecord:
    last_used: float
    owner: str | None = None
    requests: int = 0
    prefix: str | None = None
    epoch: int = 0  # every claim of the slot, by any proxy, increments it: the fence of moves planned for it
    proxy: str | None = None  # the process whose session made the claim (a handover is asked of it)


@dataclass(frozen=True)
class Emptied:
    """A session's slot found emptied by a proxy's page-out of it (`cause`: "restart" or "idle-clear"), at `at`:
    the proxy whose session it is labels the loss so, not after what that page-out's placement wrote there."""

    cause: str
    at: float


MAX_EMPTIED = 256  # sessions whose emptied slot the state remembers (the oldest forgotten first)
EMPTIED_CAUSES = frozenset({"restart", "idle-clear"})
MAX_KEY = 128      # a session key longer than this read from the store is not one

MAX_EPOCH = 1 << 62  # an epoch read from the store past this is not ours: reset (never a value that sizes memory)
# Ranges of what the state may say (a file or Redis key another process or tenant can write): a value outside
# is not one a proxy wrote, and its record is dropped, never clamped into something that outranks real ones.
MAX_TIME = 1e11                   # a stamp past the year 5000, whatever the reader's clock
FUTURE_SKEW = 600.0               # how far ahead of the reader's clock another machine's stamp may be
MAX_TOKENS = 1 << 31
MAX_REQUESTS = 1 << 40
MAX_PAGE_BYTES = 1 << 44          # 16 TiB: no KV page is larger
MAX_READ_SESSIONS = 4096          # sessions read from a state (`slots_state_max_sessions` keeps 256 by default)
MAX_MODEL = 8192                  # a page's model identity (path, build and content)


@dataclass(frozen=True)
class SessionRecord:
    slot: int
    last_used: float
    requests: int = 0
    prefix: str | None = None
    claimed: float | None = None  # when it was put on this slot (which of two sharers came later)


@dataclass
class ServerState:
    upstream: str
    media_marker: str | None = None
    total_slots: int | None = None
    n_ctx: int | None = None
    slots: dict[int, SlotRecord] = field(default_factory=dict)
    sessions: dict[str, SessionRecord] = field(default_factory=dict)
    pages: dict[str, PageRecord] = field(default_factory=dict)  # session key -> its paged-out conversation
    prefixes: list[Learned] = field(default_factory=list)       # stable prefixes learned from traffic (no text)
    handovers: dict[tuple[int, str], Handover] = field(default_factory=dict)  # (slot, taker) -> its ask (handover.py)
    beats: dict[str, float] = field(default_factory=dict)        # proxy -> when it last said it is alive
    writers: dict[int, str] = field(default_factory=dict)        # slot -> the proxy that may write it
    idle_clearing: str | None = None  # media_marker of the server process a proxy saw emptying idle slots
    emptied: dict[str, Emptied] = field(default_factory=dict)  # session key -> its slot found emptied


# ---------------------------------------------------------------------------------------------------
# (de)serialisation


def _str(v: Any, longest: int = MAX_KEY) -> str | None:
    return v if isinstance(v, str) and len(v) <= longest else None


@dataclass(frozen=True)
class Clock:
    """What a time read from the state may be: a proxy wrote it, so it is past, give or take clock skew. A
    stamp from the future would outrank every real one (the most recent session kept, a slot held forever)."""

    latest: float = MAX_TIME

    def time(self, v: Any) -> float | None:
        return real(v, 0.0, self.latest)


def from_dict(data: Any, upstream: str, now: float | None = None) -> ServerState:
    """The state in `data`; every value of the wrong type or out of its range is dropped with its record (`now`:
    the reader's clock, when it has one, bounds the stamps)."""
    st = ServerState(upstream=upstream)
    if not isinstance(data, dict):
        return st
    clock = Clock(now + FUTURE_SKEW if now is not None else MAX_TIME)
    st.media_marker = _str(data.get("media_marker"), MAX_MARKER)
    marker = _str(data.get("idle_clearing"), MAX_MARKER)
    st.idle_clearing = marker or None
    total = integer(data.get("total_slots"))
    st.total_slots = total if total and 0 < total <= MAX_SLOTS else None
    st.n_ctx = count(data.get("n_ctx"), MAX_TOKENS) or None
    _read_slots(st, data.get("slots"), clock)
    _read_sessions(st, data.get("sessions"), clock)
    _read_pages(st, data.get("pages"), clock)
    _read_others(st, data, clock)
    return st


def _read_slots(st: ServerState, slots: Any, clock: Clock) -> None:
    if not isinstance(slots, dict):
        return
    for k, v in list(slots.items())[:MAX_SLOTS]:
        sid = integer(int(k)) if isinstance(k, str) and k.isdigit() and len(k) < 6 else None
        if not isinstance(v, dict) or sid is None or not 0 <= sid < MAX_SLOTS:
            continue
        used = clock.time(v.get("last_used"))
        if used is None:
            continue
        proxy = v.get("proxy")
        st.slots[sid] = SlotRecord(last_used=used, owner=_str(v.get("owner")),
                                   requests=count(v.get("requests"), MAX_REQUESTS) or 0, prefix=_str(v.get("prefix")),
                                   epoch=count(v.get("epoch"), MAX_EPOCH - 1) or 0,
                                   proxy=proxy if handover.valid_id(proxy) else None)


def _read_sessions(st: ServerState, sessions: Any, clock: Clock) -> None:
    if not isinstance(sessions, dict):
        return
    for k, v in sessions.items():
        if not isinstance(k, str) or len(k) > MAX_KEY or not isinstance(v, dict):
            continue
        slot, used = integer(v.get("slot")), clock.time(v.get("last_used"))
        if slot is None or not 0 <= slot < MAX_SLOTS or used is None:
            continue
        st.sessions[k] = SessionRecord(slot=slot, last_used=used, requests=count(v.get("requests"), MAX_REQUESTS) or 0,
                                       prefix=_str(v.get("prefix")), claimed=clock.time(v.get("claimed")))
    if len(st.sessions) > MAX_READ_SESSIONS:  # more than any proxy keeps: the most recent, the rest is not ours
        newest = sorted(st.sessions.items(), key=lambda kv: kv[1].last_used, reverse=True)[:MAX_READ_SESSIONS]
        st.sessions = dict(newest)


def _read_pages(st: ServerState, pages: Any, clock: Clock) -> None:
    """A page's size counts against the disk budget and its name is deleted: a size that is not a file's
    (negative, past `MAX_PAGE_BYTES`) would switch the budget off, so the record is not one of ours."""
    if not isinstance(pages, dict):
        return
    for k, v in pages.items():
        if not isinstance(k, str) or len(k) > MAX_KEY or not isinstance(v, dict):
            continue
        file, n, saved = _str(v.get("file")), count(v.get("n_tokens"), MAX_TOKENS), clock.time(v.get("saved"))
        size = count(v.get("bytes", 0), MAX_PAGE_BYTES)
        if file is None or not PAGE_FILE_RE.match(file) or n is None or saved is None or size is None:
            continue
        st.pages[k] = PageRecord(file=file, n_tokens=n, saved=saved, bytes=size,
                                 model=_str(v.get("model"), MAX_MODEL) or "")


def _read_others(st: ServerState, data: dict[str, Any], clock: Clock) -> None:
    handovers = data.get("handovers")
    if isinstance(handovers, list):
        for v in handovers[:handover.MAX_HANDOVERS]:
            sid = integer(v.get("slot")) if isinstance(v, dict) else None
            h = handover.from_dict(sid, v) if sid is not None and 0 <= sid < MAX_SLOTS else None
            if h is not None:
                st.handovers[(h.slot, h.taker)] = h
    writers = data.get("writers")
    if isinstance(writers, dict):
        for k, v in list(writers.items())[:MAX_SLOTS]:
            if isinstance(k, str) and k.isdigit() and len(k) < 6 and int(k) < MAX_SLOTS and handover.valid_id(v):
                st.writers[int(k)] = v
    beats = data.get("beats")
    if isinstance(beats, dict):
        for k, v in list(beats.items())[:handover.MAX_PROXIES]:
            beat = clock.time(v)
            if handover.valid_id(k) and beat is not None:
                st.beats[k] = beat
    emptied = data.get("emptied")
    if isinstance(emptied, dict):
        for k, v in list(emptied.items())[:MAX_EMPTIED]:
            at = clock.time(v.get("at")) if isinstance(v, dict) else None
            if isinstance(k, str) and len(k) <= MAX_KEY and at is not None and v.get("cause") in EMPTIED_CAUSES:
                st.emptied[k] = Emptied(v["cause"], at)
    prefixes = data.get("prefixes")
    if isinstance(prefixes, list):
        for v in prefixes[:MAX_LEARNED]:
            if not isinstance(v, dict):
                continue
            ctx, n, dig, seen = (_str(v.get("context")), count(v.get("length"), MAX_TOKENS), _str(v.get("digest")),
                                 clock.time(v.get("last_seen")))
            if ctx and n and dig and len(dig) == 64 and seen is not None:
                st.prefixes.append(Learned(ctx, n, dig, seen))


def to_dict(st: ServerState) -> dict[str, Any]:
    return {
        "version": FORMAT_VERSION,
        "upstream": st.upstream,
        "media_marker": st.media_marker,
        "total_slots": st.total_slots,
        "n_ctx": st.n_ctx,
        "slots": {str(k): {"last_used": v.last_used, "owner": v.owner, "requests": v.requests,
                           "prefix": v.prefix, "epoch": v.epoch, "proxy": v.proxy}
                  for k, v in sorted(st.slots.items())},
        "sessions": {k: {"slot": v.slot, "last_used": v.last_used, "requests": v.requests,
                         "prefix": v.prefix, "claimed": v.claimed} for k, v in sorted(st.sessions.items())},
        "pages": {k: {"file": v.file, "n_tokens": v.n_tokens, "saved": v.saved, "bytes": v.bytes,
                      "model": v.model} for k, v in sorted(st.pages.items())},
        "prefixes": [{"context": p.context, "length": p.length, "digest": p.digest, "last_seen": p.last_seen}
                     for p in st.prefixes],
        "handovers": [handover.to_dict(h) for _, h in sorted(st.handovers.items())],
        "beats": dict(st.beats),
        "writers": {str(k): v for k, v in sorted(st.writers.items())},
        "idle_clearing": st.idle_clearing,
        "emptied": {k: {"cause": v.cause, "at": v.at} for k, v in st.emptied.items()},
    }


def note_emptied(st: ServerState, key: str, cause: str, now: float) -> None:
    """A page-out of `key` found its slot emptied (`Emptied`): kept for its own proxy, the newest `MAX_EMPTIED`."""
    if cause not in EMPTIED_CAUSES or len(key) > MAX_KEY:
        return
    st.emptied.pop(key, None)
    st.emptied[key] = Emptied(cause, now)
    while len(st.emptied) > MAX_EMPTIED:
        del st.emptied[min(st.emptied, key=lambda k: st.emptied[k].at)]


def saw_idle_clearing(st: ServerState, marker: str | None) -> bool:
    """A proxy saw the server process `marker` empty idle slots (unified KV): the other proxies of this state
    may not, when the emptied slots were only this one's. True when that is news for the state."""
    if not marker or st.idle_clearing == marker:
        return False
    st.idle_clearing = marker
    return True


def clears_idle_slots(st: ServerState, marker: str | None) -> bool:
    """Some proxy saw this server process (`marker`) empty idle slots."""
    return bool(marker) and st.idle_clearing == marker


def keep_learned(st: ServerState, records: list[Learned], now: float, keep_seconds: float) -> None:
    """The learned prefixes after this process's news: the newest sighting of each, none unseen for
    `keep_seconds` (their checkpoint files then age out through the checkpoint cleanup)."""
    merged: dict[tuple[str, int, str], Learned] = {}
    for rec in [*st.prefixes, *records]:
        key = (rec.context, rec.length, rec.digest)
        if key not in merged or merged[key].last_seen < rec.last_seen:
            merged[key] = rec
    st.prefixes = sorted((r for r in merged.values() if now - r.last_seen < keep_seconds),
                         key=lambda r: r.last_seen)[-MAX_LEARNED:]


# ---------------------------------------------------------------------------------------------------
# transitions


@dataclass(frozen=True)
class ServerChange:
    """What a `/props` answer says happened to the server since the state last saw it."""

    restarted: bool = False  # a new process: every slot is empty
    resized: bool = False    # a new slot count: claims out of range are void


def note_server(st: ServerState, info: ServerInfo, me: str | None = None, now: float | None = None) -> ServerChange:
    """Fold in the server's identity from `/props`. `me`, `now`: the process reading it, and when (a restart
    voids the claims of processes no longer alive)."""
    marker, total = info.media_marker, info.total_slots
    restarted = bool(marker and st.media_marker and marker != st.media_marker)
    if restarted:
        # Every slot is empty after a restart: what we knew of their content is void. Claims of live proxies
        # stay, so their sessions keep their slots (and their spread) and simply re-prefill once; claims of
        # processes that are gone protect nothing (an empty slot of a session no process serves) and go.
        st.slots = {k: replace(v, prefix=None) for k, v in st.slots.items()}
        if now is not None:
            release_claims(st, lambda p: p != me and not handover.alive(st.beats, p, now))
    if marker:
        st.media_marker = marker
    resized = bool(st.total_slots and total != st.total_slots)
    st.total_slots = total
    st.slots = {k: v for k, v in st.slots.items() if k < total}
    st.sessions = {k: v for k, v in st.sessions.items() if v.slot < total}
    if info.n_ctx:
        st.n_ctx = info.n_ctx
    return ServerChange(restarted=restarted, resized=resized)


def held_slots(st: ServerState, now: float, ttl: float) -> set[int]:
    """Slots whose newest claim is a session (of any proxy) that ran a request there within `ttl` seconds."""
    return {sid for sid, rec in st.slots.items() if rec.owner and rec.requests > 0 and now - rec.last_used < ttl}


def ran_there(st: ServerState, slot: int, session: str, now: float, ttl: float) -> bool:
    """`session` (of any proxy) was given `slot` and ran a request there within `ttl` seconds (the slot's own
    newest claim may be a placement's that came since)."""
    rec = st.sessions.get(session)
    return rec is not None and rec.slot == slot and rec.requests > 0 and now - rec.last_used < ttl


def owned_slot(st: ServerState, session: str) -> int | None:
    """The slot `session` still owns (its claim is the slot's newest), else None."""
    rec = st.sessions.get(session)
    if rec is None or (st.total_slots is not None and rec.slot >= st.total_slots):
        return None
    slot = st.slots.get(rec.slot)
    if slot is None or slot.owner in (None, session):
        return rec.slot
    return None


def claim(st: ServerState, session: str, slot: int, now: float, *, prefix: str | None = None,
          requests: int = 1) -> None:
    old = st.slots.get(slot)
    st.slots[slot] = SlotRecord(last_used=now, owner=session, requests=requests, prefix=prefix,
                                epoch=(old.epoch if old is not None else 0) + 1)
    st.sessions[session] = SessionRecord(slot=slot, last_used=now, requests=requests, prefix=prefix, claimed=now)


def touch(st: ServerState, session: str, slot: int, when: float, *, requests: int,
          prefix: str | None, proxy: str | None = None) -> None:
    """Merge one coalesced touch: only refreshes a slot the session still owns (or nobody claimed)."""
    current = st.slots.get(slot)
    if current is not None and current.owner not in (None, session) and current.last_used >= when:
        return  # someone else claimed the slot after us; their claim stands
    last = max(when, current.last_used if current and current.owner == session else 0.0)
    st.slots[slot] = SlotRecord(last_used=last, owner=session, requests=requests,
                                prefix=prefix or (current.prefix if current else None),
                                epoch=current.epoch if current is not None else 0,
                                proxy=proxy or (current.proxy if current is not None else None))
    before = st.sessions.get(session)
    claimed = before.claimed if before is not None and before.slot == slot and before.claimed else when
    st.sessions[session] = SessionRecord(slot=slot, last_used=last, requests=requests, prefix=prefix, claimed=claimed)


def release_claims(st: ServerState, gone: Callable[[str | None], bool]) -> list[int]:
    """Void the slot claims made by processes `gone` says are gone (a claim names its proxy): their slots are
    free for the next new session at once, not after the TTL. The sessions keep their records, so one that
    comes back to a proxy of this state resumes its slot while nobody else has taken it; the epoch stays (the
    fence of moves planned for the slot). Returns the slots released."""
    released = [sid for sid, rec in st.slots.items() if rec.owner is not None and gone(rec.proxy)]
    for sid in released:
        st.slots[sid] = replace(st.slots[sid], owner=None, last_used=0.0, requests=0, proxy=None)
    return released


def leave(st: ServerState, proxy: str) -> list[int]:
    """A proxy exits: its claims are released (`release_claims`) and it beats no more."""
    st.beats.pop(proxy, None)
    return release_claims(st, lambda p: p == proxy)


def forget_session(st: ServerState, session: str) -> int | None:
    """Forget `session`; its slot becomes free at once (no TTL wait). Returns the slot it had."""
    rec = st.sessions.pop(session, None)
    if rec is None:
        return None
    slot = st.slots.get(rec.slot)
    if slot is not None and slot.owner == session:
        st.slots[rec.slot] = replace(slot, owner=None, last_used=0.0, requests=0)
    return rec.slot


def displaced_by_others(st: ServerState, sessions: Mapping[str, Assignment], holders: Mapping[int, str]
                        ) -> dict[int, str]:
    """Slots where this process believes one of its sessions' conversation sits, but whose newest claim in
    the shared state is another session's, made after our session's last request: another proxy's session
    ran there since (the displacement record). Returns slot -> that session."""
    out: dict[int, str] = {}
    for slot, key in holders.items():
        mine = sessions.get(key)
        rec = st.slots.get(slot)
        if (mine is None or rec is None or rec.owner in (None, key) or rec.owner in sessions
                or mine.slot != slot):
            continue
        if rec.last_used > mine.last_used:
            out[slot] = rec.owner
    return out


def match_sessions(keys: list[str], wanted: str) -> list[str]:
    """Session keys starting with `wanted` (the 8-hex short form in logs is enough)."""
    wanted = wanted.strip().lower()
    return [k for k in keys if wanted and k.startswith(wanted)]


def prune(st: ServerState, now: float, keep_seconds: float) -> list[str]:
    """Forget sessions unseen for `keep_seconds` so the file stays small; returns the page files of the
    forgotten sessions (the driver deletes them)."""
    st.sessions = {k: v for k, v in st.sessions.items() if now - v.last_used < keep_seconds}
    gone = [k for k in st.pages if k not in st.sessions]
    return [st.pages.pop(k).file for k in gone]


def compact(st: ServerState, now: float, keep_seconds: float, max_sessions: int) -> list[str]:
    """`prune`, then at most `max_sessions` sessions: the most recently used, plus every slot's owner (a
    restarted proxy resumes those). A stamp from the future (no proxy wrote it) ranks last, not first. Every new
    session's transaction reads and writes the whole file, so its size, not the number of sessions ever seen,
    sets the cost. Returns the page files of the sessions forgotten."""
    doomed = prune(st, now, keep_seconds)
    if len(st.sessions) <= max_sessions:
        return doomed
    owners = {rec.owner for rec in st.slots.values() if rec.owner}
    latest = now + FUTURE_SKEW

    def used(k: str) -> float:
        t = st.sessions[k].last_used
        return t if t <= latest else -1.0

    recent = sorted(st.sessions, key=used, reverse=True)[:max_sessions]
    keep = owners.union(recent)
    st.sessions = {k: v for k, v in st.sessions.items() if k in keep}
    gone = [k for k in st.pages if k not in st.sessions]
    return doomed + [st.pages.pop(k).file for k in gone]


def views(st: ServerState, total_slots: int, live: list[dict[str, Any]] | None,
          local: SessionTable | None = None, pending: Collection[int] = ()) -> list[SlotView]:
    """One `SlotView` per slot id: `/slots` numbers (when reachable) merged with the claims. `local` is this
    process's own session table: fresher than the file (touches reach it only every 2 s), the only place
    that knows when an owner's last answer completed, and the only place that knows which session ran on
    a slot *last* (a known session pinned back to its slot claims nothing in the file). `pending`: slots a
    placement of this process has chosen and not yet sent its request to: busy, as they soon are."""
    by_id: dict[int, dict[str, Any]] = {}
    for entry in live or []:
        sid = integer(entry.get("id")) if isinstance(entry, dict) else None
        if sid is not None:
            by_id[sid] = entry
    sessions = local.sessions if local is not None else {}
    out = []
    for sid in range(total_slots):
        entry = by_id.get(sid, {})
        rec = st.slots.get(sid)  # the newest claim in the file, by any process
        holder = local.holders.get(sid) if local is not None else None
        mine = sessions.get(holder) if holder is not None else None
        if (mine is not None and mine.slot == sid
                and (rec is None or rec.owner == holder or rec.last_used <= mine.last_used)):
            same = rec is not None and rec.owner == holder
            rec = SlotRecord(last_used=max(mine.last_used, rec.last_used if same and rec else 0.0), owner=holder,
                             # another owner's signature says nothing of what the holder left there
                             prefix=mine.prefix if mine.prefix is not None else (rec.prefix if same and rec else None))
        else:  # the file's owner, with what this process knows about it (fresher last use, answer time)
            mine = sessions.get(rec.owner) if rec is not None and rec.owner else None
            if mine is not None and mine.slot == sid and rec is not None:
                rec = replace(rec, last_used=max(rec.last_used, mine.last_used))
            else:
                mine = None
        n_tokens = integer(entry.get("n_prompt_tokens"))
        if live is not None and entry and n_tokens is None:
            n_tokens = 0  # a slot that never ran a task lists no counters: it is empty
        out.append(SlotView(
            id=sid,
            n_tokens=n_tokens,
            busy=bool(entry.get("is_processing", False)) or sid in pending,
            last_used=rec.last_used if rec else None,
            owner=rec.owner if rec else None,
            prefix=rec.prefix if rec else None,
            owner_done=mine.done if mine is not None else None,
            owner_gap=mine.gap if mine is not None else None,
        ))
    return out


