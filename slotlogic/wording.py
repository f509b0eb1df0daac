"""Every line slotkeeper prints, made from typed records in this one place.

Rule 1: output only. Nothing reads these strings back; rewording a line changes what a user reads, never
        what the proxy does.
Rule 2: only what the records hold can be printed, and they hold no prompt text (see `slotlogic.events`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Any

from slotlogic import events as ev
from slotlogic.affinity import Learn
from slotlogic.checkpoint_machine import Failure, Note, NoteKind
from slotlogic.decisions import Report
from slotlogic.model_facts import (
    DEFAULT_CHECKPOINT_MIN_STEP,
    DEFAULT_CTX_CHECKPOINTS,
    ModelFacts,
    ReuseKind,
)
from slotlogic.scheduler import Candidate
from slotlogic.server import CacheMode
from slotlogic.stats import SessionStats
from slotlogic.watch import End, State

PREFIX = "slotkeeper: "
MARKERS = {"hit": ":zap:", "partial": ":large_orange_diamond:", "miss": ":snail:", "error": ":x:",
           "unknown": ":warning:"}


class Level(Enum):
    INFO = "info"
    WARNING = "warning"


def fmt(v: object) -> str:
    return "-" if v is None else str(v)


# C0 and C1 controls, DEL, line and paragraph separators, bidi overrides and isolates: what could move the
# cursor, erase or fake a line, or reorder what a terminal shows (a request path is the client's own text).
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` with every control character shown as an escape (`\\x1b`, `\\u202e`): one line stays one line."""
    return _UNPRINTABLE.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", text)


# ------------------------------------------------------------------------------------------- one request


def request_line(r: Report) -> str:
    """The one line per request: `session=… slot=… why=… cache_n=… prompt_n=… reuse=…`."""
    t, obs = r.ticket, r.obs
    reuse = f"{100 * obs.reuse:.0f}%" if obs.reuse is not None else "?"
    line = (f"{PREFIX}{r.path} session={t.session.short} ({t.session.source}) slot={fmt(r.slot)} "
            f"why={t.reason} cache_n={fmt(obs.cache_n)} prompt_n={fmt(obs.prompt_n)} reuse={reuse} "
            f"{r.seconds:.2f}s")
    if obs.error_type:
        line += f" error={obs.error_type}"
    return printable(line)


def comment(r: Report) -> str:
    """The flow's comment in mitmweb."""
    obs = r.obs
    reuse = f"{100 * obs.reuse:.0f}%" if obs.reuse is not None else "?"
    return printable(f"s={r.ticket.session.short} slot={fmt(r.slot)} {r.ticket.reason} | cache {fmt(obs.cache_n)}"
                     f"/{fmt((obs.cache_n or 0) + (obs.prompt_n or 0))} {reuse}")


def marker(r: Report) -> str:
    return MARKERS[r.obs.outcome]


def request_record(r: Report) -> dict[str, Any]:
    """The JSONL log's `request` record."""
    t = r.ticket
    out = {"kind": "request", "path": r.path, "upstream": r.upstream, "session": t.session.key,
           "source": t.session.source, "slot": r.slot, "reason": t.reason, "cache_n": r.obs.cache_n,
           "prompt_n": r.obs.prompt_n, "error": r.obs.error_type, "seconds": round(r.seconds, 4)}
    if r.loss is not None and r.settled:  # an unsettled loss has its own `lost` record once its cause is known
        out["loss"] = {"tokens": r.loss.tokens, "cause": r.loss.cause.value, "expected": r.loss.expected}
    return out


def summary(upstream: str, stats: dict[str, SessionStats]) -> list[str]:
    if not stats:
        return []
    lines = [f"{PREFIX}sessions on {upstream}",
             f"  {'session':8} {'slot':>4} {'reqs':>5} {'prefill':>8} {'cached':>8} {'reuse':>6} {'saved_s':>8} "
             f"{'lost':>6}"]
    for key, s in stats.items():
        reuse = f"{100 * s.reuse:.0f}%" if s.reuse is not None else "?"
        lost = f"{s.lost}" + ("!" if s.lost_unexpected else "")
        lines.append(f"  {key[:8]:8} {fmt(s.slot):>4} {s.requests:>5} {s.prefill:>8} {s.cached:>8} {reuse:>6} "
                     f"{s.saved_s:>8.1f} {lost:>6}")
    lines.append(f"  prefill seconds saved: {sum(s.saved_s for s in stats.values()):.1f} (what prefilling the "
                 "cached tokens would have cost at the server's fitted prefill rate for their depth)")
    lost, unexpected = sum(s.lost for s in stats.values()), sum(s.lost_unexpected for s in stats.values())
    lines.append(f"  tokens lost: {lost} ({unexpected} of unexpected cause, marked !; see the `lost` log lines)")
    return [printable(line) for line in lines]


# ------------------------------------------------------------------------------------------- events


def failure(f: Failure | None) -> str:
    if f is None:
        return "?"
    if f.status == 0:
        return "timeout or unreachable"
    return f"HTTP {f.status}" + (f": {f.error_type}" if f.error_type else "")


def _pair(p: tuple[int, int] | None) -> str:
    return f"{p[0]}/{p[1]}" if p else "?"


