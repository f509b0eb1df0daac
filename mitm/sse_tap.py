"""The stream callable set in `responseheaders`: observes SSE events and returns every chunk unchanged.

mitmproxy calls it synchronously on the event loop for every chunk as it arrives, and once more with b""
at the end. An exception inside it would make mitmproxy drop that chunk (docs/mitmproxy.md), so nothing
escapes: a failing observer is switched off and the stream goes on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from slotlogic.answers import StreamObserver


class SSETap:
    """With `keep` set, a copy of the body is handed to `keep` at the end of the stream, so `-w` recordings,
    mitmweb and server replay have it on mitmproxy 11 (12.x has `store_streamed_bodies` for this).
    `on_error` gets the exception's type name once per failing part."""

    def __init__(self, observer: StreamObserver, keep: Callable[[bytes], None] | None = None, *,
                 on_error: Callable[[str, str], None] | None = None, max_copy: int = 16 << 20) -> None:
        self.observer = observer
        self.failed = False
        self.keep = keep
        self.on_error = on_error
        self.copy: bytearray | None = bytearray() if keep else None
        self.max_copy = max_copy

    def __call__(self, chunk: bytes) -> bytes:
        if not self.failed:
            try:
                self.observer.feed(chunk)
            except Exception as e:
                self.failed = True
                self._error("observer", e)
        if self.copy is not None:
            try:
                if chunk:
                    if len(self.copy) + len(chunk) <= self.max_copy:
                        self.copy += chunk
                elif self.keep is not None:
                    self.keep(bytes(self.copy))
                    self.copy = None
            except Exception as e:
                self.copy = None
                self._error("copy", e)
        return chunk

    def _error(self, part: str, e: Exception) -> None:
        if self.on_error is not None:
            with contextlib.suppress(Exception):  # nothing may escape the stream callable
                self.on_error(part, type(e).__name__)
