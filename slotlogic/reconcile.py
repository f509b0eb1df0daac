"""Two proxy processes, one slot: which of this process's sessions to place again, decided off the hot path.

Why: a process answers its known sessions from memory, so it never learns that another process placed a
session on the same slot; once a slot frees up, the two would keep evicting each other. From the background
flush, `misplaced` marks every live session claimed later than the first on a shared slot, only while a slot
is free; ties fall to the session key, so both processes agree without talking, and a marked session is just
placed again on its next request. docs/reliability.md.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from slotlogic.shared import ServerState


def misplaced(state: ServerState, ours: Mapping[str, int], now: float, ttl: float, total_slots: int | None,
              reserved: Collection[int] = (), mine: Collection[str] = ()) -> list[str]:
    """Keys of this process's live sessions (`ours`: key → slot, from memory) that share a slot with an
    earlier-claimed live session of another process while another slot is free; sorted for determinism.
    `mine`: every session this process knows (a displaced one of ours is not another process's: its state
    record lags behind the memory that already moved it off the slot)."""
    total = total_slots  # `/props`'s count: the state's own is never the size of a range
    if not total:
        return []
    by_slot: dict[int, list[tuple[float, str]]] = {}
    for key, rec in state.sessions.items():
        if now - rec.last_used >= ttl or key in ours or key in mine:
            continue
        if 0 <= rec.slot < total:
            by_slot.setdefault(rec.slot, []).append((rec.claimed or rec.last_used, key))
    for key, slot in ours.items():
        if not 0 <= slot < total:
            continue
        rec = state.sessions.get(key)
        # Our memory knows the slot best (a flush may lag); the file knows when the claim was made.
        since = (rec.claimed or rec.last_used) if rec is not None and rec.slot == slot else now
        by_slot.setdefault(slot, []).append((since, key))
    free = [s for s in range(total) if s not in by_slot and s not in reserved and not _claimed(state, s, now, ttl)]
    if not free:
        return []
    out = []
    for members in by_slot.values():
        if len(members) < 2:
            continue
        for _, key in sorted(members)[1:]:
            if key in ours:
                out.append(key)
    return sorted(out)


def _claimed(state: ServerState, slot: int, now: float, ttl: float) -> bool:
    rec = state.slots.get(slot)
    return rec is not None and rec.owner is not None and now - rec.last_used < ttl
