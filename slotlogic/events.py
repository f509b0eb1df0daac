"""What happened, as typed records: the drivers and the core emit these, `slotlogic.wording` words them.

Rule 1: no prompt text can get into a log line, because no event has a field for it: sessions are 8-hex
        digests, failures are an exception's type name or an HTTP status and the server's error *type*,
        never a message or a body.
Rule 2: nothing decides on an event; they are output only (the log, the JSONL file, the status view).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from slotlogic.affinity import Learn
from slotlogic.checkpoint_machine import Failure, Note, Outcome
from slotlogic.costs import Choice
from slotlogic.ledger import Cause
from slotlogic.model_facts import ModelFacts, ReuseKind
from slotlogic.paging import PageCheck
from slotlogic.reasons import Passed
from slotlogic.scheduler import Pick
from slotlogic.server import CacheMode
from slotlogic.watch import End, State


class Stage(Enum):
    """Where something failed that the proxy worked around (fail open)."""

    REQUEST = "request"
    RESPONSE_HEADERS = "response-headers"
    RESPONSE = "response"
    OBSERVER = "observer"              # the SSE observer inside the stream callable
    STREAM_COPY = "stream-copy"        # the kept copy of a streamed body
    CONVERT = "convert"                # turning a translated request's streamed answer back
    STREAM_STRIP = "stream-strip"      # removing `__verbose` from a pending request's stream (affinity)
    LOG_FILE = "log-file"
    STATE_WRITE = "state-write"        # the coalesced flush of last-use touches
    FINAL_FLUSH = "final-flush"
    BACKGROUND = "background"
    PAGING = "paging"
    CHECKPOINT = "checkpoint"
    CHECKPOINT_INDEX = "checkpoint-index"
    DELETE = "delete"                  # a page or checkpoint file the proxy meant to delete
    WATCH = "watch"                    # the first-token watch or the deadline of one request
    MODEL_CHECK = "model-check"        # reading the model header, the start-up probe


@dataclass(frozen=True)
class Event:
    """Base class: every event names the server it concerns ("" when none)."""

    upstream: str


@dataclass(frozen=True)
class PassedThrough(Event):
    method: str
    path: str
    reason: Passed


@dataclass(frozen=True)
class Failed(Event):
    stage: Stage
    kind: str                      # the exception's type name, or "HTTP 400 <error type>"
    method: str = ""
    path: str = ""
    slot: int | None = None


@dataclass(frozen=True)
class ServerRestarted(Event):
    pass


@dataclass(frozen=True)
class PoolResized(Event):
    total_slots: int


@dataclass(frozen=True)
class Unreachable(Event):
    """`/props` did not answer: the session is pinned by the hash fallback, or (no count known) not at all."""

    session: str
    slot: int | None = None
    total_slots: int | None = None


@dataclass(frozen=True)
class NoSlotsEndpoint(Event):
    pass


@dataclass(frozen=True)
class NoPrefixMarker(Event):
    session: str
    markers: tuple[str, ...]


@dataclass(frozen=True)
class NoSavePath(Event):
    """llama-server answered 501 to a slot save/restore: it runs without --slot-save-path."""

    paging: bool  # noticed while paging (else while checkpointing)


@dataclass(frozen=True)
class PageFailed(Event):
    slot: int
    direction: str                 # "out" or "in"
    failure: Failure


@dataclass(frozen=True)
class PageGone(Event):
    file: str


@dataclass(frozen=True)
class RestoreJudged(Event):
    """The request after a restore showed whether it took (the JSONL log only)."""

    slot: int
    kind: str
    restored: int
    cached: int
    took: bool


@dataclass(frozen=True)
class RestoresBroken(Event):
    """Restores on this server answer but do not take (`slotlogic.restore_health`): the restores that showed it
    (kind, tokens restored, tokens the next request found cached) and what the model check knows of the model
    (None: not known), which says the fix."""

    kinds: tuple[str, ...]
    restored: tuple[int, ...]
    cached: tuple[int, ...]
    reuse: ReuseKind | None
    swa_full: bool


@dataclass(frozen=True)
class PageRejected(Event):
    """A page failed the check after its restore (or on the request after it) and was dropped."""

    slot: int
    check: PageCheck


@dataclass(frozen=True)
class SlotShared(Event):
    """This process's session shares its slot with an earlier session of another process while a slot is
    free: its next request is placed again (`slotlogic.reconcile`)."""

    session: str
    slot: int


@dataclass(frozen=True)
class SlotsSlow(Event):
    """`/slots` (or `/props`) did not answer in time: new sessions decide without asking it for a while."""

    endpoint: str
    seconds: float


@dataclass(frozen=True)
class PagingLockTimeout(Event):
    slot: int
    seconds: float


@dataclass(frozen=True)
class Paged(Event):
    """One paging step on a slot (the JSONL log's `page` record)."""

    slot: int
    out: str | None                # 8-hex session paged out
    out_tokens: int | None
    into: str | None               # 8-hex session paged in (a seed's source)
    in_tokens: int | None
    seconds: float
    server_ms: float
    seed: bool = False             # the page restored is another session's: the start of a new one's


@dataclass(frozen=True)
class SourceAwaited(Event):
    """A new session waited for the slot it would start from to finish its request (`paging.source_wait`)."""

    slot: int       # the new session's slot
    source: int     # the slot it waited for
    seconds: float
    idle: bool      # the source's slot went idle in time (its conversation is copied)
    server: str | None = None  # that slot's server, when another of the pool (`slotkeeper.drivers.pool_seeds`)


@dataclass(frozen=True)
class FreedFirst(Event):
    """A placement waiting for its slot is placed again because another slot freed first
    (`SlotWaits.freed`): the JSON-lines log's record of it (the request's own line shows where it ran)."""

    session: str    # a short digest
    slot: int | None  # the slot that freed (None: not known any more)
    waited: float     # seconds since the request arrived


@dataclass(frozen=True)
class Scheduled(Event):
    """A request held behind our own work on its slot was decided (`slotlogic.scheduler`): the action chosen,
    its expected seconds, the runner-up's, and what the filters removed."""

    session: str    # a short digest
    slot: int       # the slot it was held on
    pick: Pick
    waited: float   # seconds since the request arrived


@dataclass(frozen=True)
class HandedOver(Event):
    """A slot changed hands between two proxies sharing the state (`slotlogic.handover`): as the taker, how long
    its placement waited for the giver's answer (`answered`: it came; else it moved in without); as the giver,
    the session of ours the taker pages out (`session`, a short digest, or None: nothing of ours there)."""

    slot: int
    seconds: float
    answered: bool
    giver: bool           # this proxy gave the slot away (else it took it)
    session: str | None = None


@dataclass(frozen=True)
class CheckpointStep(Event):
    note: Note


@dataclass(frozen=True)
class CheckpointStarted(Event):
    fingerprint: str
    slot: int


@dataclass(frozen=True)
class CheckpointWaiting(Event):
    file: str


@dataclass(frozen=True)
class CheckpointForeign(Event):
    """A checkpoint file exists but another server configuration wrote it."""

    file: str
    differ: tuple[str, ...]


@dataclass(frozen=True)
class CheckpointDone(Event):
    """One prefix preparation (the JSONL log's `checkpoint` record)."""

    slot: int
    outcome: Outcome
    prompt_n: int
    identical: tuple[int, int] | None
    divergent: tuple[int, int] | None
    seconds: float


@dataclass(frozen=True)
class CheckpointIndexCorrupt(Event):
    path: str


@dataclass(frozen=True)
class FilesDeleted(Event):
    what: str                      # "prefix-cache cleanup"
    files: tuple[str, ...]


@dataclass(frozen=True)
class CorruptMovedAside(Event):
    path: str
    moved_to: str


@dataclass(frozen=True)
class ContextOverflow(Event):
    n_prompt_tokens: int | None
    n_ctx: int | None


@dataclass(frozen=True)
class IdleSlotsCleared(Event):
    """The server empties idle slots (unified KV + --cache-idle-slots), which defeats pinning."""

    slot: int


@dataclass(frozen=True)
class WebUi(Event):
    """mitmweb's user interface is at `url`; `moved_from`: the port it was set to, the proxy's own, which it
    would have failed to listen on."""

    url: str
    moved_from: int | None = None


@dataclass(frozen=True)
class PagingOff(Event):
    """No slot save directory: a conversation evicted from its slot is prefilled again when it returns."""


@dataclass(frozen=True)
class CacheModeFound(Event):
    """What the server does with idle slots (`slotlogic.server.CacheMode`), and so whether the proxy places
    requests or passes them through; `seen`: "probe" (before the first request) or "loss" (a slot emptied)."""

    mode: CacheMode
    seen: str = "probe"


@dataclass(frozen=True)
class MessagesProbed(Event):
    """Whether the server honours id_slot on /v1/messages (then Anthropic requests go natively)."""

    honoured: bool


@dataclass(frozen=True)
class SlotLearned(Event):
    """Affinity: llama-server chose this slot for a session's pending request; the session is pinned to it."""

    session: str
    slot: int
    how: Learn                     # where the slot was read


@dataclass(frozen=True)
class Waiting(Event):
    """A request still waiting for its first byte, and what `/slots` says about it (`slotlogic.watch`)."""

    path: str
    session: str
    state: State
    waited: float
    slot: int | None = None
    processed: int | None = None
    total: int | None = None
    decoded: int | None = None
    idle_for: float | None = None


@dataclass(frozen=True)
class RequestEnded(Event):
    """The proxy ended a request: no first byte while every slot stayed idle, or its deadline."""

    path: str
    session: str
    end: End
    seconds: float
    limit: float                   # the option's value, in seconds
    streaming: bool                # its stream had started: the client got an error event, then the close
    closed: bool                   # False: it could not be ended (it goes on)


@dataclass(frozen=True)
class ModelHeader(Event):
    """The loaded model's GGUF header was read, or could not be (`slotkeeper.drivers.gguf_io`)."""

    status: str                    # gguf_io.ReadStatus value
    keys: int
    seconds: float
    peak_rss: int                  # bytes the process's peak RSS grew while reading
    detail: str                    # an exception's type name, never content


@dataclass(frozen=True)
class ModelDescribed(Event):
    """What the model means for prefix reuse and slot files (`slotlogic.model_facts.describe` words it)."""

    facts: ModelFacts
    cache_type_k: str
    cache_type_v: str
    n_ctx: int | None
    swa_full: bool
    checkpoints_in_files: bool | None
    files_wanted: bool
    page_budget_bytes: int = 0     # session pages' budget (0: paging off)
    slots: int = 0                 # the server's slots


@dataclass(frozen=True)
class Probed(Event):
    """The start-up probe (`slotlogic.capability`): its slot (None: no empty idle slot, skipped), the speeds it
    measured and whether its saved file carried checkpoints (None: not saved)."""

    slot: int | None
    prefill_tok_s: float | None
    decode_tok_s: float | None
    prompt_n: int | None
    predicted_n: int | None
    checkpoints_in_files: bool | None


@dataclass(frozen=True)
class SpeedsMeasured(Event):
    """The first slot save or restore throughput measured on a server (`slotlogic.costs.Speeds`): from then on
    each page and prefix move is weighed by its cost."""

    direction: str                      # "save" | "restore"
    bytes_per_s: float
    kv_bytes_per_token: float | None
    prefill_tok_s: float | None


@dataclass(frozen=True)
class KvCacheLearned(Event):
    """A save's size showed the server's KV cache types (`slotlogic.kv_types`): pages and checkpoints are
    recorded with them, and ones saved under other types are not restored."""

    kv_cache: str        # "K/V" as found
    configured: str      # what `slots_cache_type` says


@dataclass(frozen=True)
class CostWeighed(Event):
    """A slot move weighed by its cost (`slotlogic.costs.Choice`): what it would take and what prefilling the
    same tokens would, and whether it was made."""

    slot: int
    session: str | None                 # 8-hex session the move concerns
    choice: Choice


# ------------------------------------------------------------------------------------------- scale-out


@dataclass(frozen=True)
class ServerDown(Event):
    """A server of `slots_upstreams` refused a connection, failed `/health` or timed out."""

    cause: str                     # "refused", "health", "timeout"


@dataclass(frozen=True)
class ServerUp(Event):
    """A down server answered `/health` again."""

    seconds_down: float


@dataclass(frozen=True)
class RetriedElsewhere(Event):
    """A request that could not reach its server went to another one before it had started."""

    to: str


@dataclass(frozen=True)
class ModelUnloaded(Event):
    """llama-swap unloaded this model: its slots are empty, as after a restart."""


@dataclass(frozen=True)
class SwapPagedOut(Event):
    """A request was about to make the swapper unload this model: its conversations were paged out first (the
    JSONL log's `swap-out` record)."""

    loading: str                   # the model loaded in its place
    saved: int                     # conversations paged out
    lost: int                      # conversations not paged out (the hold ran out, a save failed, no save dir)
    tokens: int
    seconds: float
    why_lost: str = ""


@dataclass(frozen=True)
class StoreUnavailable(Event):
    """The shared store (Redis/Valkey) cannot be reached: decisions stay local until it is back."""

    store: str                     # the URL without credentials
    kind: str                      # the exception's type name


@dataclass(frozen=True)
class StoreBack(Event):
    store: str


@dataclass(frozen=True)
class ApiKeyNotBorrowed(Event):
    """A client sent an API key to a server while `slots_api_key` is unset: the proxy's own calls to it go
    without one (a client's key serves that client's requests only)."""


@dataclass(frozen=True)
class StoreValueRefused(Event):
    """A value in the shared store is not one a proxy wrote (too large, not a string, not JSON; or one this
    proxy would write is too large to share): this proxy decides from its last good copy of the state, and
    its next write replaces the value."""

    store: str                     # the URL without credentials
    why: str                       # what is wrong, in a few words (sizes only: never the value)


@dataclass(frozen=True)
class StoreLockBusy(Event):
    """The server's state lock stayed held past the wait (another proxy stuck, or a key squatted): this
    transaction ran on this proxy's last copy and wrote nothing; the store is reachable."""

    store: str
    seconds: float


class Via(Enum):
    """How a proxy learned that another proxy's session took one of its sessions' slots."""

    NOTICE = "notice"   # the claimant's notice, pushed through the store (slotlogic/notices.py)
    FLUSH = "flush"     # the store's newest claim, read by the background flush


@dataclass(frozen=True)
class DisplacedElsewhere(Event):
    """Another proxy's session took the slot of one of this proxy's sessions: its next request is placed
    again (JSONL only: one record per displacement, for the scale analysis)."""

    slot: int
    session: str                   # 8-hex
    by: str                        # 8-hex: the other proxy's session
    via: Via


@dataclass(frozen=True)
class NoticesLost(Event):
    """The claim-notice subscription to the shared store is lost: displacement is learned at the flush."""

    store: str
    kind: str


@dataclass(frozen=True)
class NoticesBack(Event):
    store: str


@dataclass(frozen=True)
class TokensLost(Event):
    """An answer found fewer tokens in its slot than its session's conversation had (`slotlogic.ledger`)."""

    session: str                   # 8-hex digest
    slot: int | None
    tokens: int
    cause: Cause
    expected: bool
    client: str = ""               # the client kind (`slotlogic.board.client_kind`)


STALE_MOVES = ("page", "prefix", "pin")  # the moves a `StalePlan` names


@dataclass(frozen=True)
class StalePlan(Event):
    """A slot move planned against an epoch the slot no longer has: dropped, planned again."""

    slot: int
    move: str                      # "page" | "prefix" | "pin"
    session: str
    planned: int                   # the epoch it was planned against
    now: int                       # the slot's epoch when it was to start
