"""What llama-server says about itself: `/props` and `/slots`, parsed in this one place.

Rule 1: tolerant. A field that is missing or of the wrong type is None; a `/props` answer without a usable
        `total_slots` is no answer at all (`ServerInfo.parse` returns None), because nothing can be pinned
        without it.
Rule 2: only what slot keeping needs is kept, and the parts recorded with a new session's decision
        (`facts`) are exactly what an offline replay needs to reach the same decision.

Facts used (docs/llama-server.md): `media_marker` is new in every server process, so a changed value means
a restart (every slot is empty); `total_slots` is the slot count (`id_slot` must stay below it);
`default_generation_settings.n_ctx` is the per-slot context; `build_info`, `model_path` and what the server
reports of the model's content (`CONTENT_FACTS`: its quantization, chat template, special tokens) name what wrote
a slot file.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from slotlogic import numbers

PROPS_FACTS = ("total_slots", "media_marker", "build_info", "model_path", "default_generation_settings",
               "model_content")
# What `/props` reports about the model file's content, read from its header by the server: a model replaced at
# the same path (another quantization, size or family) changes some of them. The file itself may be on another
# machine, where the proxy cannot look at its size or time.
CONTENT_FACTS = ("model_ftype", "chat_template", "chat_template_caps", "bos_token", "eos_token", "modalities")
DEFAULT_KV = "f16/f16"  # llama-server's default -ctk/-ctv
SLOT_FACTS = ("id", "n_ctx", "is_processing", "n_prompt_tokens")
# The `/slots` counts slot choice reads: one out of range (or not a count) is dropped, as if not said.
SLOT_COUNTS = ("n_ctx", "n_prompt_tokens", "n_prompt_tokens_processed", "n_prompt_tokens_cache")


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


@dataclass(frozen=True)
class ServerInfo:
    total_slots: int
    media_marker: str | None = None
    n_ctx: int | None = None          # per slot
    build_info: str | None = None
    model_path: str | None = None
    raw: Mapping[str, Any] | None = None  # the `/props` keys in PROPS_FACTS, for the recorded facts
    model_size: int | None = None     # the model file as this machine sees it (the driver stats it)
    model_mtime: float | None = None
    kv_cache: str | None = None       # the KV cache types "K/V" (`slotlogic.kv_types`): not in /props, the driver's
    model_content: str | None = None  # a digest of what `/props` says of the model's content (CONTENT_FACTS)

    @classmethod
    def parse(cls, props: Any) -> ServerInfo | None:
        if not isinstance(props, Mapping):
            return None
        total = numbers.slots(props.get("total_slots"))  # capped: a count past any server's sizes nothing
        if total is None:
            return None
        dgs = props.get("default_generation_settings")
        content = model_content(props)
        raw = {k: props[k] for k in PROPS_FACTS if k in props}
        if content is not None:
            raw["model_content"] = content  # recorded with a decision: a replay reaches the same identity
        return cls(total_slots=total, media_marker=_str(props.get("media_marker")),
                   n_ctx=numbers.count(dgs.get("n_ctx"), numbers.MAX_CTX) if isinstance(dgs, Mapping) else None,
                   build_info=_str(props.get("build_info")), model_path=_str(props.get("model_path")),
                   raw=raw, model_content=content)

    def page_identity(self, server_id: str = "") -> str:
        """What a session page must match to be restored: the checkpoint sidecar's facts plus the model file's
        size and mtime, the operator's `slots_server_id` and the KV cache types (`kv_cache`: configured, or read
        off a save's size). Flash attention is not reported over HTTP; a page written under another setting
        fails the restore or the check after it (docs/reliability.md)."""
        parts: tuple[object, ...] = (self.model_path, self.model_size, self.model_mtime, self.build_info, self.n_ctx,
                                     self.total_slots, server_id)
        if self.kv_cache not in (None, DEFAULT_KV):  # the default leaves older pages' identity as it was
            parts += (self.kv_cache,)
        if self.model_content is not None:  # a server that reports none leaves older pages' identity as it was
            parts += (self.model_content,)
        return "p1:" + hashlib.sha256(repr(parts).encode("utf-8", "surrogatepass")).hexdigest()[:16]

    @property
    def identity(self) -> dict[str, Any]:
        """What a slot file's sidecar records and a restore must match."""
        out: dict[str, Any] = {"build_info": self.build_info, "model_path": self.model_path,
                               "total_slots": self.total_slots, "n_ctx": self.n_ctx}
        if self.kv_cache not in (None, DEFAULT_KV):
            out["kv_cache"] = self.kv_cache
        if self.model_content is not None:
            out["model_content"] = self.model_content
        return out


