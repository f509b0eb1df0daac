"""The body rewrite: the only change slotkeeper makes to a request.

Rules (docs/llama-server.md):
- `id_slot` must be an integer in `0 … total_slots-1`; anything else (strings, floats, negatives,
  out-of-range) is either ignored or wrapped differently by different server builds, so we replace it.
- A client's own valid `id_slot` is kept unless the operator asked us to override clients.
- `cache_prompt: true` is added when absent or null; any explicit value is the client's choice.
- Every other byte is left exactly as it was: the two fields are appended (`splice`) or their values
  replaced in place (`set_fields`), never by re-serialising the document, which would turn `1e400` into
  `Infinity` (not JSON) or fail on a lone surrogate. The rewrite is idempotent, so replays re-apply it safely.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from slotlogic import json_scan

FIELDS = ("id_slot", "cache_prompt")


def trusted_client_slot(body: dict[str, Any], total: int | None, override_client: bool) -> int | None:
    """A trusted client's own valid `id_slot` (`slots_override_client=false`); None: the proxy chooses."""
    return None if override_client or not total else valid_client_slot(body, total)


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
    slot: int                   # -1: pending (llama-server chooses; `slots_policy=affinity`)
    changed: bool
    client_slot_kept: bool
    added_verbose: bool = False  # `"verbose": true` appended (a pending request whose slot is read from it)


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


def pend(body: dict[str, Any], total_slots: int | None, *, verbose: bool, override_client: bool = False) -> Rewrite:
    """A pending request (`slotlogic.affinity`): `id_slot: -1` so llama-server chooses the slot, `cache_prompt:
    true` unless the client chose, and `verbose: true` when asked for (only if the client sent no `verbose`).
    A client's own valid slot is kept, as by `pin`."""
    out = dict(body)
    client = body.get("id_slot")
    kept = (not override_client and isinstance(client, int) and not isinstance(client, bool) and client >= 0
            and (total_slots is None or client < total_slots))
    out["id_slot"] = client if kept else -1
    if out.get("cache_prompt") is None:
        out["cache_prompt"] = True
    added = verbose and not kept and "verbose" not in body
    if added:
        out["verbose"] = True
    return Rewrite(body=out, slot=out["id_slot"], changed=out != body, client_slot_kept=kept, added_verbose=added)


def splice(raw: bytes, body: dict[str, Any], result: Rewrite) -> bytes | None:
    """The rewritten body as bytes without re-encoding the whole document: when the client sent neither
    field, append them before the closing brace of its own bytes (a 60 KB prompt is not re-serialised on
    every request). None when that is not safe; the caller then serialises `result.body`."""
    if "id_slot" in body or "cache_prompt" in body:
        return None
    end = raw.rstrip()
    if not end.endswith(b"}"):
        return None
    extra = f'"id_slot":{_literal(result.body["id_slot"])},"cache_prompt":{_literal(result.body["cache_prompt"])}'
    if result.added_verbose:
        extra += ',"verbose":true'
    head = end[:-1].rstrip()
    sep = b"" if head.endswith(b"{") else b","
    return head + sep + extra.encode() + b"}"


def _literal(value: Any) -> str:
    return json.dumps(value, allow_nan=False)


def set_fields(raw: bytes, result: Rewrite) -> bytes | None:
    """The client's bytes with every top-level `id_slot` / `cache_prompt` (however their keys are spelt, and
    each of a repeated key) set to the rewrite's values, and a missing one appended; every other byte kept.
    None when `raw` is not one JSON object."""
    try:
        text = raw.decode("utf-8")
        found, close = _top_level_values(text)
    except json_scan.ERRORS:  # UnicodeDecodeError is a ValueError
        return None
    out, pos = [], 0
    for start, end, name in found:
        out += [text[pos:start], _literal(result.body[name])]
        pos = end
    head = text[pos:close].rstrip()
    missing = [n for n in FIELDS if n not in {name for _, _, name in found} and n in result.body]
    if result.added_verbose:
        missing.append("verbose")
    extra = ",".join(f'"{n}":{_literal(result.body[n])}' for n in missing)
    if extra:
        extra = ("" if head.endswith("{") else ",") + extra
    return ("".join(out) + head + extra + text[close:]).encode()


def _top_level_values(s: str) -> tuple[list[tuple[int, int, str]], int]:
    """Spans of the values of the top-level keys named in FIELDS, and the offset of the closing brace."""
    found, close = json_scan.members(s)
    return [(start, end, name) for name, start, end in found if name in FIELDS], close


_SPLICED = re.compile(rb'(,?)"id_slot":-?\d+,"cache_prompt":(?:true|false)(?:,"verbose":true)?\}\s*$')


def unsplice(raw: bytes) -> bytes | None:
    """Undo `splice`: the client's own bytes from a body we rewrote (replaying a saved flow). None when the
    body does not end with our two fields."""
    m = _SPLICED.search(raw)
    if m is None:
        return None
    return raw[: m.start()] + b"}"
