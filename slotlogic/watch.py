"""While a request waits for its first byte: what llama-server's `/slots` says about it, and when to end it.

Why: a silent request may be queued, prefilling a long prompt, or stuck, and the user cannot tell which.
The driver (`slotkeeper/drivers/watcher.py`) polls; this module names the state and decides an end: STALLED
(every slot idle, nothing changed, for `first_token_timeout`), WEDGED (its own slot makes no progress for
`wedged_timeout` or three prompt batches), or the deadline. A poll that times out reads as BUSY (`/slots`
hangs during a long prefill), and BUSY is activity; 0 turns each limit off. Pure: the clock is passed in.
docs/behaviour.md shows the lines and the ends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from slotlogic.numbers import integer


class State(Enum):
    QUEUED = "queued"            # its slot (or every slot) runs other work first
    PREFILLING = "prefilling"    # its prompt is being evaluated
    GENERATING = "generating"    # tokens are being decoded (an answer that is not streamed comes whole at the end)
    BUSY = "busy"                # /slots did not answer within its timeout: a big prefill holds the server
    STALLED = "stalled"          # every slot idle and nothing changed since the previous poll
    UNKNOWN = "unknown"          # /slots unavailable (disabled, unreachable, nonsense)


class End(Enum):
    STALLED = "stalled"          # slots_first_token_timeout
    DEADLINE = "deadline"        # slots_request_deadline
    WEDGED = "wedged"            # slots_wedged_timeout


class Poll(Enum):
    TIMEOUT = "timeout"          # the poll's own timeout passed: the server is busy


@dataclass(frozen=True)
class WatchSettings:
    interval: float = 15.0               # seconds between /slots polls while waiting for the first byte (0: off)
    poll_timeout: float = 3.0            # one poll's timeout
    first_token_timeout: float = 0.0     # seconds every slot may stay idle and unchanged before a 504 (0: off)
    deadline: float = 0.0                # seconds a request may run at all (0: off)
    wedged_timeout: float = 0.0          # seconds its own slot's task may show no progress at all (0: off)


@dataclass(frozen=True)
class Progress:
    state: State
    waited: float                        # seconds since the request left the proxy
    slot: int | None = None              # the slot it is queued behind, prefilling or generating on
    processed: int | None = None         # prompt tokens evaluated so far (llama-server updates it per batch)
    total: int | None = None             # prompt tokens of the slot's task
    decoded: int | None = None           # tokens generated so far
    idle_for: float | None = None        # STALLED: how long every slot has been idle and unchanged


def _decoded(entry: Mapping[str, Any]) -> int:
    nt = entry.get("next_token")
    first = nt[0] if isinstance(nt, list) and nt and isinstance(nt[0], dict) else nt
    return (integer(first.get("n_decoded")) or 0) if isinstance(first, dict) else 0


def _snapshot(live: Sequence[Mapping[str, Any]]) -> tuple[tuple[Any, ...], ...]:
    """What "nothing changed" compares: per slot its task, state and counters."""
    return tuple((e.get("id"), bool(e.get("is_processing")), e.get("id_task"), e.get("n_prompt_tokens"),
                  e.get("n_prompt_tokens_processed"), _decoded(e)) for e in live)


class Watch:
    """One request's watch: feed it the polls, it says what they mean and whether to end the request."""

    def __init__(self, settings: WatchSettings, started: float, slot: int | None, *, stream: bool = True,
                 batch_seconds: float = 0.0) -> None:
        self.settings = settings
        # Rule 6: a prompt batch at the measured speed (0: not measured) is one step of a slot's counters
        self.wedge_limit = max(settings.wedged_timeout, 3 * batch_seconds) if settings.wedged_timeout > 0 else 0.0
        self.stuck: tuple[Any, ...] | None = None  # the busy slots' tasks and counters, unchanged since `stuck_since`
        self.stuck_since = 0.0
        self.started = started
        self.slot = slot
        self.stream = stream
        self.first_byte = False
        self.last_poll: float | None = None
        self.idle_since: float | None = None
        self.previous: tuple[tuple[Any, ...], ...] | None = None
        self.progress: Progress | None = None
        self.ended: End | None = None
        self.ahead = 0   # earlier open requests of this proxy on the same slot, at the last poll

    def next_wake(self) -> float | None:
        """When the driver should call again (an absolute time on the watch's clock); None: never."""
        if self.ended is not None:
            return None
        times = []
        s = self.settings
        if not self.first_byte and s.interval > 0:
            times.append((self.last_poll if self.last_poll is not None else self.started) + s.interval)
        if s.deadline > 0:
            times.append(self.started + s.deadline)
        return min(times) if times else None

    def due(self, now: float) -> End | None:
        """The deadline, if it has come."""
        if self.ended is None and self.settings.deadline > 0 and now - self.started >= self.settings.deadline:
            self.ended = End.DEADLINE
        return self.ended if self.ended is End.DEADLINE else None

    def poll_due(self, now: float) -> bool:
        wake = None if self.first_byte or self.settings.interval <= 0 else (
            (self.last_poll if self.last_poll is not None else self.started) + self.settings.interval)
        return self.ended is None and wake is not None and now >= wake

    def got_first_byte(self) -> None:
        self.first_byte = True
        self.progress = None

    def polled(self, answer: Sequence[Mapping[str, Any]] | Poll | None, now: float, *,
               ahead: int = 0) -> tuple[Progress, End | None]:
        """What one `/slots` answer (or its timeout, or None: unavailable) means for this request; End.STALLED
        when every slot has stayed idle and unchanged for the first-token timeout."""
        self.last_poll = now
        self.ahead = ahead
        waited = now - self.started
        if answer is Poll.TIMEOUT or not isinstance(answer, Sequence) or not answer:
            self.idle_since = None
            state = State.BUSY if answer is Poll.TIMEOUT else State.UNKNOWN
            self.progress = Progress(state, waited)
            return self.progress, None
        live = [e for e in answer if isinstance(e, Mapping)]
        snap = _snapshot(live)
        moved = self.previous is not None and snap != self.previous
        self.previous = snap
        progress = self._read(live, waited)
        if progress.state is State.STALLED:
            if self.idle_since is None or moved:
                self.idle_since = now
            progress = Progress(State.STALLED, waited, idle_for=now - self.idle_since)
        else:
            self.idle_since = None
        self.progress = progress
        if self._wedged(live, progress, now):
            self.ended = End.WEDGED
            return progress, End.WEDGED
        limit = self.settings.first_token_timeout
        if (progress.state is State.STALLED and limit > 0 and progress.idle_for is not None
                and progress.idle_for >= limit and not self.first_byte):
            self.ended = End.STALLED
            return progress, End.STALLED
        return progress, None

    def _wedged(self, live: list[Mapping[str, Any]], progress: Progress, now: float) -> bool:
        """Our own slot runs our request (nothing of ours ahead), and neither its task nor any other busy slot's
        has moved for the wedge limit."""
        mine = next((e for e in live if e.get("id") == self.slot), None) if self.slot is not None else None
        if (self.wedge_limit <= 0 or mine is None or self.ahead > 0 or progress.slot != self.slot
                or progress.state not in (State.PREFILLING, State.GENERATING)):
            self.stuck = None
            return False
        # The server fills each prompt batch slot by slot, so our slot may wait while another one's long prompt
        # is evaluated: progress anywhere means the server is working through its queue, not stuck.
        others = _snapshot([e for e in live if e.get("id") != self.slot and e.get("is_processing")])
        task = (mine.get("id_task"), mine.get("n_prompt_tokens"), mine.get("n_prompt_tokens_processed"),
                _decoded(mine), others)
        if task != self.stuck:
            self.stuck, self.stuck_since = task, now
            return False
        return now - self.stuck_since >= self.wedge_limit and not self.first_byte

    def _read(self, live: list[Mapping[str, Any]], waited: float) -> Progress:
        busy = [e for e in live if e.get("is_processing")]
        if not busy:
            return Progress(State.STALLED, waited)
        if self.slot is not None:
            mine = next((e for e in live if e.get("id") == self.slot), None)
            if mine is not None and mine.get("is_processing"):
                decoded = _decoded(mine)
                if ahead_of_us(self, mine):
                    return _on(State.QUEUED, mine, waited)
                if decoded > 0:
                    return _on(State.GENERATING, mine, waited)
                return _on(State.PREFILLING, mine, waited)
            # our slot idle while others work: the server has not started ours yet
            return _on(State.QUEUED, _furthest(busy), waited)
        if len(busy) == len(live):
            return _on(State.QUEUED, _furthest(busy), waited)
        prefilling = [e for e in busy if _decoded(e) == 0]
        if prefilling:
            return _on(State.PREFILLING, prefilling[0], waited)
        return _on(State.GENERATING if not self.stream else State.QUEUED, _furthest(busy), waited)


def ahead_of_us(watch: Watch, mine: Mapping[str, Any]) -> bool:
    """Our slot is busy with an earlier request: one the proxy sent there before ours, or (a stream: our first
    token would have reached us) one that is already decoding."""
    return watch.ahead > 0 or (watch.stream and _decoded(mine) > 0)


def _furthest(busy: list[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The busy slot likely to free first: the one that has decoded the most."""
    return max(busy, key=_decoded)


def _on(state: State, entry: Mapping[str, Any], waited: float) -> Progress:
    return Progress(state, waited, slot=integer(entry.get("id")),
                    processed=integer(entry.get("n_prompt_tokens_processed")),
                    total=integer(entry.get("n_prompt_tokens")), decoded=_decoded(entry))
