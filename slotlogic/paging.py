"""Session paging: a session's whole conversation leaves its slot as a file and comes back the same way.

Why: sessions that outnumber slots must share them, and pinning only chooses whose conversation is
overwritten; a slot save and restore brings it back in milliseconds instead of a prefill of seconds to
minutes. Pure: `holder_of` says whose conversation a slot holds, `plan` what to save and restore; the driver
performs it under the slot's lock. A restore only sets what the slot holds (llama-server still reuses just the
common prefix), so a stale page costs prefill, never correctness; pages are restored only under the identity
that wrote them, bounded on disk at every moment, and recorded before they are written.
docs/paging.md explains each rule.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING

from slotlogic import lead as leads
from slotlogic.lead import Lead
from slotlogic.ranking import SlotView
from slotlogic.server import work_left

if TYPE_CHECKING:
    from slotlogic.costs import Choice
    from slotlogic.handover import Handover
    from slotlogic.prefix import StablePrefix

FILE_RE = re.compile(r"^page-[0-9a-f]{20}\.bin$")
MIN_TOKENS = 64  # below this a prefill is cheaper than the bookkeeping (and it is mostly a bare prompt)
# A seed must give ~MIN_TOKENS more than the slot holds anyway (4 characters a token): the same trade as a
# page-in, which moves a whole conversation to spare its prefill.
CHARS_PER_TOKEN = 4
SEED_MIN_CHARS = CHARS_PER_TOKEN * MIN_TOKENS


@dataclass(frozen=True)
class PageAsk:
    """What a page plan is asked about, built once by the driver and passed through (`Pager.page_plan`,
    `Pager.busy_source`): `session_key`'s request goes to `slot` (as `view` shows it). `sent`: the session the
    slot's previous pager of any proxy sent there, and when. `views`: every slot (where a seed may come from).
    `stable_chars`: its stable prefix's length (what a checkpoint gives it anyway). `cold`: its stable prefix,
    when no checkpoint file holds it yet, with `base_chars` of it that a shorter one's file gives (a family's base
    prompt). `elsewhere`: a source on another server, idle there, copied when nothing here gives as much.
    `copy_live=False`: no live slot may be saved for it. `given`: the other
    proxy's answer to this placement's handover, with `ours` (this process's last request there to reach the
    server)."""

    slot: int
    session_key: str
    view: SlotView
    sent: tuple[str, float] | None = None
    views: Sequence[SlotView] = ()
    stable_chars: int = 0
    cold: StablePrefix | None = None
    base_chars: int = 0
    copy_live: bool = True
    ring: int = 0  # the save dir is out of reach: the number of page names the budget allows (`ring_file`)
    elsewhere: Seed | None = None  # the best live source on another server of the pool (`Seeds.source_for`)
    paging_out: frozenset[str] = frozenset()  # sessions this process is paging out now (their pages to come)
    given: Handover | None = None
    ours: tuple[str, float] | None = None


@dataclass(frozen=True)
class PageFiles:
    """How one server's page files are named (`upstream`, a `salt` unique to the plan) and which server state
    (`model`) a page must fit to be restored."""

    upstream: str
    model: str
    salt: str = ""
    # With the save dir out of reach, a save takes a name from a bounded ring (`ring_file`) and overwrites it:
    # the names it may take, best first (empty: none free now). None: a new name per save.
    ring: tuple[str, ...] | None = None


@dataclass(frozen=True)
class PageDone:
    """What a paging step did, as the driver saw it: the holder's save (tokens; None: failed or none), its
    bytes, whether the restore failed, and a live seed's save (tokens, bytes)."""

    saved_tokens: int | None
    saved_bytes: int = 0
    restore_failed: bool = False
    seed_saved: tuple[int, int] | None = None


@dataclass(frozen=True)
class PageRecord:
    """One saved conversation: where it is, how long it is, and which server state it fits."""

    file: str
    n_tokens: int
    saved: float
    bytes: int = 0
    model: str = ""  # model path + build info of the server that wrote it


