"""The stream callables set in `responseheaders`: observe SSE events and pass the stream on, chunk by chunk.

mitmproxy calls them synchronously on the event loop for every chunk as it arrives, and once more with b""
at the end. An exception inside would make mitmproxy drop that chunk (docs/mitmproxy.md), so nothing
escapes: a failing part is switched off and the stream goes on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from slotlogic.answers import StreamObserver
from slotlogic.anthropic_answer import StreamConverter
from slotlogic.verbose import VerboseStripper

CONVERT_ERROR = (b'event: error\ndata: {"type":"error","error":{"type":"api_error",'
                 b'"message":"slotkeeper could not convert the answer"}}\n\n')


def nothing_yet(chunk: bytes, sent: bytes) -> bytes | list[bytes]:
    """What to hand mitmproxy for a chunk: no chunks at all (`[]`) when a chunk that arrived gives the client
    nothing yet (an SSE comment such as llama-server's `:` keep-alive every 30 s of a long prefill, or part of
    an event): mitmproxy writes a returned b"" as a zero-length chunk, which ends a chunked body for the
    client (the translated stream of a slow first request was cut there, and Claude Code fell back to a
    request without streaming)."""
    return sent if sent or not chunk else []


class SSETap:
    """Returns every chunk unchanged. With `keep` set, a copy of what the client received is handed to `keep`
    at the end of the stream, so `-w` recordings, mitmweb and server replay have it on mitmproxy 11 (12.x has
    `store_streamed_bodies` for this). `on_error` gets (part, exception type name) once per failing part.

    `strip` (affinity's pending requests only, `slotlogic.verbose`): the observer reads every byte as the
    server sent it, the client gets the stream without the `__verbose` member the proxy asked for. If the
    stripper fails, it is switched off and what it held goes out with the chunk: no byte is ever lost."""

    def __init__(self, observer: StreamObserver, keep: Callable[[bytes], None] | None = None, *,
                 on_error: Callable[[str, str], None] | None = None, max_copy: int = 16 << 20,
                 strip: VerboseStripper | None = None) -> None:
        self.observer = observer
        self.failed = False
        self.keep = keep
        self.on_error = on_error
        self.copy: bytearray | None = bytearray() if keep else None
        self.max_copy = max_copy
        self.strip = strip
        self.tail = b""                      # the last bytes the client got: is it between two events?
        self._closing: bytes | None = None   # the proxy's own last event, passed on as it is

    def closing(self, event: bytes, message: str) -> bytes:
        """The proxy ends this stream with its own error `event` (the watchdog): what to inject so that it
        arrives as an event of its own, after the blank line the event the client was receiving lacks (cut
        inside an event, it was glued onto the unfinished line). `message` is for a translated stream."""
        del message
        if self.tail and not self.tail.endswith((b"\n\n", b"\r\n\r\n")):
            event = (b"\n" if self.tail.endswith(b"\n") else b"\n\n") + event
        self._closing = event
        return event

    def _injected(self, chunk: bytes) -> bool:
        """The chunk is the proxy's own closing event: observed (the log says why the answer ended), and sent
        to the client untouched."""
        if self._closing is None or chunk != self._closing:
            return False
        self._closing = None
        self._observe(chunk)
        self._keep(chunk, chunk)
        return True

    def _sent(self, sent: bytes) -> bytes:
        self.tail = (self.tail + sent)[-4:] if sent else self.tail
        return sent

    def __call__(self, chunk: bytes) -> bytes | list[bytes]:
        if self._injected(chunk):
            return chunk
        self._observe(chunk)
        sent = self._sent(chunk if self.strip is None else self._strip(chunk))
        self._keep(chunk, sent)
        return nothing_yet(chunk, sent)

    def _strip(self, chunk: bytes) -> bytes:
        assert self.strip is not None
        try:
            return self.strip.feed(chunk)
        except Exception as e:
            held, self.strip = self.strip.held, None
            self._error("strip", e)
            return held + chunk

    def finish(self) -> None:
        """The stream ended early (the client or the server went away): hand over what was kept so far."""
        if self.copy is not None and self.keep is not None:
            try:
                self.keep(bytes(self.copy))
            except Exception as e:
                self._error("copy", e)
            self.copy = None

    def _observe(self, chunk: bytes) -> None:
        if not self.failed:
            try:
                self.observer.feed(chunk)
            except Exception as e:
                self.failed = True
                self._error("observer", e)

    def _keep(self, chunk: bytes, sent: bytes) -> None:
        if self.copy is None:
            return
        try:
            if sent and len(self.copy) + len(sent) <= self.max_copy:
                self.copy += sent
            if not chunk and self.keep is not None:
                self.keep(bytes(self.copy))
                self.copy = None
        except Exception as e:
            self.copy = None
            self._error("copy", e)

    def _error(self, part: str, e: Exception) -> None:
        if self.on_error is not None:
            with contextlib.suppress(Exception):  # nothing may escape the stream callable
                self.on_error(part, type(e).__name__)


class TranslatingTap(SSETap):
    """The stream callable of a translated Anthropic request: observes the chat route's events as `SSETap`
    does and returns, for each event as soon as it is complete, what the native `/v1/messages` route would
    have sent. If the conversion ever fails, the client gets one Anthropic error event and nothing more."""

    def __init__(self, observer: StreamObserver, converter: StreamConverter,
                 keep: Callable[[bytes], None] | None = None, *,
                 on_error: Callable[[str, str], None] | None = None, max_copy: int = 16 << 20) -> None:
        super().__init__(observer, keep, on_error=on_error, max_copy=max_copy)
        self.converter = converter
        self.broken = False

    def __call__(self, chunk: bytes) -> bytes | list[bytes]:
        if self._injected(chunk):
            return chunk
        self._observe(chunk)
        sent = self._convert(chunk)
        self._keep(chunk, sent)
        return nothing_yet(chunk, sent)

    def closing(self, event: bytes, message: str) -> bytes:
        """The client's stream is always between two Anthropic events here: it ends with Anthropic's error
        event (the chat one `event` would be held as an unfinished line when the cut came inside an event)."""
        del event
        if self.broken or self.converter.finished:
            return b""   # the client already had its last event
        self._closing = self.converter.fail(message, "timeout_error", why="deadline")
        return self._closing

    def _convert(self, chunk: bytes) -> bytes:
        if self.broken:
            return b""
        try:
            sent = self.converter.feed(chunk) if chunk else self.converter.close()
            if self.converter.failed and not self.observer.obs.error_type:
                self.observer.obs.error_type = self.converter.failed  # the client got an error event: logged
            return sent
        except Exception as e:
            self.broken = True
            self._error("convert", e)
            return CONVERT_ERROR