def note(n: Note) -> str:
    """One step of the prefix-checkpoint machine."""
    k = n.kind
    ident = f"identical {_pair(n.identical)}"
    if k is NoteKind.HIT:
        return f"cache=HIT (slot {n.slot} already holds this prefix)"
    if k is NoteKind.COLD:
        return f"cache=MISS → warming slot={n.slot} (cold)"
    if k is NoteKind.RESTORED:
        return f"RESTORE {n.filename}: n_restored={n.tokens}"
    if k is NoteKind.BASE_RESTORED:
        return f"RESTORE {n.filename} first (a shorter prefix it starts with): n_restored={n.tokens}"
    if k is NoteKind.NO_FILE:
        return f"no checkpoint (restore {failure(n.failure)}) → cold build"
    if k is NoteKind.VERIFY_DID_NOT_RUN:
        return f"RESTORE verification failed to run ({failure(n.failure)}); keeping the slot as is"
    if k is NoteKind.REJECTED:
        return f"RESTORE rejected: {ident} < {n.gate:.0%} from cache → erase + cold rebuild"
    if k is NoteKind.DIVERGENT_DID_NOT_RUN:
        return f"RESTORE verified: {ident}, divergent probe did not run ({failure(n.failure)})"
    if k is NoteKind.CANNOT_RESUME:
        return (f"RESTORE {ident} but divergent probe 0/{n.divergent[1] if n.divergent else '?'}: the server "
                "cannot resume from this state (SWA/hybrid model without checkpoints? --checkpoint-min-step too "
                "large?); keeping it")
    if k is NoteKind.VERIFIED:
        return f"RESTORE verified: {ident}, divergent probe {_pair(n.divergent)}"
    if k is NoteKind.TRUSTED:
        return f"RESTORE as verified before on this server ({n.tokens} tokens): no verification requests"
    if k is NoteKind.WARM_FAILED:
        return f"warm-up failed ({failure(n.failure)}); request proceeds cold"
    if k is NoteKind.WARMED:
        return f"warm-up done: prompt_n={n.tokens} cache_n={n.cached}"
    if k is NoteKind.SAVED:
        return f"SAVED {n.filename}: n_saved={n.tokens}"
    if k is NoteKind.SAVE_MISMATCH:
        return (f"SAVED {n.filename} held n_saved={n.tokens}, not the {n.cached} tokens the warm-up left (another "
                "request ran on the slot in between): file deleted")
    return f"save failed ({failure(n.failure)}); the slot is warm, nothing persisted"


def _on(upstream: str) -> str:
    return f" on {upstream}" if upstream else ""