@dataclass(frozen=True)
class Seed:
    """Another session's conversation a session with no page of its own starts from (slotlogic/lead.py)."""

    source: str             # that session's key
    chars: int              # characters of the leading messages the two share
    slot: int | None = None  # its live slot, saved first; None: its page is restored as it is
    prefix: bool = False     # it shares only the stable prefix: the prefix checkpoint is then built from it
    server: str | None = None  # another server of the pool whose live slot is copied (the save dir is one)
    page: PageRecord | None = None  # with `server` and no `slot`: that server's page of it, restored as it is

    @property
    def local_slot(self) -> int | None:
        """The live slot of this server the seed is saved from (None: a page, or a slot of another server)."""
        return self.slot if self.server is None else None


@dataclass(frozen=True)
class PagePlan:
    """What to do to `slot` before a session's request goes there. Any part may be absent."""

    slot: int
    save_for: str | None = None      # session key whose conversation the slot holds now
    save_file: str | None = None
    restore_for: str | None = None   # session key whose page goes into the slot (a seed's source for a seed)
    restore_file: str | None = None
    restore_tokens: int = 0          # 0 for a seed saved from a live slot: what that save wrote
    seed: Seed | None = None         # the restore is another session's conversation, a start for ours
    seed_file: str | None = None     # where the seed's live slot is saved first (the source's new page)
    choices: tuple[Choice, ...] = ()  # the moves weighed by their cost (`slotlogic.costs.judge`), for the log

    @property
    def empty(self) -> bool:
        return self.save_file is None and self.restore_file is None

    @property
    def saves(self) -> list[tuple[str, str]]:
        """(session, file) of every save this plan makes and records: the slot's holder, a live seed's source
        (a copy from another server is nobody's page here: its file goes once restored, `copy_file`)."""
        out = [(self.save_for, self.save_file)]
        if self.seed is not None and self.seed.server is None:
            out.append((self.seed.source, self.seed_file))
        return [(k, f) for k, f in out if k and f]

    @property
    def copy_file(self) -> str | None:
        """The file a copy of another server's slot is saved to and restored from, deleted after."""
        return self.seed_file if self.seed is not None and self.seed.server is not None else None

    def without_saves(self) -> PagePlan:
        """The plan with no save: nothing written (what it would write does not fit the budget)."""
        return replace(self.without_seed(), save_for=None, save_file=None)

    def without_seed(self) -> PagePlan:
        if self.seed is None:
            return self
        return replace(self, seed=None, seed_file=None, restore_for=None, restore_file=None, restore_tokens=0)


def restorable(rec: PageRecord | None, identity: str, min_tokens: int = MIN_TOKENS) -> bool:
    """A page that can stand for its conversation here: written under this model, build and KV layout
    (`identity`), and long enough to be worth a restore (the one rule for pages, seeds and routing)."""
    return rec is not None and rec.model == identity and rec.n_tokens >= min_tokens


def ring_file(upstream: str, i: int) -> str:
    """The `i`th of a server's bounded set of page names (no session in it: any session's page may take it)."""
    return "page-" + hashlib.sha256(f"{upstream}\nring\n{i}".encode()).hexdigest()[:20] + ".bin"


def page_file(upstream: str, session_key: str, salt: str = "") -> str:
    """A private file name per (server, session, save): no session text in it, no collision between two
    servers that share one save directory, and, with a salt unique to the save, never a file that two
    processes write at once (each save writes its own file, which only its own record names)."""
    return "page-" + hashlib.sha256(f"{upstream}\n{session_key}\n{salt}".encode()).hexdigest()[:20] + ".bin"


