"""Header reads and writes on mitmproxy's raw `fields` tuples, for the hot path.

Each `Headers.get` / `headers[...] = ...` walks the whole multidict through several Python layers
(~5 µs each in mitmdump); a request of a known session needs about ten of them. These helpers do the same
on the immutable `((name, value), ...)` tuple that `Headers.fields` holds. Names are lower-case bytes.
No mitmproxy import: the message objects are passed in.
"""

from __future__ import annotations

from typing import Any

Fields = tuple[tuple[bytes, bytes], ...]


def get(fields: Fields, name: bytes) -> bytes | None:
    """The first value of header `name` (lower-case), like `Headers.get`."""
    for k, v in fields:
        if k.lower() == name:
            return v
    return None


def without(fields: Fields, *names: bytes) -> Fields:
    return tuple(f for f in fields if f[0].lower() not in names)


def content(message: Any) -> bytes | None:
    """The decoded body: the raw bytes when there is no Content-Encoding (the usual case), else
    mitmproxy's decoder (raises ValueError on a bad encoding, as `get_content(strict=True)`)."""
    if message.raw_content is None or not get(message.headers.fields, b"content-encoding"):
        return message.raw_content
    return message.get_content(strict=True)


def set_content(message: Any, body: bytes) -> None:
    """Replace the body and frame it with Content-Length (a client's chunked framing is dropped, pitfall P5).
    An encoded body is re-encoded by mitmproxy itself."""
    fields = message.headers.fields
    if get(fields, b"content-encoding"):
        message.headers.fields = without(fields, b"transfer-encoding")
        message.content = body
        return
    message.raw_content = body
    length = str(len(body)).encode()
    out, seen = [], False
    for k, v in fields:
        name = k.lower()
        if name == b"transfer-encoding" or (name == b"content-length" and seen):
            continue
        if name == b"content-length":
            out.append((k, length))
            seen = True
        else:
            out.append((k, v))
    if not seen:
        out.append((b"content-length", length))
    message.headers.fields = tuple(out)


def is_sse(message: Any) -> bool:
    ctype = get(message.headers.fields, b"content-type")
    return ctype is not None and b"text/event-stream" in ctype.lower()
