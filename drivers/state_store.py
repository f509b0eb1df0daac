"""The state file driver: one JSON file per upstream server, shared by every proxy process.

- Cross-process safety: `filelock.AsyncFileLock`, a *fresh object per acquisition* (one shared instance is
  re-entrant per instance, so two coroutines would both "hold" it: mitmproxy.md P19), plus an asyncio
  lock so coroutines of one process queue politely instead of spinning on the file.
- Atomic writes: temp file in the same directory, fsync, `os.replace`. Mode 0600, directory 0700.
- A damaged file is moved aside (`.corrupt-<time>`) and logged, never silently lost, never a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from filelock import AsyncFileLock, FileLock

from slotlogic import state as st

log = logging.getLogger("slotkeeper")
LOCK_TIMEOUT = 10.0


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "slotkeeper"


def state_file_name(upstream: str) -> str:
    """Flat, stable file name per upstream (its own slot space)."""
    safe = "".join(c if c.isalnum() else "-" for c in upstream.split("://", 1)[-1]).strip("-")[:48]
    return f"state-{safe}-{hashlib.sha256(upstream.encode()).hexdigest()[:8]}.json"


class StateStore:
    def __init__(self, directory: str | Path, upstream: str) -> None:
        self.dir = Path(directory)
        self.upstream = upstream
        self.path = self.dir / state_file_name(upstream)
        self.lock_path = str(self.path) + ".lock"
        self._locks: dict[int, asyncio.Lock] = {}

    def _local(self) -> asyncio.Lock:
        # asyncio locks bind to one loop; tests (and reloads) may run several loops in one process.
        loop_id = id(asyncio.get_running_loop())
        lock = self._locks.get(loop_id)
        if lock is None:
            lock = self._locks[loop_id] = asyncio.Lock()
        return lock

    def _ensure_dir(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(self.dir, 0o700)

    def read(self) -> st.ServerState:
        """Read without the lock (only for status views and tests); tolerant of anything."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return st.ServerState(upstream=self.upstream)
        try:
            return st.from_dict(json.loads(raw), self.upstream)
        except (ValueError, UnicodeDecodeError):
            self._quarantine()
            return st.ServerState(upstream=self.upstream)

    def _quarantine(self) -> None:
        dest = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
        with contextlib.suppress(OSError):
            os.replace(self.path, dest)
            log.warning("slotkeeper: state file %s was not valid JSON; moved aside to %s", self.path, dest)

    def write(self, state: st.ServerState) -> None:
        self._ensure_dir()
        data = json.dumps(st.to_dict(state), indent=1, sort_keys=True).encode()
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.dir)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[st.ServerState]:
        """Locked read-modify-write. The state is written back only when the body completes."""
        self._ensure_dir()
        async with self._local():
            lock = AsyncFileLock(self.lock_path, timeout=LOCK_TIMEOUT, mode=0o600)
            async with lock:
                state = self.read()
                yield state
                self.write(state)

    @contextlib.contextmanager
    def transaction_sync(self) -> Iterator[st.ServerState]:
        """Blocking variant for shutdown (`done` must stay sync: mitmproxy.md P9)."""
        self._ensure_dir()
        with FileLock(self.lock_path, timeout=LOCK_TIMEOUT, mode=0o600):
            state = self.read()
            yield state
            self.write(state)
