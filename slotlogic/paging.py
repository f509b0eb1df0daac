"""Session paging: a session's whole conversation leaves its slot as a file and comes back the same way.

Why: 6 agent sessions and their subagents on 4 slots must share slots, and pinning alone can only choose
*whose* conversation is overwritten; the evicted session then prefills its whole conversation again
(seconds to minutes). llama-server can write a slot's KV cache to a file and read it back into any idle
slot (`POST /slots/{id}?action=save|restore`): on SmolLM2, 1,353 tokens took 15 ms to save and 8 ms to
restore, against 8.3 s to prefill. So before a slot is handed to another session, its holder is *paged
out*; when a session comes back to a slot that no longer holds its conversation, it is *paged in*.

Rule 1: pure. `plan` looks at one slot (`SlotView`) and the page index (in the shared state file) and says
        which file to save and which to restore; the driver (`drivers/pager.py`) performs the calls, then
        folds the outcome back with `saved` / `restored`.
Rule 2: never a wrong answer. A restored file only sets what the slot holds: llama-server still compares
        the request's tokens with the restored ones and reuses just the common prefix. A stale or foreign
        file therefore costs prefill, never correctness; only a file from another model or build could
        mislead, so a page is restored only when `model` (model path + build) matches the running server.
Rule 3: bounded. Pages count against `max_bytes`; the least recently saved go first (`over_budget`), and
        pages of sessions the state forgets are deleted with them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass

from slotlogic.ranking import SlotView

FILE_RE = re.compile(r"^page-[0-9a-f]{20}\.bin$")
MIN_TOKENS = 64  # below this a prefill is cheaper than the bookkeeping (and it is mostly a bare prompt)


@dataclass(frozen=True)
class PageRecord:
    """One saved conversation: where it is, how long it is, and which server state it fits."""

    file: str
    n_tokens: int
    saved: float
    bytes: int = 0
    model: str = ""  # model path + build info of the server that wrote it


@dataclass(frozen=True)
class PagePlan:
    """What to do to `slot` before a session's request goes there. Either part may be absent."""

    slot: int
    save_for: str | None = None      # session key whose conversation the slot holds now
    save_file: str | None = None
    restore_for: str | None = None   # session key whose page goes into the slot
    restore_file: str | None = None
    restore_tokens: int = 0

    @property
    def empty(self) -> bool:
        return self.save_file is None and self.restore_file is None


def page_file(upstream: str, session_key: str) -> str:
    """A stable, private file name per (server, session): no session text in it, no collision between two
    servers that share one save directory."""
    return "page-" + hashlib.sha256(f"{upstream}\n{session_key}".encode()).hexdigest()[:20] + ".bin"


def model_id(props: Mapping[str, object]) -> str:
    return f"{props.get('model_path')}|{props.get('build_info')}"


def plan(view: SlotView, session_key: str, pages: Mapping[str, PageRecord], upstream: str, model: str, *,
         min_tokens: int = MIN_TOKENS) -> PagePlan:
    """Page out the slot's holder if it is another session with a conversation worth keeping (a busy slot
    is still computing the holder's request: llama-server defers the save until it is done, so the page
    gets the finished conversation); page in `session_key` unless the slot already holds (at least) what
    its page holds."""
    save_for = save_file = None
    if view.owner not in (None, session_key) and (view.busy or (view.n_tokens or 0) >= min_tokens):
        save_for, save_file = view.owner, page_file(upstream, view.owner)
    rec = pages.get(session_key)
    holds_own = view.owner == session_key and (view.n_tokens or 0) >= (rec.n_tokens if rec else 0)
    if rec is None or rec.model != model or holds_own or rec.n_tokens < min_tokens:
        return PagePlan(view.id, save_for, save_file)
    return PagePlan(view.id, save_for, save_file, session_key, rec.file, rec.n_tokens)


def saved(pages: dict[str, PageRecord], session_key: str, file: str, n_tokens: int, n_bytes: int,
          now: float, model: str) -> None:
    pages[session_key] = PageRecord(file=file, n_tokens=n_tokens, saved=now, bytes=n_bytes, model=model)


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


def orphans(files: Mapping[str, float], pages: Mapping[str, PageRecord], now: float, min_age: float
            ) -> list[str]:
    """Page files (name → mtime) no state refers to and older than `min_age`: left by a lost state file
    or by another proxy's sessions long gone."""
    known = {p.file for p in pages.values()}
    return sorted(n for n, mtime in files.items()
                  if FILE_RE.match(n) and n not in known and now - mtime >= min_age)