class Moved(Enum):
    """What a paging step left in the slot for the session about to run there."""

    NOTHING = "nothing"  # what was there stays (its conversation, a prefix, or nothing)
    OWN = "own"          # its own page: paged in
    SEED = "seed"        # another session's conversation it shares its start with
    PREFIX = "prefix"    # another session's conversation that starts with its stable prefix (a cheap build)
    STALE = "stale"      # nothing was moved: the slot moved on since the placement (place the request again)
    LATE = "late"        # nothing was moved: the slot stayed another placement's past the request's wait bound
    FREED = "freed"      # nothing was moved: another slot freed first (place the request again)


class PageCheck(Enum):
    """Why a page was dropped after a restore: its content is not what the index says."""

    COUNT_MISMATCH = "n_restored differs from the recorded n_tokens"
    LOW_CACHE = "the request after the restore reused little of it"


def holder_of(slot: int, view: SlotView, dispatched: Mapping[int, str]) -> tuple[str | None, int | None]:
    """Whose conversation the slot will hold when a save reaches it, and its size when known.

    llama-server runs a slot's requests and slot tasks in arrival order (a save waits for the requests
    queued before it), so that is the session whose request this process sent there last (`dispatched`).
    Only when this process sent nothing there since it started (or since a server restart) does the
    snapshot's owner (the state file, other processes) stand in, with `/slots`' token count (a request
    sent since the snapshot makes that count stale, so then the size is unknown)."""
    holder = dispatched.get(slot)
    if holder is None:
        return view.owner, view.n_tokens
    return (holder, None) if holder else (None, None)  # "": a side call ran there last, nobody's conversation


def plan(slot: int, session_key: str, holder: str | None, holder_tokens: int | None,
         pages: Mapping[str, PageRecord], files: PageFiles, *, holds_own: bool = False,
         min_tokens: int = MIN_TOKENS) -> PagePlan:
    """Page out the slot's holder if it is another session with a conversation worth keeping (unknown size
    counts as worth it: a save costs milliseconds); page in `session_key` unless the slot holds its
    conversation already (it was the last to run there, or `holds_own`)."""
    save_for = save_file = None
    if holder not in (None, "", session_key) and (holder_tokens is None or holder_tokens >= min_tokens):
        save_file = page_file(files.upstream, holder, files.salt) if files.ring is None else \
            files.ring[0] if files.ring else None
        save_for = holder if save_file is not None else None
    rec = pages.get(session_key)
    if not restorable(rec, files.model, min_tokens) or holds_own or holder == session_key:
        return PagePlan(slot, save_for, save_file)
    return PagePlan(slot, save_for, save_file, session_key, rec.file, rec.n_tokens)


def choose_seed(lead: Lead | None, candidates: Iterable[tuple[str, Lead | None, int | None]],
                pages: Mapping[str, PageRecord], model: str, *, beat: int) -> Seed | None:
    """The conversation a session without a page of its own shares the most leading messages with, when it
    shares `SEED_MIN_CHARS` more than `beat` (what the slot gives it anyway: the conversation left there, or
    its stable prefix's checkpoint). `candidates`: (session, its lead, its live slot when idle there, else
    None). A restorable page is preferred at an equal share: it needs no save."""
    best: tuple[int, int, Seed] | None = None
    for key, other, live in candidates:
        _, chars = leads.shared(lead, other)
        if chars < beat + SEED_MIN_CHARS:
            continue
        if restorable(pages.get(key), model):
            seed, rank = Seed(key, chars), 1
        elif live is not None:
            seed, rank = Seed(key, chars, live), 0
        else:
            continue
        if best is None or (chars, rank) > best[:2]:
            best = (chars, rank, seed)
    return best[2] if best else None


def source_wait(chars: int, prefill_rate: float | None, cap: float) -> float:
    """How long a new session may wait for the conversation it would start from while that slot runs its own
    request (a save waits for the slot anyway): at most what prefilling the `chars` it would copy takes at the
    server's measured prompt rate (tokens/s), so waiting costs at most twice the prefill it may save; `cap`
    when no rate is measured yet (the first requests of a proxy), never more than `cap`."""
    if cap <= 0 or chars <= 0:
        return 0.0
    if prefill_rate is None or prefill_rate <= 0:
        return cap
    return min(cap, chars / CHARS_PER_TOKEN / prefill_rate)