_EVENTS: dict[type, Callable[[Any], tuple[Level, str]]] = {
    ev.PassedThrough: lambda e: (Level.INFO, f"{e.method} {e.path} passed through: {e.reason.value}"),
    ev.Failed: lambda e: (Level.WARNING, _failed(e)),
    ev.ServerRestarted: lambda e: (Level.WARNING, f"{e.upstream} restarted (new media_marker): every slot is "
                                                  "empty; sessions keep their slots and prefill once"),
    ev.PoolResized: lambda e: (Level.WARNING, f"{e.upstream} slot pool resized to {e.total_slots} slots: "
                                              "re-pinning every session into range"),
    ev.Unreachable: lambda e: (Level.WARNING, _unreachable(e)),
    ev.NoSlotsEndpoint: lambda e: (Level.WARNING, f"{e.upstream} /slots unavailable (started with --no-slots?): "
                                                  "choosing slots from the state file alone, without cached-token "
                                                  "counts"),
    ev.NoPrefixMarker: lambda e: (Level.INFO, f"prefix-cache: no stable-prefix marker in the system prompt of "
                                              f"session {e.session} (markers: "
                                              f"{', '.join(repr(m) for m in e.markers)}): its stable prefix is "
                                              "learned from the next sessions' system prompts"),
    ev.NoSavePath: lambda e: (Level.WARNING, _no_save_path(e)),
    ev.PageFailed: lambda e: (Level.WARNING, f"page-{e.direction} on slot {e.slot} failed ({failure(e.failure)}); "
                                             "that session will prefill"),
    ev.PageGone: lambda e: (Level.INFO, f"page {e.file} is gone from the save dir; the session prefills"),
    ev.RestoresBroken: lambda e: (Level.WARNING, _restores_broken(e)),
    ev.PageRejected: lambda e: (Level.WARNING, f"page restored into slot {e.slot} dropped: {e.check.value}"),
    ev.SlotShared: lambda e: (Level.INFO, f"session {e.session} shares slot {e.slot} with an earlier session of "
                                          "another proxy while a slot is free: its next request is placed again"),
    ev.SlotsSlow: lambda e: (Level.WARNING, f"{e.upstream} {e.endpoint} did not answer in time: new sessions "
                                            f"are placed with its last answer for {e.seconds:.0f} s"),
    ev.PagingLockTimeout: lambda e: (Level.WARNING, f"paging lock of slot {e.slot} not released within "
                                                    f"{e.seconds:.0f} s; going ahead without paging"),
    ev.SourceAwaited: lambda e: (Level.INFO, f"slot {e.slot} waited {_secs(e.seconds)} for slot {e.source}"
                                             + (f" of {e.server}" if e.server else "") + " to finish its request, "
                                             + ("to start from a copy of its conversation" if e.idle
                                                else "then gave up (prefilling is as quick)")),
    ev.HandedOver: lambda e: (Level.INFO, (
        f"slot {e.slot} handed to another proxy after {_secs(e.seconds)} (it pages out "
        + (f"session {e.session})" if e.session else "nothing of ours)")) if e.giver else (
        f"slot {e.slot} taken from another proxy: its answer came in {_secs(e.seconds)}" if e.answered else
        f"slot {e.slot} taken from another proxy without its answer after {_secs(e.seconds)}")),
    ev.CheckpointStep: lambda e: (Level.INFO, f"prefix-cache {note(e.note)}"),
    ev.CheckpointStarted: lambda e: (Level.INFO, f"prefix-cache fingerprint={e.fingerprint[:16]}… slot={e.slot}"),
    ev.CheckpointWaiting: lambda e: (Level.INFO, f"prefix-cache waiting for the build of {e.file} in progress"),
    ev.CheckpointForeign: lambda e: (Level.INFO, f"prefix-cache {e.file} was saved by another server configuration "
                                                 f"({', '.join(e.differ)} differ); not restored"),
    ev.CheckpointIndexCorrupt: lambda e: (Level.WARNING, f"prefix-cache index {e.path} is corrupt: cleanup "
                                                         "disabled"),
    ev.FilesDeleted: lambda e: (Level.INFO, f"{e.what} deleted {len(e.files)} file(s): {', '.join(e.files)}"),
    ev.CorruptMovedAside: lambda e: (Level.WARNING, f"{e.path} was not valid JSON; moved aside to {e.moved_to}"),
    ev.ContextOverflow: lambda e: (Level.WARNING, f"request of {fmt(e.n_prompt_tokens)} tokens exceeds the "
                                                  f"per-slot context n_ctx={fmt(e.n_ctx)} on {e.upstream}. Without "
                                                  "unified KV each slot gets -c / -np tokens: raise -c, lower -np, "
                                                  "or use --kv-unified-per-slot N."),
    ev.WebUi: lambda e: (Level.INFO, f"mitmweb UI: {e.url}" + (
        f" (web_port {e.moved_from} is the proxy's own port: moved)" if e.moved_from is not None else "")),
    ev.PagingOff: lambda e: (Level.INFO, "no slots_save_dir: a conversation evicted from its slot is prefilled "
                             "again when its session returns. Start llama-server with --slot-save-path DIR and the "
                             "proxy with --set slots_save_dir=DIR to page it out to a file and back in instead "
                             "(milliseconds, where prefilling a long conversation takes seconds), and to keep "
                             "shared prefixes as checkpoints (docs/paging.md)"),
    ev.MessagesProbed: lambda e: (Level.INFO, f"{e.upstream} " + (
        "honours id_slot on /v1/messages: Anthropic requests go natively" if e.honoured else
        "ignores id_slot on /v1/messages: Anthropic requests are sent as chat completions")),
    ev.CacheModeFound: lambda e: _cache_mode(e),
    ev.IdleSlotsCleared: lambda e: (Level.WARNING, f"{e.upstream} empties idle slots (slot {e.slot} was used by a "
                                                   "live session and now holds 0 tokens): the server runs with "
                                                   "unified KV and --cache-idle-slots (the default when -np is not "
                                                   "given), which defeats pinning. Start llama-server with an "
                                                   "explicit -np N (without -kvu) or with --no-cache-idle-slots."),
    ev.SlotLearned: lambda e: (Level.INFO, f"session {e.session} pinned to slot {e.slot}, the slot llama-server "
                                           f"chose for its pending request (affinity; "
                                           f"{_HOW.get(e.how, e.how)})"),
    ev.ModelHeader: lambda e: (Level.INFO if e.status == "ok" else Level.WARNING, _model_header(e)),
    ev.ModelDescribed: lambda e: (Level.INFO, _described(e)),
    ev.Probed: lambda e: (Level.INFO, _probed(e)),
    ev.SpeedsMeasured: lambda e: (Level.INFO, _speeds(e)),
    ev.CostWeighed: lambda e: (Level.INFO, _weighed(e)),
    ev.Scheduled: lambda e: (Level.INFO, _scheduled(e)),
    ev.KvCacheLearned: lambda e: (Level.WARNING, f"{e.upstream} runs with KV cache {e.kv_cache} (a slot save's size "
                                                f"says so), not {e.configured} as slots_cache_type says: pages and "
                                                "checkpoints follow the server; set slots_cache_type to match"),
    ev.Waiting: lambda e: (Level.INFO, f"{e.path} session={e.session} waiting {_secs(e.waited)} for its first "
                                       f"byte: {waiting(e)}"),
    ev.RequestEnded: lambda e: (Level.WARNING, _ended(e)),
    ev.ServerDown: lambda e: (Level.WARNING, f"{e.upstream} is down ({e.cause}): its sessions go to the other "
                                             "servers at their next request; probing it with back-off"),
    ev.ServerUp: lambda e: (Level.WARNING, f"{e.upstream} is up again after {e.seconds_down:.0f} s"),
    ev.RetriedElsewhere: lambda e: (Level.INFO, f"a request that could not reach {e.upstream} went to {e.to} "
                                                "before it had started"),
    ev.ModelUnloaded: lambda e: (Level.INFO, f"{e.upstream} was unloaded by its model swapper: its slots are empty; "
                                             "sessions prefill or page in once when it is loaded again"),
    ev.SwapPagedOut: lambda e: _swap_out(e),
    ev.StoreUnavailable: lambda e: (Level.WARNING, f"shared state {e.store} unreachable ({e.kind}): deciding from "
                                                   "this proxy's memory until it is back"),
    ev.StoreBack: lambda e: (Level.WARNING, f"shared state {e.store} reachable again"),
    ev.ApiKeyNotBorrowed: lambda e: (Level.WARNING, f"clients send an API key to {e.upstream}: the proxy's own calls "
                                                    "(/props, /slots, slot files) carry slots_api_key only, never a "
                                                    "client's; set it if the server asks for a key"),
    ev.StoreValueRefused: lambda e: (Level.WARNING, f"shared state {e.store}: a value no proxy wrote was refused "
                                                    f"({e.why}): deciding from this proxy's last copy"),
    ev.StoreLockBusy: lambda e: (Level.WARNING, f"shared state {e.store}: its lock was held for {e.seconds:.0f} s "
                                                "by another: this step decided from this proxy's last copy"),
    ev.NoticesLost: lambda e: (Level.WARNING, f"claim notices from {e.store} lost ({e.kind}): other proxies' use "
                                              "of our slots is learned at the background flush until they are "
                                              "back"),
    ev.NoticesBack: lambda e: (Level.WARNING, f"claim notices from {e.store} flowing again"),
    ev.TokensLost: lambda e: (Level.INFO if e.expected else Level.WARNING, _lost(e)),
    ev.StalePlan: lambda e: (Level.INFO, f"a {e.move} planned for session {e.session} on slot {e.slot} was dropped: "
                                         f"the slot moved on since (epoch {e.planned} -> {e.now}); planned again"),
}

