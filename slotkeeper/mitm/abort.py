"""Ending a live request from outside its hooks: a clear error for the client, a closed upstream connection.

Why: the watch and the deadline decide while mitmproxy awaits llama-server's answer, when no hook runs and
`flow.kill()` would only act at the next one. The proxyserver's `inject_event` hands a `ResponseProtocolError`
(and first, for a started stream, an error chunk) to the flow's stream, which fails it as if the server had:
the client gets an error answer and the upstream connection closes, so llama-server cancels the task.
`install_json_errors` makes that answer JSON in the route's shape. The mitmproxy internals this relies on
(checked on 11 and 12) are listed in docs/mitmproxy.md; anything unexpected returns False and the request goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from mitmproxy import ctx, http, version
from mitmproxy.net.http import http1
from mitmproxy.proxy import events
from mitmproxy.proxy.layers.http import ResponseData, ResponseProtocolError, _http1

log = logging.getLogger("slotkeeper")


class ErrorPage(str):
    """An injected error's message that carries the JSON body its error answer gets (`install_json_errors`).
    As a `str` it is the message itself: `flow.error`, logs and mitmproxy's own page read it as one."""

    body: bytes = b""

    def __new__(cls, message: str, body: bytes = b"") -> ErrorPage:
        page = super().__new__(cls, message)
        page.body = body
        return page


def _json_errors(original: Callable[..., bytes]) -> Callable[..., bytes]:
    def make_error_response(status_code: int, message: str = "") -> bytes:
        if isinstance(message, ErrorPage) and message.body:
            headers = http.Headers(Server=version.MITMPROXY, Connection="close", Content_Type="application/json")
            return http1.assemble_response(http.Response.make(status_code, message.body, headers))
        return original(status_code, message)

    make_error_response.slotkeeper_original = original  # type: ignore[attr-defined]
    return make_error_response


def install_json_errors() -> bool:
    """Wrap mitmproxy's HTTP/1 `make_error_response` once (idempotent: the addon script may be loaded again),
    so an injected `ErrorPage` is answered as JSON. False when the function is not where it was."""
    current = getattr(_http1, "make_error_response", None)
    if not callable(current):
        log.warning("slotkeeper: mitmproxy's error answers moved; the watchdog's 504s stay its HTML page")
        return False
    if not hasattr(current, "slotkeeper_original"):
        _http1.make_error_response = _json_errors(current)
    return True


class _Status:
    """mitmproxy 12's `ErrorCode` protocol: the status an error answer gets."""

    def __init__(self, status: int) -> None:
        self.status = status

    def http_status_code(self) -> int:
        return self.status


class _InjectedError(ResponseProtocolError, events.MessageInjected):  # type: ignore[misc]
    def __init__(self, flow: http.HTTPFlow, stream_id: int, message: str, status: int) -> None:
        self.flow = flow
        self.stream_id = stream_id
        self.message = message
        self.code = status if _CODE_IS_INT else _Status(status)  # type: ignore[assignment]


class _InjectedData(ResponseData, events.MessageInjected):  # type: ignore[misc]
    def __init__(self, flow: http.HTTPFlow, stream_id: int, data: bytes) -> None:
        self.flow = flow
        self.stream_id = stream_id
        self.data = data
        self.message = data


def _code_is_int() -> bool:
    import inspect
    return inspect.signature(ResponseProtocolError.__init__).parameters["code"].annotation in (int, "int")


_CODE_IS_INT = _code_is_int()


def _stream_id(proxyserver: Any, flow: http.HTTPFlow) -> int | None:
    """The HTTP stream id of `flow` on its client connection, found by walking that connection's layers."""
    handler = proxyserver.connections.get(flow.client_conn.id)
    if handler is None:
        return None
    todo, seen = [getattr(handler, "layer", None)], set()
    while todo:
        layer = todo.pop()
        if layer is None or id(layer) in seen:
            continue
        seen.add(id(layer))
        streams = getattr(layer, "streams", None)
        if isinstance(streams, dict):
            for sid, stream in streams.items():
                if getattr(stream, "flow", None) is flow:
                    return int(sid)
        todo += [getattr(layer, "layer", None), getattr(layer, "child_layer", None)]
    return None


def end_flow(flow: http.HTTPFlow, status: int, message: str, stream_event: bytes | None = None,
             body: bytes | None = None) -> bool:
    """End `flow` now: `status` + `message` when no response has reached the client (as the JSON `body` when
    given, else mitmproxy's HTML page), else `stream_event` (if given) as the stream's last chunk; then both
    connections close. True when the events were injected."""
    try:
        proxyserver = ctx.master.addons.get("proxyserver")
        if proxyserver is None or not flow.live:
            return False
        sid = _stream_id(proxyserver, flow)
        if sid is None:
            return False
        streaming = flow.response is not None and callable(flow.response.stream)
        if streaming and stream_event:
            proxyserver.inject_event(_InjectedData(flow, sid, stream_event))
        proxyserver.inject_event(_InjectedError(flow, sid, ErrorPage(message, body) if body else message, status))
        return True
    except Exception as e:  # internals moved: say so once per call, and let the request go on
        log.debug("slotkeeper: could not end a request (%s)", type(e).__name__)
        return False


JSON_ERRORS = install_json_errors()
