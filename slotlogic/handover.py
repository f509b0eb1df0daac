"""Handing a slot over between proxies that share one state: the giver lets go before the taker moves in.

Why: a proxy answers its known sessions from memory, so it learns late that another proxy claimed one of its
slots; a taker that paged at once could write under a request the giver already sent there. So each slot has
one writer, named in the shared state: the taker records a `Handover` and waits, the giver answers once its
requests there have reached the server, and only then does the taker page. A giver not heard of for `DEAD`
seconds is gone and asked nothing; everything is bounded and named by random process ids. Pure: the drivers
read and write the state under the store's lock. docs/scale-out.md ("Handing a slot over") tells the protocol.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

BEAT = 2.0          # seconds between a live proxy's beats in a state it has live sessions in
DEAD = 3 * BEAT     # a proxy not heard of for this long answers no handover
WAIT = 3.0          # seconds a taker waits for the giver's answer before it moves in anyway
DONE_KEEP = 30.0    # seconds an answered (or abandoned) handover stays in the state
MAX_PROXIES = 64
MAX_HANDOVERS = 4096
_ID = re.compile(r"^[0-9a-f]{1,64}$")
_KEY = re.compile(r"^[0-9A-Za-z_.:-]{1,128}$")  # a session key: a digest, never text


@dataclass(frozen=True)
class Handover:
    slot: int
    giver: str                 # the proxy whose live session claimed the slot before
    taker: str                 # the proxy that claimed it now
    claimant: str              # the taker's session
    epoch: int                 # counts the slot's handovers (a newer ask supersedes this one)
    asked: float
    answered: float | None = None
    last: str | None = None    # the giver's session whose conversation its last write left in the slot
    last_at: float | None = None  # when that request reached the server (its response headers came)


def valid_id(value: Any) -> bool:
    return isinstance(value, str) and bool(_ID.match(value))


def alive(beats: Mapping[str, float], proxy: str | None, now: float) -> bool:
    return proxy is not None and now - beats.get(proxy, float("-inf")) < DEAD


def turn(writers: dict[int, str], handovers: dict[tuple[int, str], Handover], beats: Mapping[str, float], slot: int,
         proxy: str, claimant: str, now: float) -> Handover | None:
    """A placement of `proxy` is about to write `slot`: None when it may (the slot is its own to write, nobody's,
    or its writer is gone: it is `proxy`'s from now on), else the handover asked of the slot's writer."""
    writer = writers.get(slot)
    if writer is None or writer == proxy or not alive(beats, writer, now):
        writers[slot] = proxy
        return None
    old = handovers.get((slot, proxy))
    epoch = (old.epoch + 1) if old is not None else 1
    h = Handover(slot, writer, proxy, claimant, epoch, now)
    handovers[(slot, proxy)] = h
    if len(handovers) > MAX_HANDOVERS:  # the oldest go first
        for k in sorted(handovers, key=lambda k: handovers[k].asked)[:len(handovers) - MAX_HANDOVERS]:
            del handovers[k]
    return h


def take_free(writers: dict[int, str], beats: Mapping[str, float], slot: int, proxy: str, now: float) -> bool:
    """A held request of `proxy` may move to `slot` (`slotlogic.wait`): the slot is `proxy`'s, nobody's, or its
    writer is gone, and is `proxy`'s from now on (True); False when a live proxy writes it. Nothing is asked
    of anyone: a move is never worth a handover."""
    writer = writers.get(slot)
    if writer is None or writer == proxy or not alive(beats, writer, now):
        writers[slot] = proxy
        return True
    return False


def forced(writers: dict[int, str], h: Handover) -> None:
    """The giver did not answer in time: the taker writes the slot anyway. The ask stays open: a giver that was
    alive after all (at start-up, before its first beat) still answers it, and stops writing the slot; its
    answer says whose conversation its last request left there, for the taker's next placement to page out."""
    writers[h.slot] = h.taker


def writes(writers: Mapping[int, str], slot: int, proxy: str) -> bool:
    return writers.get(slot) == proxy


def asked_of(handovers: Mapping[tuple[int, str], Handover], proxy: str) -> list[Handover]:
    """What `proxy` has to answer."""
    return [h for h in handovers.values() if h.giver == proxy and h.answered is None]


def acknowledge(writers: dict[int, str], handovers: dict[tuple[int, str], Handover], h: Handover, last: str | None,
                last_at: float | None, now: float) -> bool:
    """The giver's answer: the taker writes the slot from now on. False when the handover was superseded meanwhile
    (another ask of the slot)."""
    current = handovers.get((h.slot, h.taker))
    if current is None or current.epoch != h.epoch or current.answered is not None:
        return False
    handovers[(h.slot, h.taker)] = Handover(h.slot, h.giver, h.taker, h.claimant, h.epoch, h.asked, now, last,
                                            last_at)
    writers[h.slot] = h.taker
    return True


def holder(given: Handover, ours: tuple[str, float] | None) -> str | None:
    """Whose conversation the slot holds once both proxies' requests there have reached the server: a slot
    runs one task at a time, so of the giver's last request and the taker's own, the one whose response headers
    came later ran later (a stream's headers come when it starts, a whole answer's when it ends; either way
    after every task before it on the slot). `ours`: (session, when) of the taker's; "" is a side call."""
    if ours is not None and (given.last_at is None or ours[1] > given.last_at):
        return ours[0] or None
    return given.last or None


def answer(handovers: Mapping[tuple[int, str], Handover], asked: Handover) -> Handover | None:
    """The giver's answer to the taker's handover, once it came."""
    h = handovers.get((asked.slot, asked.taker))
    return h if h is not None and h.epoch == asked.epoch and h.answered is not None else None


def beat(beats: dict[str, float], proxy: str, now: float) -> None:
    beats[proxy] = now
    if len(beats) > MAX_PROXIES:
        for old in sorted(beats, key=beats.__getitem__)[:len(beats) - MAX_PROXIES]:
            del beats[old]


def prune(handovers: dict[tuple[int, str], Handover], beats: dict[str, float], now: float) -> None:
    """Old answers and asks go, and proxies dead for long."""
    for key in [k for k, h in handovers.items() if now - (h.answered or h.asked) > DONE_KEEP]:
        del handovers[key]
    for proxy in [p for p, t in beats.items() if now - t > 10 * DEAD]:
        del beats[proxy]


def to_dict(h: Handover) -> dict[str, Any]:
    return {"slot": h.slot, "giver": h.giver, "taker": h.taker, "claimant": h.claimant, "epoch": h.epoch,
            "asked": h.asked, "answered": h.answered, "last": h.last, "last_at": h.last_at}


def _key(v: Any) -> bool:
    return isinstance(v, str) and bool(_KEY.match(v))


def from_dict(slot: int, v: Any) -> Handover | None:
    """One stored handover, or None when any part is not of its shape."""
    if not isinstance(v, dict):
        return None
    giver, taker, claimant, epoch, asked = (v.get("giver"), v.get("taker"), v.get("claimant"), v.get("epoch"),
                                            v.get("asked"))
    answered, last, last_at = v.get("answered"), v.get("last"), v.get("last_at")
    if not (valid_id(giver) and valid_id(taker) and _key(claimant) and isinstance(epoch, int)
            and not isinstance(epoch, bool) and _num(asked) and (answered is None or _num(answered))
            and (last is None or _key(last)) and (last_at is None or _num(last_at))):
        return None
    return Handover(slot, giver, taker, claimant, epoch, float(asked), float(answered) if answered else None, last,
                    float(last_at) if last_at else None)


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v == v and abs(v) < 1e12