def model_content(props: Mapping[str, Any]) -> str | None:
    """A digest of CONTENT_FACTS in `/props` (None when it reports none of them): with the path, the build and the
    file's size and time where this machine can see it, what tells a replaced model from the one a page was
    written by. A digest recorded before (a replayed decision) stands for itself."""
    facts = {k: props[k] for k in CONTENT_FACTS if k in props}
    if not facts:
        recorded = props.get("model_content")
        return recorded if isinstance(recorded, str) and len(recorded) <= 64 else None
    wire = json.dumps(facts, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha256(wire.encode("utf-8", "surrogatepass")).hexdigest()[:16]


class CacheMode(Enum):
    """What the server does with an idle slot's KV cache when another task starts (docs/llama-server.md).

    Neither `/props` nor `/slots` says it: llama-server started without `-np` picks 4 slots and unified KV, and
    with `--cache-idle-slots` (on by default) it saves every idle slot to its RAM prompt cache and clears it
    whenever a task starts. Pinning a session to a slot then keeps nothing (the slot is empty at its next turn,
    and a request pinned to an empty slot never looks in the RAM cache), and every page-in or prefix restore is
    cleared before it is used. The server's own choice (prompt similarity, then its RAM cache) does better."""

    KEEPS = "keeps"          # an idle slot keeps its conversation: pinning, paging and prefix restores work
    IDLE_CLEARED = "idle-cleared"  # idle slots are moved to the RAM cache when any task starts: pass through


DEFAULT_SLOTS = 4  # llama-server's slot count when started without `-np` (docs/llama-server.md)


def may_clear_idle_slots(info: ServerInfo) -> bool:
    """Whether the server may be one started without `-np`, whose defaults clear idle slots (4 slots on one
    unified KV cache, `--cache-idle-slots` on): requests wait for its cache mode at start. A server with another
    slot count was given `-np`, and then clears idle slots only if `-kvu` was given too: its mode is probed all
    the same, but no request waits for it."""
    return info.total_slots == DEFAULT_SLOTS


def cache_probe_slots(live: Sequence[Mapping[str, Any]], writable: Collection[int] | None = None
                      ) -> tuple[int, int, bool] | None:
    """The slots of the cache-mode probe: (`witness`, `trigger`, `fill`). The witness is an idle slot holding
    tokens, else an idle empty one that gets a one-token request first (`fill`); the trigger an idle, empty other
    slot, which gets a one-token request; then the witness is looked at (`cache_mode_seen`). Only empty slots
    are written, so the probe never overwrites a conversation whatever the mode; `writable`: the empty slots it
    may write (none of ours, claimed or on its way; None: any). The highest ids are written, as llama-server's
    own LRU tie-break fills them first, leaving the low ones to the placements. None: no such pair."""
    idle = [e for e in live if isinstance(e.get("id"), int) and not isinstance(e.get("id"), bool)
            and e.get("is_processing") is False]
    held = [e["id"] for e in idle if e.get("n_prompt_tokens")]
    empty = sorted((e["id"] for e in idle if not e.get("n_prompt_tokens")
                    and (writable is None or e["id"] in writable)), reverse=True)
    if held and empty:
        return held[0], empty[0], False
    return (empty[1], empty[0], True) if len(empty) >= 2 else None


def cache_mode_seen(witness: int, before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]]
                    ) -> CacheMode | None:
    """What the witness slot shows after a task started on another slot: `before` is `/slots` right after the
    witness's own request, `after` right after the trigger's. Emptied: idle clearing; still holding its tokens:
    slots keep. None (unknown, ask again later): the witness ran something else in between, or is busy."""
    was = next((e for e in before if e.get("id") == witness), None)
    now = next((e for e in after if e.get("id") == witness), None)
    if was is None or now is None or not was.get("n_prompt_tokens") or now.get("is_processing") is not False:
        return None
    if now.get("id_task") != was.get("id_task"):
        return None
    return CacheMode.IDLE_CLEARED if not now.get("n_prompt_tokens") else CacheMode.KEEPS


