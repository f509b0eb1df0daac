"""Remove llama-server's `__verbose` member from an answer, byte for byte, so the client gets what it would
have got without `"verbose": true` (which affinity adds to learn the slot: docs/llama-server.md).

Every other byte stays as it was; a stream is never held back beyond the member itself and the last 12 bytes
of an unfinished line (a key split across chunks); anything unexpected leaves the bytes unchanged. The key can
only occur as a structural key: inside a JSON string its quotes are escaped.
"""

from __future__ import annotations

import json

KEY = b'"__verbose":'
_WS = b" \t\r"
_decoder = json.JSONDecoder()


def _member_span(line: bytes, k: int) -> tuple[int, int] | None:
    """The bytes to cut for the key at `k`: with the comma before it, or (first member) the one after it."""
    before = k
    while before > 0 and line[before - 1:before] in (b" ", b"\t"):
        before -= 1
    if before == 0:
        return None
    opener = line[before - 1:before]
    start = before - 1 if opener == b"," else k if opener == b"{" else -1
    if start < 0:
        return None
    try:
        text = line[k + len(KEY):].decode("utf-8")
    except UnicodeDecodeError:
        return None
    i = 0
    while i < len(text) and text[i] in " \t":
        i += 1
    try:
        _, end_chars = _decoder.raw_decode(text, i)
    except ValueError:
        return None
    end = k + len(KEY) + len(text[:end_chars].encode("utf-8"))
    if opener == b"{":  # first member: take the comma that follows it instead
        j = end
        while j < len(line) and line[j:j + 1] in _WS:
            j += 1
        if line[j:j + 1] == b",":
            end = j + 1
    return start, end


def strip(data: bytes) -> bytes:
    """`data` (a JSON object, or one complete SSE line) without its `__verbose` members."""
    out = data
    pos = 0
    while True:
        k = out.find(KEY, pos)
        if k < 0:
            return out
        span = _member_span(out, k)
        if span is None:
            pos = k + len(KEY)
            continue
        out = out[:span[0]] + out[span[1]:]
        pos = span[0]


class VerboseStripper:
    """The SSE side: feed transport chunks, get the bytes to send (b"" at the end flushes what is held)."""

    def __init__(self) -> None:
        self.held = b""
        self.stripped = 0   # members removed (tests, the bench)
        self.held_max = 0   # the most bytes ever held back at once

    def feed(self, chunk: bytes) -> bytes:
        buf = self.held + chunk
        if not chunk:  # end of stream: a last line without its newline
            self.held = b""
            return self._strip(buf)
        out: list[bytes] = []
        pos = 0
        held = b""
        while pos < len(buf):
            nl = buf.find(b"\n", pos)
            if nl >= 0:
                line = buf[pos:nl + 1]
                out.append(self._strip(line) if KEY in line else line)
                pos = nl + 1
                continue
            rest = buf[pos:]
            k = rest.find(KEY)
            if k >= 0:  # an unfinished member: send what comes before it, keep the rest for the next chunk
                cut = k
                while cut > 0 and rest[cut - 1:cut] in (b" ", b"\t"):
                    cut -= 1
                if cut > 0 and rest[cut - 1:cut] in (b",", b"{"):  # what tells which comma goes with it
                    cut -= 1
                out.append(rest[:cut])
                held = rest[cut:]
            else:       # maybe the start of a key: keep the last bytes only
                cut = max(0, len(rest) - len(KEY))
                out.append(rest[:cut])
                held = rest[cut:]
            break
        self.held = held
        self.held_max = max(self.held_max, len(held))
        return b"".join(out)

    def _strip(self, data: bytes) -> bytes:
        if KEY not in data:
            return data
        out = strip(data)
        if out != data:
            self.stripped += 1
        return out