_CAUSES = {
    "restart": "the server restarted (expected)",
    "model-change": "another model or server configuration (expected)",
    "evicted": "another session took its slot and no page kept it (expected: no save dir or page budget)",
    "prefix-over-owner": "a prefix restore or warm-up was written over it",
    "seed-over-owner": "a seed copy was written over it",
    "stale-page": "it was paged in from a page older than its conversation",
    "other-process": "another proxy's session ran on its slot",
    "unpinned": "a request the server placed itself ran on its slot",
    "side-call": "a side call ran on its slot",
    "idle-clear": "the server emptied its idle slot (unified KV with --cache-idle-slots): pinned before the mode was "
                  "known; requests pass through from now on",
    "unknown": "cause unknown",
}


def _cache_mode(e: ev.CacheModeFound) -> tuple[Level, str]:
    if e.mode is CacheMode.KEEPS:
        return Level.INFO, f"{e.upstream} keeps idle slots' KV cache: sessions are pinned to slots"
    how = {"loss": "a slot emptied after a request", "state": "another proxy of the shared state found it"}.get(
        e.seen, "probed at start")
    return (Level.WARNING, f"{e.upstream} clears idle slots into its RAM prompt cache when a task starts (unified KV "
                           f"with --cache-idle-slots, the default without -np; {how}): requests pass through "
                           "unpinned, with no paging or prefix restores, and the server's RAM cache keeps "
                           "conversations. For pinning, start llama-server with -np N (without -kvu) or "
                           "--no-cache-idle-slots.")


def _lost(e: ev.TokensLost) -> str:
    return (f"session={e.session} lost {e.tokens:,} tokens on slot {fmt(e.slot)}{_on(e.upstream)}: "
            f"{_CAUSES.get(e.cause.value, e.cause.value)}")

_HOW = {Learn.ECHO: "id_slot in the answer", Learn.VERBOSE: "__verbose, stripped from the answer",
        Learn.CLIENT_VERBOSE: "the client's own verbose answer", Learn.SLOTS: "/slots after the answer"}

_STAGES = {
    ev.Stage.REQUEST: "internal error on {method} {path}, forwarded unchanged",
    ev.Stage.RESPONSE_HEADERS: "could not prepare response observation of {path}",
    ev.Stage.RESPONSE: "could not read the response of {path}",
    ev.Stage.OBSERVER: "SSE observer failed; the stream continues unobserved",
    ev.Stage.STREAM_COPY: "could not keep a copy of the stream",
    ev.Stage.CONVERT: "could not convert a translated answer; the client got an error event",
    ev.Stage.STREAM_STRIP: "could not strip __verbose from the stream; the client gets it as the server sent it",
    ev.Stage.LOG_FILE: "cannot write the JSONL log file",
    ev.Stage.STATE_WRITE: "could not write the state file (touches kept for retry)",
    ev.Stage.FINAL_FLUSH: "final state flush failed",
    ev.Stage.BACKGROUND: "background task failed; it restarts on the next request",
    ev.Stage.PAGING: "paging on slot {slot} failed; the request proceeds without it",
    ev.Stage.CHECKPOINT: "prefix-cache failed for slot {slot}; the request proceeds without it",
    ev.Stage.CHECKPOINT_INDEX: "prefix-cache index update failed",
    ev.Stage.DELETE: "could not delete a file in the save dir",
    ev.Stage.WATCH: "the first-token watch of {path} failed; the request goes on unwatched",
    ev.Stage.MODEL_CHECK: "the model check failed; slot files stay as configured",
}


def _failed(e: ev.Failed) -> str:
    what = _STAGES[e.stage].format(method=e.method, path=e.path, slot=fmt(e.slot))
    return f"{what}{_on(e.upstream) if e.stage is not ev.Stage.REQUEST else ''}: {e.kind}"


def _unreachable(e: ev.Unreachable) -> str:
    if e.slot is None:
        return (f"{e.upstream} unreachable (/props) and no slot count known: request for session {e.session} "
                "passes unpinned")
    return (f"{e.upstream} /props unreachable: session {e.session} pinned by hash fallback to slot {e.slot} of "
            f"{e.total_slots} (last known count)")


def _no_save_path(e: ev.NoSavePath) -> str:
    if e.paging:
        return ("llama-server answered 501 to slot save/restore: start it with --slot-save-path equal to "
                "slots_save_dir, or set slots_paging=false")
    return ("llama-server has no --slot-save-path (save/restore answered 501): start it with --slot-save-path DIR "
            "and set slots_save_dir=DIR, or use slots_prefix_cache=memory")