def slot_facts(live: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The `/slots` fields slot choice reads, as recorded with a decision."""
    if live is None:
        return None
    return [{k: e.get(k) for k in SLOT_FACTS if k in e} for e in live]


def parse_slots(data: Any) -> list[dict[str, Any]] | None:
    """A `/slots` answer as a list of per-slot objects; None for anything else (disabled, an error). Only
    entries with a slot id the proxy tracks (`numbers.slot_id`), at most one per id, and their counts in range
    (`SLOT_COUNTS`; one out of range is left out, as if not said)."""
    if not isinstance(data, list) or not all(isinstance(x, dict) for x in data):
        return None
    out: list[dict[str, Any]] = []
    seen: set[int] = set()
    for e in data:
        sid = numbers.slot_id(e.get("id"))
        if sid is None or sid in seen:
            continue
        seen.add(sid)
        bad = [k for k in SLOT_COUNTS if k in e and e[k] is not None and numbers.count(e[k]) is None]
        out.append({k: v for k, v in e.items() if k not in bad} if bad else e)
        if len(out) >= numbers.MAX_SLOTS:
            break
    return out


def slot_that_ran(before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]]) -> int | None:
    """The one slot whose last task changed between two `/slots` answers (which slot ran a request sent in
    between); None when none or several did (other traffic: no conclusion)."""
    was = {e.get("id"): e.get("id_task") for e in before}
    changed = [e.get("id") for e in after if e.get("id_task") is not None and e.get("id_task") != was.get(e.get("id"))]
    return changed[0] if len(changed) == 1 and isinstance(changed[0], int) else None


def probe_slot(live: Sequence[Mapping[str, Any]]) -> int | None:
    """The slot to probe `/v1/messages` pinning with: slot 0, and only while every slot is idle and empty (a
    fresh or restarted server). Then an ignored `id_slot` shows (the server's LRU choice among empty slots is
    the highest id) and no session's cache can be hit: similarity selection skips empty slots. None: not now."""
    ids = [e.get("id") for e in live]
    if len(live) < 2 or 0 not in ids or any(e.get("is_processing") or e.get("n_prompt_tokens") for e in live):
        return None
    return 0


def ended_on(live: Sequence[dict[str, Any]], slot: int) -> list[dict[str, Any]]:
    """`/slots` with `slot` idle: the request that ran there has ended (its answer came, or its client left), and
    the server frees the slot at its next step, which `/slots` read a moment earlier may not show yet."""
    return [{**e, "is_processing": False} if isinstance(e, dict) and e.get("id") == slot else e for e in live]


def running(live: Sequence[object], slot: int) -> bool:
    """`/slots` says `slot` runs a request now: a slot action sent there would wait in the server's queue."""
    return any(isinstance(e, Mapping) and e.get("id") == slot and e.get("is_processing") is True for e in live)


def work_left(entry: Mapping[str, Any] | None, decode_cost: float | None) -> float | None:
    """A busy slot's work still to do, in prefill tokens, from its `/slots` entry: the prompt tokens it has yet
    to evaluate, or once it generates, its `n_remain` tokens at `decode_cost` prefill tokens each (prefill
    speed / decode speed). None: not busy, not said (`n_remain` -1 is "no limit"), or no speed measured.
    The prompt tokens left are `n_prompt_tokens` less those reused from the slot's cache
    (`n_prompt_tokens_cache`, when reported) and those evaluated so far (`n_prompt_tokens_processed`, which
    moves per batch: a prompt shorter than one shows all of its new tokens left)."""
    if not isinstance(entry, Mapping) or entry.get("is_processing") is not True:
        return None
    nt = entry.get("next_token")
    first = nt[0] if isinstance(nt, list) and nt and isinstance(nt[0], Mapping) else nt
    decoded = first.get("n_decoded") if isinstance(first, Mapping) else None
    if decoded:
        remain = numbers.count(first.get("n_remain")) if isinstance(first, Mapping) else None
        if decode_cost is None or remain is None:
            return None
        return remain * decode_cost
    total, done = numbers.count(entry.get("n_prompt_tokens")), numbers.count(entry.get("n_prompt_tokens_processed"))
    if total is None or done is None or total < done:
        return None
    reused = numbers.count(entry.get("n_prompt_tokens_cache")) or 0
    return float(max(0, total - done - reused))
