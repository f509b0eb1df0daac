"""Reading cache reuse out of llama-server answers (docs/llama-server.md, "Answers").

- JSON bodies: `timings.cache_n` / `prompt_n` (native and OAI), `usage.prompt_tokens_details.cached_tokens`
  (OAI), `usage.input_tokens_details.cached_tokens` (responses), `usage.cache_read_input_tokens`
  (Anthropic), `id_slot` (native, or `__verbose.id_slot`), errors such as `exceed_context_size_error`.
- SSE streams: transport chunks are not events. `SSEParser` keeps a line buffer, splits events on a blank
  line (CRLF normalised) and yields the JSON of each `data:` payload, skipping `[DONE]`; a line or an event
  over its cap is dropped, so no stream can grow the buffers. The *last*
  event carrying timings wins; `/completion` partial chunks carry `id_slot: -1`, only the final one the
  real slot.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from slotlogic import numbers
from slotlogic.numbers import count


@dataclass
class Observation:
    cache_n: int | None = None
    prompt_n: int | None = None
    id_slot: int | None = None
    prompt_per_second: float | None = None
    decode_per_second: float | None = None   # timings.predicted_per_second: generated tokens a second
    error_type: str | None = None
    n_prompt_tokens: int | None = None  # from exceed_context_size_error
    n_ctx: int | None = None
    tokens_total: int | None = None   # usage.total_tokens: prompt + generated (affinity's `/slots` match)
    events: int = 0
    complete: bool = False   # the answer's end was seen: a client that hangs up after it lost nothing

    @property
    def reuse(self) -> float | None:
        if self.cache_n is None or self.prompt_n is None or self.cache_n + self.prompt_n == 0:
            return None
        return self.cache_n / (self.cache_n + self.prompt_n)

    @property
    def outcome(self) -> str:
        """hit / partial / miss / error / unknown, for the mitmweb marker."""
        if self.error_type:
            return "error"
        r = self.reuse
        if r is None:
            return "unknown"
        if r >= 0.8:
            return "hit"
        if r > 0.0:
            return "partial"
        return "miss"


def absorb(obs: Observation, obj: Any) -> None:
    """Fold one JSON object (a whole body or one SSE event) into `obs`; later values win. Every number is
    checked where it enters (`slotlogic.numbers`): a count out of range, or a speed that is not finite, is not
    said."""
    if not isinstance(obj, dict):
        return
    timings = obj.get("timings")
    if isinstance(timings, dict):
        if (cache_n := count(timings.get("cache_n"))) is not None:
            obs.cache_n = cache_n
        if (prompt_n := count(timings.get("prompt_n"))) is not None:
            obs.prompt_n = prompt_n
        if (pps := numbers.rate(timings.get("prompt_per_second"))) is not None:
            obs.prompt_per_second = pps
        dps = numbers.rate(timings.get("predicted_per_second"))
        several = (count(timings.get("predicted_n")) or 0) > 1  # one token's speed says little
        if dps is not None and several:
            obs.decode_per_second = dps
    usage = obj.get("usage")
    if isinstance(usage, dict) and count(usage.get("total_tokens")) is not None:
        obs.tokens_total = usage["total_tokens"]
    if isinstance(usage, dict) and obs.cache_n is None:
        for details in ("prompt_tokens_details", "input_tokens_details"):
            d = usage.get(details)
            if isinstance(d, dict) and count(d.get("cached_tokens")) is not None:
                obs.cache_n = d["cached_tokens"]
        if count(usage.get("cache_read_input_tokens")) is not None:
            obs.cache_n = usage["cache_read_input_tokens"]
            if count(usage.get("input_tokens")) is not None:
                obs.prompt_n = usage["input_tokens"]
    slot = numbers.slot_id(obj.get("id_slot"))
    if slot is not None:
        obs.id_slot = slot
    verbose = obj.get("__verbose")
    if isinstance(verbose, dict):
        absorb(obs, {k: verbose[k] for k in ("id_slot", "timings") if k in verbose})
    message = obj.get("message")
    if obj.get("type") == "message_start" and isinstance(message, dict):
        absorb(obs, message)
    response = obj.get("response")
    if obj.get("type") == "response.completed" and isinstance(response, dict):  # a /v1/responses stream
        absorb(obs, {"usage": response.get("usage")})
    choices = obj.get("choices")
    if obj.get("type") in ("response.completed", "message_stop") or obj.get("stop") is True or (
            isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") for c in choices)):
        obs.complete = True
    err = obj.get("error")
    if isinstance(err, dict):
        obs.error_type = str(err.get("type") or err.get("code") or "error")
        obs.n_prompt_tokens = count(err.get("n_prompt_tokens"))
        obs.n_ctx = count(err.get("n_ctx"), numbers.MAX_CTX)


MAX_PARSED = 1 << 20    # an answer longer than this is not parsed whole (`observe_json`)
LARGE_MEMBERS = ("timings", "usage", "id_slot", "error")
MEMBER_BYTES = 64 << 10  # how much of a large answer one member's value is read from


def observe_json(raw: bytes) -> Observation:
    """The numbers of a whole JSON answer. One longer than `MAX_PARSED` (an answer with `n_probs` runs to tens
    of MB of small objects: parsed whole, 60 MB cost 517 MB and held the event loop 2.9 s) is not parsed: only
    its last `timings`, `usage`, `id_slot` and `error` members are read, where llama-server writes them, after
    the content (`_large_members`)."""
    obs = Observation()
    with contextlib.suppress(ValueError, UnicodeDecodeError, RecursionError):
        absorb(obs, json.loads(raw) if len(raw) <= MAX_PARSED else _large_members(raw))
        obs.complete = True  # the whole body came
    return obs


_decoder = json.JSONDecoder()


def _large_members(raw: bytes) -> dict[str, Any]:
    """The members `LARGE_MEMBERS` of a large answer, each from its last occurrence as a key (a quote inside a
    string is escaped, so `"name":` unescaped is a key), its value read from at most `MEMBER_BYTES`."""
    out: dict[str, Any] = {}
    for name in LARGE_MEMBERS:
        key = b'"' + name.encode() + b'"'
        at = raw.rfind(key)
        while at > 0 and raw[at - 1:at] == b"\\":
            at = raw.rfind(key, 0, at)
        if at < 0:
            continue
        text = raw[at + len(key):at + len(key) + MEMBER_BYTES].decode("utf-8", "replace").lstrip()
        if not text.startswith(":"):
            continue
        with contextlib.suppress(ValueError, RecursionError):
            out[name] = _decoder.raw_decode(text[1:].lstrip())[0]
    return out


_CR_LF = re.compile(rb"\r*\n")         # a blank line (CRs are stripped from a line's end)
_LF_CR_LF = re.compile(rb"\n\r+\n")    # the end of a line, then a blank line of CRs


@dataclass
class SSEParser:
    """Incremental SSE parser: feed transport chunks, get parsed `data:` JSON payloads.

    Bounded whatever the stream: a line longer than `max_line` bytes, an event whose `data:` lines, joined,
    are longer than `max_event` bytes, and an event of more than `max_event_lines` lines are dropped whole (the
    event they belong to is not yielded), wherever the chunks are cut; what is held never exceeds `max_line +
    max_event` plus the chunk being fed, and the lines of a dropped event are skipped at C speed. An upstream
    that never sends a newline, or a blank line, cannot grow the proxy (a 200 MB stream of `data: {}` lines
    without a blank line grew it to 4 GB) nor hold its event loop line by line. llama-server's events are
    one line of a few KB."""

    _buf: bytearray = field(default_factory=bytearray)
    _data: bytearray = field(default_factory=bytearray)  # the event's `data:` lines, joined by newlines
    max_line: int = 4 << 20
    max_event: int = 4 << 20
    max_event_lines: int = 1024
    done: bool = False         # `data: [DONE]` came
    seen: bool = False         # some of the body has come
    dropped: int = 0           # events dropped for a line or an event over its cap
    _lines: int = 0            # `data:` lines in `_data`
    _event_lines: int = 0      # lines of the current event so far
    _skipping: bool = False    # inside a line over `max_line`: dropped up to its newline
    _tainted: bool = False     # the current event lost a line or went over `max_event`

    @property
    def held(self) -> int:
        """Bytes held between chunks: the unfinished line and the unfinished event's data."""
        return len(self._buf) + len(self._data)

    def feed(self, chunk: bytes) -> Iterator[Any]:
        if chunk:
            self.seen = True
        self._buf += chunk
        while True:
            if self._tainted and not self._skipping:
                self._skip_to_blank_line()
            nl = self._buf.find(b"\n")
            if nl < 0:
                if len(self._buf) > self.max_line:
                    self._buf.clear()
                    self._skipping = self._tainted = True
                return
            over = self._skipping or nl > self.max_line
            line = b"" if over else bytes(self._buf[:nl]).rstrip(b"\r")
            del self._buf[: nl + 1]
            if over:
                self._skipping, self._tainted = False, True
                continue
            yield from self._line(line)

    def _skip_to_blank_line(self) -> None:
        """A dropped event's lines are dropped in one step, up to its blank line (a stream of tiny lines that
        never ends its event would otherwise cost a Python loop per line). The buffer starts at a line."""
        buf = self._buf
        end = buf.rfind(b"\n") + 1
        if end == 0 or _CR_LF.match(buf):
            return
        cuts = [i + 1 for i in (buf.find(b"\n\n", 0, end),) if i >= 0]
        if buf.find(b"\n\r", 0, end) >= 0:
            cuts += [m.start() + 1 for m in (_LF_CR_LF.search(buf, 0, end),) if m is not None]
        del buf[: min(cuts, default=end)]

    def close(self) -> Iterator[Any]:
        """End of stream: a final event without its blank line still counts."""
        if self._buf and not self._skipping:
            line = bytes(self._buf).rstrip(b"\r")
            self._buf.clear()
            yield from self._line(line)
        self._buf.clear()
        self._skipping = False
        yield from self._dispatch()

    def _line(self, line: bytes) -> Iterator[Any]:
        if not line:
            yield from self._dispatch()
            return
        self._event_lines += 1
        if self._event_lines > self.max_event_lines:
            self._data.clear()
            self._tainted = True
        elif line.startswith(b"data:") and not self._tainted:
            payload = line[5:]
            payload = payload[1:] if payload.startswith(b" ") else payload
            if len(self._data) + len(payload) + (self._lines > 0) > self.max_event:
                self._data.clear()
                self._tainted = True
            else:
                self._data += b"\n" + payload if self._lines else payload
                self._lines += 1

    def _dispatch(self) -> Iterator[Any]:
        tainted, lines, self._tainted, self._lines, self._event_lines = self._tainted, self._lines, False, 0, 0
        payload = bytes(self._data)
        self._data.clear()
        if tainted:
            self.dropped += 1
            return
        if not lines:
            return
        if payload.strip() == b"[DONE]":
            self.done = True
            return
        try:
            yield json.loads(payload)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return


@dataclass
class StreamObserver:
    """Observe an SSE stream event by event; never alters or drops a byte (the caller passes chunks on)."""

    parser: SSEParser = field(default_factory=SSEParser)
    obs: Observation = field(default_factory=Observation)

    @property
    def started(self) -> bool:
        """Some of the body has come (a whole event, or part of one)."""
        return self.obs.events > 0 or self.parser.seen

    def feed(self, chunk: bytes) -> None:
        events = self.parser.feed(chunk) if chunk else self.parser.close()
        for event in events:
            self.obs.events += 1
            absorb(self.obs, event)
        self.obs.complete = self.obs.complete or self.parser.done
