"""One scanner over the top level of a JSON object's text, for the two places that edit or measure a body
without re-serialising it: the rewrite's splice of `id_slot`/`cache_prompt` (`slotlogic.rewrite`) and the hot
path's byte shapes (`slotlogic.fastpath`). Values are skipped with the standard library's own scanner."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from json.decoder import scanstring  # type: ignore[attr-defined]

WS = " \t\n\r"
_value = json.JSONDecoder().scan_once
# (text, member name, offset of its value) -> offset after the value; may raise NotOneObject to refuse
Scan = Callable[[str, str, int], int]
ERRORS = (ValueError, IndexError, StopIteration, RecursionError)  # what a malformed text can raise here


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string literal, escapes included


def containers_over(raw: bytes, cap: int) -> bool:
    """Whether the JSON text `raw` holds more than `cap` objects and arrays: what a parse costs in memory and
    time (~200 bytes and ~1 µs each) far more than its bytes (a 20 MB body of 7M `{}` parsed into 582 MB and
    held the event loop 23 s). Counted at C speed: brackets first, and only when they are many, again outside
    string literals (code in a prompt has many)."""
    if raw.count(b"{") + raw.count(b"[") <= cap:
        return False
    bare = _STRING.sub(b"", raw)
    return bare.count(b"{") + bare.count(b"[") > cap


class NotOneObject(ValueError):
    """The text is not exactly one JSON object of the shape the caller accepts."""


def ws(s: str, i: int) -> int:
    """The offset of the first non-whitespace character at or after `i` (IndexError at the end)."""
    while s[i] in WS:
        i += 1
    return i


def value_end(s: str, i: int) -> int:
    """The offset just after the JSON value that starts at `i`."""
    return _value(s, i)[1]


def scan_value(s: str, i: int) -> tuple[object, int]:
    """The JSON value that starts at `i`, parsed, and the offset just after it."""
    return _value(s, i)


def _skip(s: str, _name: str, i: int) -> int:
    return value_end(s, i)


def members(s: str, scan: Scan = _skip) -> tuple[list[tuple[str, int, int]], int]:
    """Every top-level member of the object `s` as (name, value start, value end), in order (a repeated key
    each time), and the offset of its closing brace. `scan` reads a value itself where the caller needs more
    than its span. Raises NotOneObject (or another of `ERRORS`) when `s` is not exactly one object."""
    i = ws(s, 0)
    if s[i] != "{":
        raise NotOneObject("not an object")
    found: list[tuple[str, int, int]] = []
    i = ws(s, i + 1)
    if s[i] == "}":
        if s[i + 1:].strip(WS):
            raise NotOneObject("text after the object")
        return found, i
    while True:
        if s[i] != '"':
            raise NotOneObject("a key that is not a string")
        name, i = scanstring(s, i + 1)
        i = ws(s, i)
        if s[i] != ":":
            raise NotOneObject("no colon")
        start = ws(s, i + 1)
        end = scan(s, name, start)
        found.append((name, start, end))
        i = ws(s, end)
        if s[i] == ",":
            i = ws(s, i + 1)
            continue
        if s[i] == "}" and not s[i + 1:].strip(WS):
            return found, i
        raise NotOneObject("not one object")
