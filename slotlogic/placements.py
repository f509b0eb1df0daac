"""The placements of one server that are assigned and not pinned yet: the keeper's protocol, made checkable.

`Keeper.assign` opens one (its slot claimed in the ledger, so no other placement chooses it meanwhile),
`Keeper.pin` closes it, `Keeper.abandon` and `Keeper.fallback` drop it. Each carries a serial number: only the
newest placement of a session may be pinned, once; a placement made again (its moves went stale) replaces the
older one, whose claim goes first. A call out of that order is a driver's bug and raises `ProtocolError`.
"""

from __future__ import annotations

from dataclasses import dataclass

from slotlogic.ledger import Ledger


class ProtocolError(RuntimeError):
    """A keeper call out of the order `request -> assign -> pin` (or `fallback`): a driver's bug, never input."""


@dataclass(frozen=True, slots=True)
class _Open:
    slot: int
    serial: int


class OpenPlacements:
    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self._open: dict[str, _Open] = {}  # session key -> its placement not pinned yet
        self._serial = 0

    def open(self, key: str, slot: int) -> int:
        """`key` claims `slot` (any older placement of it dropped first); the new placement's serial."""
        self.drop(key)
        self._ledger.claim(slot, key)
        self._serial += 1
        self._open[key] = _Open(slot, self._serial)
        return self._serial

    def close(self, key: str, serial: int) -> None:
        """`key`'s placement number `serial` is pinned: it must be the open one."""
        found = self._open.get(key)
        if found is None or found.serial != serial:
            raise ProtocolError("pin of a placement that is not its session's open one (placed again, or done)")

    def drop(self, key: str) -> None:
        """`key`'s open placement, if any, ends: its claim in the ledger goes."""
        found = self._open.pop(key, None)
        if found is not None:
            self._ledger.unclaim(found.slot, key)