def _restores_broken(e: ev.RestoresBroken) -> str:
    seen = "; ".join(f"{kind} of {n} tokens: {cached} found cached by the next request"
                     for kind, n, cached in zip(e.kinds, e.restored, e.cached, strict=False))
    if e.reuse is ReuseKind.NEEDS_SWA_FULL and not e.swa_full:
        fix = ("start llama-server with --swa-full (and set slots_swa_full), or run a build whose slot files keep "
               "the context checkpoints of sliding-window layers")
    elif e.reuse is ReuseKind.CHECKPOINTS_ONLY:
        fix = "run a llama-server build whose slot files keep the context checkpoints of recurrent layers"
    else:
        fix = ("run a llama-server build whose restored slots are reused; on a sliding-window or hybrid model, "
               "one whose slot files keep the context checkpoints, or start it with --swa-full (and set "
               "slots_swa_full)")
    return (f"{e.upstream} restores answer but do not take ({seen}): paging and prefix restores are off for this "
            f"server until it restarts, its conversations are prefilled instead. Fix: {fix}")


_HEADER_NOT_READ = {
    "no-path": "llama-server did not report model_path",
    "missing": "model file not on this machine (remote llama-server?)",
    "unreadable": "model file not readable here",
    "not-gguf": "model file is not a GGUF the gguf package can read",
}


def _model_header(e: ev.ModelHeader) -> str:
    if e.status == "ok":
        return (f"model header: {e.keys} keys read with gguf.GGUFReader in {e.seconds * 1000:.0f} ms "
                f"(peak RSS +{e.peak_rss / 1e6:.0f} MB; once per model file)")
    reason = _HEADER_NOT_READ.get(e.status, e.status)
    return (f"model header not read on {e.upstream}: {reason}{f' ({e.detail})' if e.detail else ''}; "
            "prefix reuse and slot files as before")


def _described(e: ev.ModelDescribed) -> str:
    """The model's lines (`model_facts.describe`), one log record: the first line carries the prefix."""
    if not isinstance(e.facts, ModelFacts):
        return f"model on {e.upstream}: not described"
    lines = describe(e.facts, cache_type_k=e.cache_type_k, cache_type_v=e.cache_type_v, n_ctx=e.n_ctx,
                     swa_full=e.swa_full, checkpoints_in_files=e.checkpoints_in_files, files_wanted=e.files_wanted)
    if e.page_budget_bytes and e.slots and e.n_ctx and e.facts.restore_helps(e.swa_full, e.checkpoints_in_files):
        try:
            per_token = e.facts.kv_bytes_per_token(e.cache_type_k, e.cache_type_v, e.n_ctx)
        except ValueError:  # a cache type the model table does not know
            per_token = 0.0
        lines += _budget_fit(per_token, e.n_ctx, e.slots, e.page_budget_bytes)
    return ("\n" + PREFIX).join(map(printable, lines))


def _budget_fit(per_token: float, n_ctx: int, slots: int, budget: int) -> list[str]:
    """A page budget that holds less than two full contexts a slot makes pages push each other out before their
    sessions come back: each such save is I/O for nothing. Said once, with the size that would hold them."""
    wanted = 2 * slots * n_ctx * per_token
    if per_token <= 0 or budget >= wanted:
        return []
    return [f"the page budget (slots_page_max_mb {budget >> 20:,}) holds ~{int(budget / per_token):,} tokens "
            f"of this model's KV, less than two full contexts a slot ({slots} × {n_ctx:,}): long conversations' "
            f"pages will push each other out before they are read; slots_page_max_mb={math.ceil(wanted / 2**20)} "
            "keeps them"]


def _speeds(e: ev.SpeedsMeasured) -> str:
    kv = f", KV {fmt(round(e.kv_bytes_per_token))} bytes/token" if e.kv_bytes_per_token else ""
    pre = f", prefill {e.prefill_tok_s:,.0f} tok/s" if e.prefill_tok_s else ""
    return (f"{e.upstream} slot {e.direction} speed {_rate(e.bytes_per_s)}{kv}{pre}: page and prefix moves are "
            "weighed against prefilling from now on")


def _rate(bps: float) -> str:
    return f"{bps / 1e9:.2f} GB/s" if bps >= 1e9 else f"{bps / 1e6:.0f} MB/s"


def _candidate(c: Candidate | None) -> str:
    if c is None:
        return "none"
    where = f" slot {c.slot}" if c.slot is not None else ""
    cost = "unknown" if c.ttft is None else f"~{_est(c.cost)}"
    return f"{c.action.value}{where} {cost}" + (" (given away)" if c.given_away else "")


def _scheduled(e: ev.Scheduled) -> str:
    removed = ", ".join(f"{a.value} by {why}" for a, why in e.pick.removed)
    return (f"session {e.session} held {_secs(e.waited)} on slot {e.slot}: {_candidate(e.pick.chosen)}; runner-up "
            f"{_candidate(e.pick.runner_up)}" + (f"; removed {removed}" if removed else ""))


def _weighed(e: ev.CostWeighed) -> str:
    c = e.choice
    who = f"session {e.session} " if e.session else ""
    mb = f"{c.bytes / 1e6:,.1f} MB" if c.bytes >= 1e5 else f"{c.bytes / 1e3:,.0f} KB"
    size = f"({fmt(c.tokens)} tokens, {mb})"
    move = {"page-in": "restore", "page-out": "save+restore", "live-seed": "copy", "prefix": "restore"}[c.move.value]
    verb = {"page-in": ("paged in", "prefilled instead of paging in"),
            "page-out": ("paged out", "let go instead of paging out"),
            "live-seed": ("seeded from a live slot", "prefilled instead of a live-slot seed"),
            "prefix": ("prefix restored", "prefix warmed up instead of restored")}[c.move.value][0 if c.worth else 1]
    return f"slot {e.slot}: {verb} {who}{size}: {move} ~{_est(c.move_s)} vs prefill ~{_est(c.prefill_s)}"


