"""Ending a live request from outside its hooks: a clear error for the client, a closed upstream connection.

Why this is needed: the first-token watch and the deadline decide while mitmproxy waits for llama-server's
answer, when no hook runs and `flow.response` can no longer be set; `flow.kill()` only takes effect at the
next hook. mitmproxy's proxyserver addon can inject an event into a live connection (`inject_event`, what
its `inject.websocket` / `inject.tcp` commands use). The HTTP layer hands an injected event straight to the
flow's stream, and a stream that receives a `ResponseProtocolError` does what it does when the server
fails: the `error` hook runs, the client gets an error answer (`make_error_response(status, message)`) when
no response has started, and its connection is closed; closing the client connection closes the upstream
connection too, which is how llama-server learns to cancel the task ("srv stop: cancel task"). An injected
`ResponseData` first, for a stream that has started, goes through the flow's stream callable to the client
like any chunk: that is the error event a streaming client can read before the connection closes.

Internals used (checked on mitmproxy 11.0.2 and 12.x, the two supported lines; `tests/test_real_watch.py`
runs it on whichever one is installed): `Proxyserver.inject_event`, `Proxyserver.connections`, the layer
attributes `layer`/`child_layer`/`streams` to find the flow's stream id, and the constructor-free use of the
two event classes. `ResponseProtocolError.code` is the HTTP status on 11 and an `ErrorCode` whose
`http_status_code()` gives it on 12. Anything unexpected returns False, and the request simply goes on.
"""

from __future__ import annotations

import logging
from typing import Any

from mitmproxy import ctx, http
from mitmproxy.proxy import events
from mitmproxy.proxy.layers.http import ResponseData, ResponseProtocolError

log = logging.getLogger("slotkeeper")


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


def end_flow(flow: http.HTTPFlow, status: int, message: str, stream_event: bytes | None = None) -> bool:
    """End `flow` now: `status` + `message` when no response has reached the client, else `stream_event` (if
    given) as the stream's last chunk; then both connections close. True when the events were injected."""
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
        proxyserver.inject_event(_InjectedError(flow, sid, message, status))
        return True
    except Exception as e:  # internals moved: say so once per call, and let the request go on
        log.debug("slotkeeper: could not end a request (%s)", type(e).__name__)
        return False
