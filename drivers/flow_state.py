"""Per-flow bookkeeping between mitmproxy hooks, and the SSE stream tap.

Kept out of `addon.py` because mitmproxy loads scripts under a module name that is not in `sys.modules`,
which breaks dataclasses defined in the script itself; and because none of it needs mitmproxy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from slotlogic import core
from slotlogic.observe import StreamObserver

log = logging.getLogger("slotkeeper")


@dataclass
class FlowInfo:
    """Per-flow facts kept between hooks (live objects stay here, not in flow.metadata: pitfall P17)."""

    plan: core.Plan
    upstream: str
    started: float
    slot: int | None = None
    reason: str = ""
    stream: StreamObserver | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class SSETap:
    """The stream callable: observes SSE events and returns every chunk unchanged (never breaks a stream)."""

    def __init__(self, observer: StreamObserver) -> None:
        self.observer = observer
        self.failed = False

    def __call__(self, chunk: bytes) -> bytes:
        if not self.failed:
            try:
                self.observer.feed(chunk)
            except Exception as e:  # an exception here would drop the chunk (pitfall P2)
                self.failed = True
                log.warning("slotkeeper: SSE observer failed (%r); the stream continues unobserved", e)
        return chunk