def _est(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 0.1 else _secs(s)


def _probed(e: ev.Probed) -> str:
    if e.slot is None:
        return (f"start-up probe skipped on {e.upstream}: no empty idle slot (the probe never overwrites a "
                "conversation)")
    parts = []
    if e.prefill_tok_s is not None and e.decode_tok_s is not None:
        parts.append(f"prefill {e.prefill_tok_s:.0f} tok/s ({fmt(e.prompt_n)} tokens), decode "
                     f"{e.decode_tok_s:.0f} tok/s ({fmt(e.predicted_n)} tokens)")
    if e.checkpoints_in_files is not None:
        parts.append("slot files carry context checkpoints" if e.checkpoints_in_files
                     else "slot files carry no context checkpoints")
    return f"start-up probe on slot {e.slot}: " + ("; ".join(parts) or "no answer")


def waiting(e: ev.Waiting) -> str:
    """What a waiting request is doing, in a few words (the log line, the mitmweb comment, the status)."""
    slot = f" on slot {e.slot}" if e.slot is not None else ""
    if e.state is State.QUEUED:
        return f"queued behind slot {fmt(e.slot)}"
    if e.state is State.PREFILLING:
        return f"prefilling ({fmt(e.processed)}/{fmt(e.total)}){slot}"
    if e.state is State.GENERATING:
        return f"generating ({fmt(e.decoded)} tokens){slot}"
    if e.state is State.BUSY:
        return "llama-server busy (/slots did not answer in time: a long prompt is being evaluated)"
    if e.state is State.STALLED:
        idle = f" for {_secs(e.idle_for)}" if e.idle_for else ""
        return f"stalled: every slot idle{idle}"
    if e.state is State.UNKNOWN:
        return "state unknown (/slots unavailable)"
    return str(e.state)


def waiting_comment(e: ev.Waiting) -> str:
    """The flow's comment in mitmweb while it waits (the final comment replaces it)."""
    return printable(f"s={e.session} waiting {_secs(e.waited)}: {waiting(e)}")


def _secs(s: float) -> str:
    return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"


def _limit(end: End, limit: float) -> str:
    if end is End.STALLED:
        return f"no first byte while every slot stayed idle for {limit:.0f} s (slots_first_token_timeout)"
    if end is End.WEDGED:
        return f"its slot's task made no progress for {limit:.0f} s (slots_wedged_timeout)"
    return f"deadline of {limit:.0f} s reached (slots_request_deadline)"


def _ended(e: ev.RequestEnded) -> str:
    if not e.closed:
        done = "could not end it (mitmproxy's connection internals unavailable); it goes on"
    elif e.streaming:
        done = ("sent an error event and closed the connection; llama-server cancels the task when it sees the "
                "upstream connection close")
    else:
        done = "answered 504 and closed the upstream connection, so llama-server cancels the task"
    return f"{e.path} session={e.session} ended after {e.seconds:.0f} s: {_limit(e.end, e.limit)}; {done}"


def client_message(end: End, limit: float) -> str:
    """The 504 answer's message for the client (no prompt text: names and numbers only)."""
    return f"slotkeeper: {_limit(end, limit)}; the request was cancelled"


def client_error_body(end: End, limit: float, *, anthropic: bool = False) -> bytes:
    """The 504 answer's JSON body in the route's own shape: Anthropic's error body on `/v1/messages` (as the
    proxy's other Anthropic errors), llama-server's OpenAI-style error object on every other route."""
    message = client_message(end, limit)
    body: dict[str, Any] = ({"type": "error", "error": {"type": "timeout_error", "message": message}} if anthropic
                            else {"error": {"code": 504, "message": message, "type": "timeout_error"}})
    return json.dumps(body, separators=(",", ":")).encode()


def stream_error_event(end: End, limit: float, *, anthropic: bool = False) -> bytes:
    """The last event of a stream the proxy ends: an error in the route's own format."""
    message = client_message(end, limit)
    if anthropic:
        body = {"type": "error", "error": {"type": "timeout_error", "message": message}}
        return b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"
    body = {"error": {"code": 504, "message": message, "type": "timeout_error"}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def event_line(event: ev.Event) -> tuple[Level, str]:
    level, text = _EVENTS[type(event)](event)
    multi = isinstance(event, ev.ModelDescribed)  # several lines on purpose, each made printable itself
    return level, PREFIX + (text if multi else printable(text))


def _candidate_record(c: Candidate | None) -> dict[str, Any] | None:
    if c is None:
        return None
    return {"action": c.action.value, "slot": c.slot, "seconds": None if c.ttft is None else round(c.cost, 3),
            "ttft": None if c.ttft is None else round(c.ttft, 3), "others": round(c.others, 3),
            "given_away": c.given_away}


def _swap_out(e: ev.SwapPagedOut) -> tuple[Level, str]:
    s = e
    head = f"{e.upstream} is unloaded to load {s.loading}: "
    saved = (f"{s.saved} conversation(s) paged out first ({s.tokens} tokens, {s.seconds:.2f} s); they page back "
             "in when it is loaded again")
    lost = f"{s.lost} conversation(s) not paged out ({s.why_lost}): they prefill from zero when it is loaded again"
    if not s.lost:
        return Level.INFO, head + saved
    return Level.WARNING, head + (f"{saved}; {lost}" if s.saved else lost)


def event_record(event: ev.Event) -> dict[str, Any] | None:
    """The JSONL log's record of an event, for the ones it keeps (paging and checkpoint steps)."""
    if isinstance(event, ev.SwapPagedOut):
        s = event
        return {"kind": "swap-out", "upstream": event.upstream, "loading": s.loading, "saved": s.saved,
                "lost": s.lost, "tokens": s.tokens, "seconds": round(s.seconds, 3), "why_lost": s.why_lost or None}
    if isinstance(event, ev.Paged):
        return {"kind": "page", "upstream": event.upstream, "slot": event.slot, "out": event.out,
                "out_tokens": event.out_tokens, "in": event.into, "in_tokens": event.in_tokens, "seed": event.seed,
                "seconds": round(event.seconds, 4), "server_ms": round(event.server_ms, 2)}
    if isinstance(event, ev.CostWeighed):
        c = event.choice
        return {"kind": "cost", "upstream": event.upstream, "slot": event.slot, "session": event.session,
                "move": c.move.value, "tokens": c.tokens, "bytes": c.bytes, "move_s": round(c.move_s, 4),
                "prefill_s": round(c.prefill_s, 4), "moved": c.worth}
    if isinstance(event, ev.HandedOver):
        return {"kind": "handover", "upstream": event.upstream, "slot": event.slot, "seconds": round(event.seconds, 3),
                "answered": event.answered, "role": "giver" if event.giver else "taker", "session": event.session}
    if isinstance(event, ev.Scheduled):
        return {"kind": "scheduled", "upstream": event.upstream, "session": event.session, "slot": event.slot,
                "waited": round(event.waited, 3), "chosen": _candidate_record(event.pick.chosen),
                "runner_up": _candidate_record(event.pick.runner_up),
                "removed": [{"action": a.value, "filter": why} for a, why in event.pick.removed]}
    if isinstance(event, ev.FreedFirst):
        return {"kind": "freed-first", "upstream": event.upstream, "session": event.session, "slot": event.slot,
                "waited": round(event.waited, 3)}
    if isinstance(event, ev.SourceAwaited):
        return {"kind": "source-wait", "upstream": event.upstream, "slot": event.slot, "source": event.source,
                "seconds": round(event.seconds, 3), "idle": event.idle, "server": event.server}
    if isinstance(event, ev.Waiting):
        return {"kind": "waiting", "upstream": event.upstream, "path": event.path, "session": event.session,
                "state": event.state.value if isinstance(event.state, State) else str(event.state),
                "slot": event.slot, "processed": event.processed, "total": event.total, "decoded": event.decoded,
                "idle_for": None if event.idle_for is None else round(event.idle_for, 1),
                "waited": round(event.waited, 1), "text": waiting(event)}
    if isinstance(event, ev.RequestEnded):
        return {"kind": "ended", "upstream": event.upstream, "path": event.path, "session": event.session,
                "end": event.end.value if isinstance(event.end, End) else str(event.end),
                "seconds": round(event.seconds, 2), "limit": event.limit, "streaming": event.streaming,
                "closed": event.closed}
    if isinstance(event, ev.DisplacedElsewhere):
        return {"kind": "displaced", "upstream": event.upstream, "slot": event.slot, "session": event.session,
                "by": event.by, "via": event.via.value}
    if isinstance(event, ev.TokensLost):
        return {"kind": "lost", "upstream": event.upstream, "slot": event.slot, "session": event.session,
                "tokens": event.tokens, "cause": event.cause.value, "expected": event.expected}
    if isinstance(event, ev.RestoreJudged):
        return {"kind": "restore-judged", "upstream": event.upstream, "slot": event.slot, "move": event.kind,
                "restored": event.restored, "cached": event.cached, "took": event.took}
    if isinstance(event, ev.RestoresBroken):
        return {"kind": "restores-broken", "upstream": event.upstream,
                "moves": list(event.kinds), "restored": list(event.restored), "cached": list(event.cached)}
    if isinstance(event, ev.StalePlan):
        return {"kind": "stale-plan", "upstream": event.upstream, "slot": event.slot, "session": event.session,
                "move": event.move, "planned": event.planned, "now": event.now}
    if isinstance(event, ev.CheckpointDone):
        return {"kind": "checkpoint", "upstream": event.upstream, "slot": event.slot,
                "outcome": event.outcome.value, "prompt_n": event.prompt_n, "identical": event.identical,
                "divergent": event.divergent, "seconds": round(event.seconds, 4)}
    return None


def logged(event: ev.Event) -> bool:
    """Whether an event has a log line (some exist only for the JSONL file)."""
    return type(event) in _EVENTS


def lines(events: Iterable[ev.Event]) -> list[str]:
    return [event_line(e)[1] for e in events if logged(e)]


# ------------------------------------------------------------------------------------------- the model

def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            v = n / scale
            return f"{v:.1f} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{n:.0f} B"


def _dims(facts: ModelFacts) -> str:
    layers = facts._attention_layers()
    kvs = sorted({facts.kv_heads[i] for i in layers})
    heads = str(kvs[0]) if len(kvs) == 1 else f"{kvs[0]}-{kvs[-1]}"
    dims = f"{facts.head_dim_k}+{0 if facts.mla else facts.head_dim_v}"
    if facts.n_swa_layers and (facts.head_dim_k_swa, facts.head_dim_v_swa) != (facts.head_dim_k, facts.head_dim_v):
        dims += f" (SWA {facts.head_dim_k_swa}+{facts.head_dim_v_swa})"
    return f"{heads} KV heads × {dims} dims"


def describe(facts: ModelFacts, *, cache_type_k: str = "f16", cache_type_v: str = "f16", n_ctx: int | None = None,
             swa_full: bool | None = None, checkpoints_in_files: bool | None = None,
             files_wanted: bool = True) -> list[str]:
    """Start-up log lines for the model: shape, cost per token, and what that means for slot files.

    The slot-file cost per 1K tokens is that of a full slot of `n_ctx` tokens (at least 1,000), where SWA
    layers store only their window.

    Only names and numbers (architecture, counts, sizes, flags); never prompt text. `files_wanted`: the
    user configured prefix checkpoints or session pages, so the last line says whether they stay on.
    """
    if not facts.known:
        return ["model: header not understood (no general.architecture): prefix reuse assumed as before"]
    reuse = facts.prefix_reuse()
    if reuse.kind is ReuseKind.NO_MEMORY:
        return [f"model: {facts.architecture}: no KV cache (embedding/encoder/diffusion model): nothing for slot "
                "files to keep"]
    try:
        facts.kv_bytes_per_token(cache_type_k, cache_type_v, n_ctx)
    except ValueError:  # a cache type the model table does not know: sized as f16
        cache_type_k = cache_type_v = "f16"
    lines = [_model_shape(facts, cache_type_k, cache_type_v, n_ctx, swa_full)]
    if reuse.kind is ReuseKind.FULL:
        lines[0] += "; prefixes reusable"
    elif reuse.kind in (ReuseKind.NEEDS_SWA_FULL, ReuseKind.CHECKPOINTS_ONLY):
        lines.append(_reuse_limits(facts, reuse.kind, cache_type_k, cache_type_v, n_ctx, swa_full,
                                   checkpoints_in_files))
    if files_wanted and not facts.restore_helps(swa_full, checkpoints_in_files):
        fix = (" (start llama-server with " + " ".join(reuse.flags_for_restore) +
               " and set slots_swa_full)") if reuse.restore_fixable and reuse.flags_for_restore else ""
        lines.append("checkpoint and page files stay off: a restore could not resume" + fix)
    return lines


def _model_shape(facts: ModelFacts, cache_type_k: str, cache_type_v: str, n_ctx: int | None,
                 swa_full: bool | None) -> str:
    per_token = facts.kv_bytes_per_token(cache_type_k, cache_type_v, n_ctx, swa_full=bool(swa_full))
    per_1k = facts.slot_file_bytes_per_1k_tokens(cache_type_k, cache_type_v, n_tokens=max(1000, n_ctx or 0))
    types = cache_type_k if cache_type_k == cache_type_v else f"K {cache_type_k}, V {cache_type_v}"
    shape = f"model: {facts.architecture}, {facts.block_count} layers"
    if facts.n_recurrent_layers:
        shape += f" ({facts.n_attention_layers} attention, {facts.n_recurrent_layers} recurrent)"
    if facts.n_attention_layers:
        shape += f", {_dims(facts)}: ~{_size(per_token)} KV per token ({types})"
    if facts.n_recurrent_layers:
        shape += f", {_size(facts.recurrent_state_bytes())} recurrent state per sequence"
    shape += f"; a slot file ~{_size(per_1k)} per 1K tokens"
    if not facts.modelled:
        shape += " (layout not fully modelled: rough)"
    return shape


def _reuse_limits(facts: ModelFacts, kind: ReuseKind, cache_type_k: str, cache_type_v: str, n_ctx: int | None,
                  swa_full: bool | None, checkpoints_in_files: bool | None) -> str:
    """Why a prefix is reusable only in part (a window, or recurrent state), and what would change it."""
    persisted = ("; this llama-server writes its checkpoints into slot files, so a restored file resumes from "
                 "the newest one before the divergence") if checkpoints_in_files else ""
    if kind is ReuseKind.NEEDS_SWA_FULL:
        what = "chunked attention" if facts.chunked else "sliding window"
        total = facts.n_attention_layers
        full_cost = facts.kv_bytes_per_token(cache_type_k, cache_type_v, n_ctx, swa_full=True)
        if swa_full:
            return (f"{what} {facts.window} on {facts.n_swa_layers} of {total} layers; llama-server runs with "
                    f"--swa-full (~{_size(full_cost)} KV per token): prefixes reusable, a restored slot file "
                    f"resumes when the conversation diverges within its last {facts.window} tokens")
        if checkpoints_in_files:
            return (f"{what} {facts.window} on {facts.n_swa_layers} of {total} layers: prefixes beyond "
                    f"the window are reusable only from llama-server's context checkpoints{persisted}")
        return (f"{what} {facts.window} on {facts.n_swa_layers} of {total} layers: prefixes beyond "
                "the window are reusable only from llama-server's in-RAM context checkpoints, and a "
                "restored slot file cannot resume, unless llama-server runs with --swa-full "
                f"(then ~{_size(full_cost)} KV per token)")
    return (f"recurrent state in {facts.n_recurrent_layers} of {facts.block_count} layers: a prefix is "
            "reusable only from llama-server's in-RAM context checkpoints (--ctx-checkpoints, default "
            f"{DEFAULT_CTX_CHECKPOINTS}; --checkpoint-min-step, default {DEFAULT_CHECKPOINT_MIN_STEP}); "
            + (persisted[2:] if checkpoints_in_files else
               "upstream slot files carry none, so a restored file cannot resume (llama.cpp #25913, "
               "#27813; PRs #20819, #26004 would fix it)"))
