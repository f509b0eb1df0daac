"""Two proxy processes, one slot: which of this process's sessions to place again, decided off the hot path.

Why: a known session's request is answered from this process's memory, so a process never learns that a
session of another process (sharing the state file) was placed onto its session's slot. That placement is
right when every slot is claimed, but the slot that made it so may free up a moment later (a one-shot
request ends, a session is released), and then two live sessions keep evicting each other on one slot while
another stands empty, for as long as both live.

Rule 1: pure, and never on the hot path. The driver calls `misplaced` from its background flush, with the
        state as just written (or read); the result only marks sessions in memory (`SessionTable.misplace`),
        so their *next* request takes the slow path and is placed again (a free slot wins the ranking).
Rule 2: exactly one side moves, without talking to the other process: among the live sessions on one slot,
        the one claimed first stays; every later one is *misplaced*, and only the process that holds a
        misplaced session marks it. Ties fall to the session key, so both processes agree.
Rule 3: only while a slot is free (no live session on it, no live claim, not the reserved side-call slot in
        use): with every slot claimed, sharing is the least bad choice the ranking already made.
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
