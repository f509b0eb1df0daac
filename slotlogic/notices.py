"""Claim notices: what one proxy tells the others, at once, when it claims a slot of a server they share.

Why: without them a proxy learns of another's claim only at its next flush, and meanwhile sends a session back
to a slot that no longer holds its conversation. A notice is sent at the claim and at the send (the request
reached the slot, which says whose conversation is on top); it holds a slot, two session digests, a process
id and a time, never text, and any other shape is dropped. A late or spurious notice costs one placement,
never a wrong answer. Pure: the Redis driver publishes and subscribes. See docs/scale-out.md.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slotlogic.shared import ServerState

VERSION = 1
MAX_NOTICE = 1024  # a notice is a few hundred bytes: a longer message on the channel is a stranger's, never parsed
_KEY = re.compile(r"^[0-9A-Za-z_.:-]{1,128}$")  # a session key or a process id: digests, never text


@dataclass(frozen=True)
class ClaimNotice:
    slot: int
    claimant: str            # the session now on the slot
    displaced: str | None    # the slot's owner before this claim, as the claimant's store saw it
    instance: str            # the process that made the claim (a proxy ignores its own notices)
    at: float                # the claim's time (wall clock of the claimant)
    sent: bool = False       # the claimant's request has reached the server (not only claimed the slot)


def owners(state: ServerState) -> dict[int, str | None]:
    """Each slot's owner, to compare with after a transaction."""
    return {slot: rec.owner for slot, rec in state.slots.items()}


def changes(before: Mapping[int, str | None], after: ServerState, instance: str, now: float) -> list[ClaimNotice]:
    """One notice per slot whose owner is now a different session (a released slot tells nobody anything)."""
    out = []
    for slot, rec in sorted(after.slots.items()):
        old = before.get(slot)
        if rec.owner is not None and rec.owner != old:
            out.append(ClaimNotice(slot, rec.owner, old, instance, rec.last_used or now))
    return out


def encode(notice: ClaimNotice) -> str:
    return json.dumps({"v": VERSION, "slot": notice.slot, "claimant": notice.claimant,
                       "displaced": notice.displaced, "instance": notice.instance, "at": notice.at,
                       "sent": notice.sent}, separators=(",", ":"))


def decode(raw: Any) -> ClaimNotice | None:
    """A notice from the wire, or None for anything else (another version, damage, a stranger's message)."""
    if not isinstance(raw, str | bytes) or len(raw) > MAX_NOTICE:
        return None
    try:
        data = json.loads(raw)
    except (ValueError, TypeError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("v") != VERSION:
        return None
    slot, claimant, displaced = data.get("slot"), data.get("claimant"), data.get("displaced")
    instance, at, sent = data.get("instance"), data.get("at"), data.get("sent", False)
    if (not isinstance(slot, int) or isinstance(slot, bool) or slot < 0 or not _key(claimant)
            or not (displaced is None or _key(displaced)) or not _key(instance)
            or not isinstance(at, int | float) or isinstance(at, bool) or not isinstance(sent, bool)):
        return None
    return ClaimNotice(slot, claimant, displaced, instance, float(at), sent)


def _key(v: Any) -> bool:
    return isinstance(v, str) and bool(_KEY.match(v))
