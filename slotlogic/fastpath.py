"""A known session's next chat request, recognised from its bytes without parsing them.

Why: `json.loads` of a growing agent body was half the hot path's cost, yet an agent's next request repeats
its previous one: the same head (keys before `messages`, up to the first user message), the same tail (after
the array) and the messages it sent last time, followed by new ones. `ShapeIndex.learn` runs after a full
parse; `match` takes a body only when it provably continues the array (the old middle byte for byte, then
only `, {message}` items, no backslash-u escape), so a match names the same session and fields the parse would.
Sessions named by headers are not learned; memory is bounded (`MAX_SHAPES`, `MAX_BYTES`). See
docs/behaviour.md ("Hot path").
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from slotlogic import json_scan
from slotlogic.endpoints import CHAT_PATHS, normalise_path
from slotlogic.session import SessionId

WINDOW = 32        # bytes before the end of the head that index it (the end of the first user message)
MAX_SHAPES = 256   # sessions remembered; the least recently matched go first
MAX_BYTES = 32 << 20  # all shapes' heads, middles, tails and keys together
OVERHEAD = 512     # bytes per shape besides its byte strings (the objects, the index entries)
MAX_TRIES = 3      # learns of one session without a match in between: its bodies do not repeat, stop


@dataclass
class Shape:
    key: SessionId
    side: bool
    path: str
    head: bytes
    tail: bytes
    middle: bytes  # the messages after the first user message as sent last time (from its comma, no trailing space)

    @property
    def size(self) -> int:
        """What this shape costs against `MAX_BYTES`: every byte it keeps."""
        return len(self.head) + len(self.tail) + len(self.middle) + len(self.key.key) + OVERHEAD


def locate(text: str) -> tuple[int, int] | None:
    """(end of the first user message, start of the `]` closing `messages`) as offsets in `text`, a JSON
    object; None when the body is not a plain object with one `messages` array holding a user message."""
    found: list[tuple[int, int]] = []

    def scan(s: str, name: str, i: int) -> int:
        if name != "messages":
            return json_scan.value_end(s, i)
        if found or s[i] != "[":
            raise json_scan.NotOneObject("messages")  # a repeated key: json.loads keeps the last; not worth it
        where, end = _messages(s, i + 1)
        if where is None:
            raise json_scan.NotOneObject("messages")
        found.append(where)
        return end
    try:
        json_scan.members(text, scan)
    except json_scan.ERRORS:
        return None
    return found[0] if found else None


def _messages(s: str, i: int) -> tuple[tuple[int, int] | None, int]:
    first_user = None
    while True:
        i = json_scan.ws(s, i)
        if s[i] == "]":
            return ((first_user, i) if first_user is not None else None), i + 1
        value, i = json_scan.scan_value(s, i)
        if first_user is None and isinstance(value, dict) and value.get("role") == "user":
            first_user = i
        i = json_scan.ws(s, i)
        if s[i] == ",":
            i += 1
        elif s[i] != "]":
            return None, i


class ShapeIndex:
    def __init__(self, limit: int = MAX_SHAPES, max_bytes: int = MAX_BYTES) -> None:
        self.limit = limit
        self.max_bytes = max_bytes
        self.shapes: OrderedDict[str, Shape] = OrderedDict()   # session key -> its shape
        self.by_sig: dict[tuple[int, bytes], Shape] = {}       # (len(head), head[-WINDOW:]) -> shape
        self.ends: dict[int, int] = {}                         # len(head) -> how many shapes have it
        self.tries: dict[str, int] = {}                        # session key -> learns since its last match
        self.bytes = 0                                         # Shape.size summed over the shapes

    def learn(self, path: str, content: bytes, key: SessionId, side: bool) -> Shape | None:
        """Remember the shape of a fully parsed body of `key` (recognised by its conversation root)."""
        if key.source != "content:root" or normalise_path(path) not in CHAT_PATHS:
            return None
        tries = self.tries.get(key.key, 0)
        if tries >= MAX_TRIES:
            return None
        if len(self.tries) > 4 * self.limit:
            self.tries.clear()
        self.tries[key.key] = tries + 1
        try:
            text = content.decode("utf-8")
        except UnicodeDecodeError:
            return None
        found = locate(text)
        if found is None:
            return None
        head_end = len(text[: found[0]].encode())
        tail_start = head_end + len(text[found[0]: found[1]].encode())
        if head_end < WINDOW:
            return None
        self.forget(key.key)
        if len(content) + len(key.key) + OVERHEAD > self.max_bytes:
            return None  # alone past the cap: it would evict every other shape and still not fit
        shape = Shape(key, side, path, content[:head_end], content[tail_start:],
                      content[head_end:tail_start].rstrip())
        self.shapes[key.key] = shape
        self.by_sig[(head_end, shape.head[-WINDOW:])] = shape
        self.ends[head_end] = self.ends.get(head_end, 0) + 1
        self.bytes += shape.size
        self._bound()
        return shape

    def _bound(self) -> None:
        while len(self.shapes) > self.limit or self.bytes > self.max_bytes:
            self.forget(next(iter(self.shapes)))

    def forget(self, key: str) -> None:
        shape = self.shapes.pop(key, None)
        if shape is None:
            return
        self.bytes -= shape.size
        sig = (len(shape.head), shape.head[-WINDOW:])
        if self.by_sig.get(sig) is shape:
            del self.by_sig[sig]
        n = self.ends.get(len(shape.head), 0) - 1
        if n > 0:
            self.ends[len(shape.head)] = n
        else:
            self.ends.pop(len(shape.head), None)

    def match(self, path: str, content: bytes) -> Shape | None:
        """The known session whose head, last middle and tail `content` repeats, with nothing but whole new
        messages in between; None sends the request down the full parse."""
        size = len(content)
        for end in self.ends:
            if end > size:
                continue
            shape = self.by_sig.get((end, content[end - WINDOW: end]))
            if shape is None or shape.path != path:
                continue
            stop = size - len(shape.tail)
            known = end + len(shape.middle)
            if stop < known or not content.endswith(shape.tail) or not content.startswith(shape.head):
                continue
            if not content.startswith(shape.middle, end) or not appended_messages(content[known:stop]):
                return None
            middle = content[end:stop].rstrip()
            if len(middle) > len(shape.middle):  # next time only the messages after these are checked
                self.bytes += len(middle) - len(shape.middle)
                shape.middle = middle
            self.shapes.move_to_end(shape.key.key)
            self.tries.pop(shape.key.key, None)
            self._bound()
            return shape
        return None

    def __len__(self) -> int:
        return len(self.shapes)


def appended_messages(new: bytes) -> bool:
    """Whether `new` is zero or more `, {…}` items of a JSON array and nothing else (whitespace aside), with
    no `\\u` escape anywhere: what an agent adds to its messages between two turns."""
    if not new.strip():
        return True
    if b"\\u" in new:
        return False
    try:
        text = new.decode("utf-8")
        i, n = 0, len(text)
        while True:
            while i < n and text[i] in json_scan.WS:
                i += 1
            if i == n:
                return True
            if text[i] != ",":
                return False
            i += 1
            while i < n and text[i] in json_scan.WS:
                i += 1
            if i == n or text[i] != "{":
                return False
            i = json_scan.value_end(text, i)
    except json_scan.ERRORS:
        return False


def fields_absent(body: dict[str, Any]) -> bool:
    """Whether a parsed body leaves both rewrite fields to us (the only bodies worth learning)."""
    return "id_slot" not in body and "cache_prompt" not in body
