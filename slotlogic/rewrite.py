"""The body rewrite: the only change slotkeeper makes to a request.

Rules (llama-server.md §1.1, §1.4, §2.2):
- `id_slot` must be an integer in `0 … total_slots-1`; anything else (strings, floats, negatives,
  out-of-range) is either ignored or wrapped differently by different server builds, so we replace it.
- A client's own valid `id_slot` is kept unless the operator asked us to override clients.
- `cache_prompt: true` is added when absent or null; any explicit value is the client's choice.
- Every other key is left exactly as it was (the rewrite is idempotent, so replays re-apply it safely).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


def valid_client_slot(body: dict[str, Any], total_slots: int) -> int | None:
    """The client's own `id_slot` when it is a usable integer slot, else None."""
    value = body.get("id_slot")
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    if 0 <= value < total_slots:
        return value
    return None


@dataclass(frozen=True)
class Rewrite:
    body: dict[str, Any]
    slot: int
    changed: bool
    client_slot_kept: bool


def pin(body: dict[str, Any], slot: int, total_slots: int, *, override_client: bool = False) -> Rewrite:
    """Return a copy of `body` pinned to `slot` (or to the client's own valid slot)."""
    if not 0 <= slot < max(total_slots, 1):
        raise ValueError(f"slot {slot} out of range for {total_slots} slots")
    out = dict(body)
    client = valid_client_slot(body, total_slots)
    kept = client is not None and not override_client
    final = client if kept and client is not None else slot
    out["id_slot"] = final
    if out.get("cache_prompt") is None:  # absent or null (the server treats null as absent)
        out["cache_prompt"] = True
    changed = out != body
    return Rewrite(body=out, slot=final, changed=changed, client_slot_kept=kept)


def splice(raw: bytes, body: dict[str, Any], result: Rewrite) -> bytes | None:
    """The rewritten body as bytes without re-encoding the whole document: when the client sent neither
    field, append them before the closing brace of its own bytes (a 60 KB prompt is not re-serialised on
    every request). None when that is not safe; the caller then serialises `result.body`."""
    if "id_slot" in body or "cache_prompt" in body:
        return None
    end = raw.rstrip()
    if not end.endswith(b"}"):
        return None
    extra = f'"id_slot":{result.body["id_slot"]},"cache_prompt":{"true" if result.body["cache_prompt"] else "false"}'
    head = end[:-1].rstrip()
    sep = b"" if head.endswith(b"{") else b","
    return head + sep + extra.encode() + b"}"


_SPLICED = re.compile(rb'(,?)"id_slot":\d+,"cache_prompt":(?:true|false)\}\s*$')


def unsplice(raw: bytes) -> bytes | None:
    """Undo `splice`: the client's own bytes from a body we rewrote (replaying a saved flow). None when the
    body does not end with our two fields."""
    m = _SPLICED.search(raw)
    if m is None:
        return None
    return raw[: m.start()] + b"}"
