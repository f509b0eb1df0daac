"""The JSONL log file (`slots_log_file`): one JSON object per line, written off the event loop, size-capped.

Records are buffered in memory and written together by a worker thread a moment later, so a request never
waits for the disk. When the file passes its cap it is renamed to `<file>.1` (replacing an older one) and a
new file starts, so the log never grows without bound. The file is created 0600: it holds session hashes,
slot numbers and counts, which are nobody else's business; and it is opened without following a symlink, and
only when it is a regular file (`private_dir.open_regular`): a link planted under its name gets nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from slotkeeper.drivers import private_dir

FLUSH_DELAY = 0.2


class JsonlLog:
    def __init__(self, path: str, max_bytes: int, on_error: Callable[[str], None]) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.on_error = on_error
        self.pending: list[str] = []
        self._scheduled = False
        self._lock = threading.Lock()  # a flush in a worker thread and the final one at shutdown
        self._failed = False

    def write(self, record: dict[str, Any]) -> None:
        self.pending.append(json.dumps({"t": time.time(), **record}) + "\n")
        if self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (shutdown, a test): write now
            self.flush()
            return
        self._scheduled = True
        loop.call_later(FLUSH_DELAY, self._flush_soon, loop)

    def _flush_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        self._scheduled = False
        lines, self.pending = self.pending, []
        if lines:
            loop.run_in_executor(None, self._write, lines)

    def flush(self) -> None:
        lines, self.pending = self.pending, []
        if lines:
            self._write(lines)

    def _write(self, lines: list[str]) -> None:
        data = "".join(lines).encode()
        with self._lock:
            try:
                with contextlib.suppress(FileNotFoundError):
                    if os.lstat(self.path).st_size + len(data) > self.max_bytes:
                        os.replace(self.path, self.path + ".1")
                fd = private_dir.open_regular(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
                with os.fdopen(fd, "ab") as f:
                    f.write(data)
                self._failed = False
            except OSError as e:
                if not self._failed:  # one line per outage, not one per request
                    self._failed = True
                    self.on_error(type(e).__name__)