@dataclass(frozen=True)
class SourceWait:
    """A busy slot a new session would start from (`Pager.busy_source`): how long waiting for it is worth, and
    how many tokens the copy would spare (4 characters a token)."""

    slot: int
    budget: float
    tokens: int
    cap: float
    decode_cost: float | None = None  # prefill tokens one generated token costs (prefill ÷ decode speed)
    session: str | None = None        # whose conversation that slot holds (its page may come instead)


def keep_waiting(wait: SourceWait, entry: Mapping[str, object] | None, waited: float, budget_left: float) -> bool:
    """Whether to go on waiting for `wait.slot` after `waited` seconds (its `/slots` entry as it is now): within
    the budget; past it, as long as the source is still prefilling and has at most twice the tokens it would
    spare us left to go (prefilling them beside it on the same server would take at least as long, the two
    sharing its compute), or is generating with at most as much work left (its `n_remain` tokens, each costing
    `wait.decode_cost` prefill tokens: its prompt is all there, the copy follows its last token); or is idle while
    its answer has not come (it ended a moment ago) or its request is still on its way there (it was placed first:
    `Pager.busy_source`), up to twice the budget; never past the cap."""
    if waited >= wait.cap:
        return False
    if budget_left > 0:
        return True
    if isinstance(entry, Mapping) and entry.get("is_processing") is False:
        return waited < 2 * wait.budget
    left = work_left(entry, wait.decode_cost)
    return left is not None and left <= 2 * wait.tokens


def seeded(plan: PagePlan, seed: Seed, pages: Mapping[str, PageRecord], upstream: str, salt: str,
           ring: tuple[str, ...] | None = None) -> PagePlan:
    """`plan` with `seed` restored into its slot after its save (a live seed's slot saved first, under a ring
    name the holder's save does not take when names are bounded: none left, no seed)."""
    if seed.slot is None:
        rec = seed.page if seed.page is not None else pages[seed.source]
        return replace(plan, seed=seed, restore_for=seed.source, restore_file=rec.file, restore_tokens=rec.n_tokens)
    if ring is not None:
        free = [n for n in ring if n != plan.save_file]
        if not free:
            return plan
        file = free[0]
    else:
        file = page_file(upstream, seed.source, salt + ":seed")
    return replace(plan, seed=seed, seed_file=file, restore_for=seed.source, restore_file=file, restore_tokens=0)


def intent(pages: dict[str, PageRecord], session_key: str, file: str, now: float, model: str) -> str | None:
    """Record a page about to be saved: known (so never an orphan), not restorable (0 tokens) until `saved`.
    Returns the file of the page it replaces (to delete)."""
    prev = pages.get(session_key)
    pages[session_key] = PageRecord(file=file, n_tokens=0, saved=now, bytes=prev.bytes if prev else 0, model=model)
    return prev.file if prev is not None and prev.file != file else None


def saved(pages: dict[str, PageRecord], session_key: str, file: str, n_tokens: int, n_bytes: int,
          now: float, model: str) -> None:
    pages[session_key] = PageRecord(file=file, n_tokens=n_tokens, saved=now, bytes=n_bytes, model=model)


def restore_checked(expected: int, n_restored: int) -> PageCheck | None:
    """The cheap check after a restore: the server read as many tokens as the page was saved with."""
    return None if n_restored == expected else PageCheck.COUNT_MISMATCH


def doubtful(restored_tokens: int, cache_n: int | None) -> PageCheck | None:
    """The check on the request that followed a restore: it reused less than half of what was restored
    (a page from another KV layout, or a conversation edited since): the page is not worth keeping."""
    if cache_n is None or restored_tokens < MIN_TOKENS:
        return None
    return PageCheck.LOW_CACHE if cache_n < restored_tokens // 2 else None


