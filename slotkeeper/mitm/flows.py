"""From a mitmproxy flow to the core's facts, and a decision back onto the flow.

The hot path reads and writes headers on mitmproxy's raw `fields` tuples: each `Headers.get` /
`headers[...] = ...` walks the whole multidict through several Python layers (~5 µs each in mitmdump), and a
known session's request needs about ten of them. Names are lower-case bytes. No mitmproxy import: the message
objects are passed in.
"""

from __future__ import annotations

import time
from typing import Any

from slotkeeper.drivers import origins
from slotkeeper.mitm import body_decode
from slotlogic.decisions import Decision, Fields, Observe, Pin, Replay, RequestFacts


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
    """Replace the body and frame it with Content-Length (a client's chunked framing is dropped: docs/mitmproxy.md).
    An encoded body is re-encoded by mitmproxy itself."""
    fields = message.headers.fields
    if get(fields, b"content-encoding"):
        message.headers.fields = without(fields, b"transfer-encoding")
        message.content = body
        return
    set_raw(message, body)


def set_raw(message: Any, body: bytes) -> None:
    """The body's bytes exactly as they go out (already encoded, if the message says so), framed with
    Content-Length."""
    fields = message.headers.fields
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


def upstream_url(flow: Any) -> str:
    req = flow.request
    return origins.origin(req.scheme, req.host, req.port)


def set_destination(flow: Any, base: str) -> None:
    """Send the request to `base` (`scheme://host:port`): the pool's choice of server. Path and body stay."""
    scheme, host, port = origins.parts(base)
    req = flow.request
    if (req.scheme, req.host, req.port) != (scheme, host, port):
        req.scheme, req.host, req.port = scheme, host, port


_DECODE: Any = object()


def request_facts(flow: Any, body: bytes | None = _DECODE) -> RequestFacts:
    """The facts of a request for `Keeper.request`. A saved flow (`mitmdump -nr`, not live) keeps the recorded
    clock and brings what the proxy recorded with it: the client's own fields and the server's facts. `body`:
    the decoded body when the caller decoded it already (`slotkeeper/mitm/body_decode.py`)."""
    req = flow.request
    if body is _DECODE:
        try:
            body = content(req)
        except ValueError:
            body = None
    replay = None
    if not flow.live:
        recorded = flow.metadata.get("slotkeeper")
        recorded = recorded if isinstance(recorded, dict) else {}
        path = recorded.get("path")
        replay = Replay(client=recorded.get("client"), facts=recorded.get("facts"),
                        path=path if isinstance(path, str) else None)
    return RequestFacts(req.method, req.path, req.headers.fields, body, req.timestamp_start or time.time(), replay)


def apply(flow: Any, decision: Decision) -> None:
    """The decision's body (and, for a translated request, its route) onto the request."""
    if isinstance(decision, Pin | Observe) and decision.body is not None:
        set_content(flow.request, decision.body)
    if isinstance(decision, Pin) and decision.path is not None:
        flow.request.path = decision.path


async def apply_async(flow: Any, decision: Decision, encoding: bytes | None, destination: str | None = None
                      ) -> None:
    """`apply`, for a body the client sent encoded: the decision's body encoded again the same way (off the
    event loop when it is large), its route set as `apply` does; `destination`: the server a pool chose
    (`set_destination`)."""
    if destination is not None:
        set_destination(flow, destination)
    if encoding and isinstance(decision, Pin | Observe) and decision.body is not None:
        set_raw(flow.request, await body_decode.encode_async(decision.body, encoding.decode("latin-1")))
        if isinstance(decision, Pin) and decision.path is not None:
            flow.request.path = decision.path  # a translated request's route
        return
    apply(flow, decision)


def response_body(response: Any) -> bytes:
    """The decoded response body; the raw bytes when the encoding is bad (observation only)."""
    try:
        return content(response) or b""
    except ValueError:
        return response.raw_content or b""