AUTO_FLOOR = 8192 << 20  # the automatic page budget never goes below this (the fixed default it replaced)


def auto_budget(slots: int | None, n_ctx: int | None, kv_bytes_per_token: float | None,
                free_bytes: int | None) -> int:
    """The page budget when the user set none: room for two full contexts a slot of this model's KV (a page of
    each slot's conversation and one of a session waiting to come back), so that long conversations' pages are
    not pushed out before they are read; at least `AUTO_FLOOR`, at most half the save dir's free space (never
    below the floor: the floor is what the budget was before). Unknown sizes: the floor."""
    if not slots or not n_ctx or not kv_bytes_per_token or kv_bytes_per_token <= 0:
        return AUTO_FLOOR
    wanted = int(2 * slots * n_ctx * kv_bytes_per_token)
    if free_bytes is not None:
        wanted = min(wanted, free_bytes // 2)
    return max(AUTO_FLOOR, wanted)


def over_budget(pages: Mapping[str, PageRecord], max_bytes: int, *, keep: frozenset[str] = frozenset()
                ) -> list[str]:
    """Session keys whose pages to drop, least recently saved first, until the rest fit `max_bytes`.
    Pages in `keep` (just written or about to be restored) are never chosen."""
    total = sum(p.bytes for p in pages.values())
    out: list[str] = []
    for key, rec in sorted(pages.items(), key=lambda kv: (kv[1].saved, kv[0])):
        if total <= max_bytes:
            break
        if key in keep:
            continue
        out.append(key)
        total -= rec.bytes
    return out


def disk_room(files: Mapping[str, PageFile], pages: Mapping[str, PageRecord], max_bytes: int, now: float, *,
              keep_seconds: float, incoming: int = 0, keep: frozenset[str] = frozenset(),
              keep_files: frozenset[str] = frozenset()) -> tuple[list[str], list[str], bool]:
    """What goes so that every page file in the save dir (`files`: ours, other servers' and proxies', orphans,
    replaced pages waiting for their deletion), plus `incoming` bytes about to be saved, fit `max_bytes`: (our
    session keys whose records to drop, files to delete, whether the rest and `incoming` then fit). The least
    recently saved go first (a record's `saved`, else the file's mtime), never our pages of `keep` nor
    `keep_files` (about to be restored). A recorded page whose file is not there counts its recorded bytes; one
    being written (0 tokens) counts in `incoming`. An unrecorded file older than `keep_seconds` goes anyway (its
    session is forgotten everywhere by then)."""
    by_file = {rec.file: key for key, rec in pages.items()}
    total = incoming
    doomed: list[str] = []
    candidates: list[tuple[float, str, str | None, int]] = []  # (last saved, file, our session key, bytes)
    for name, f in files.items():
        key = by_file.get(name)
        if not FILE_RE.match(name):
            continue
        if key is None and now - f.mtime >= keep_seconds:
            doomed.append(name)
            continue
        total += f.size
        if key not in keep and name not in keep_files:
            candidates.append((pages[key].saved if key is not None else f.mtime, name, key, f.size))
    for key, rec in pages.items():
        if rec.file not in files and rec.n_tokens > 0:
            total += rec.bytes
            if key not in keep:
                candidates.append((rec.saved, rec.file, key, rec.bytes))
    drop: list[str] = []
    for _, name, key, size in sorted(candidates):
        if total <= max_bytes:
            break
        if key is not None:
            drop.append(key)
        doomed.append(name)
        total -= size
    return drop, doomed, total <= max_bytes


@dataclass(frozen=True)
class PageFile:
    """A page-looking file in the save dir, as the driver found it (never followed through a symlink)."""

    mtime: float
    size: int
