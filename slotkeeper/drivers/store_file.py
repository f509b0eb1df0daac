"""Private JSON files shared by every proxy process on this machine: the per-server state and the checkpoint
index.

A fresh `filelock.AsyncFileLock` per acquisition (one instance is re-entrant, so two coroutines would both
"hold" it) plus an asyncio lock; atomic writes (temp file, `os.replace`), fsync-ed for the index but not for
the state (it cost ~12 ms of every new session's transaction; a lost write costs a re-placement); files 0600
in a checked private dir; a damaged or oversized file is moved aside and logged, never lost or a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import os
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from filelock import AsyncFileLock, FileLock

from slotkeeper.drivers import private_dir
from slotlogic import shared
from slotlogic.events import CorruptMovedAside, Event
from slotlogic.notices import ClaimNotice

LOCK_TIMEOUT = 10.0
MAX_BYTES = 64 << 20  # far above any state we write (50k sessions are a few MB); a larger file is corrupt
Emit = Callable[[Event], None]


def _drop(_: Event) -> None:
    pass


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "slotkeeper"


def state_file_name(upstream: str) -> str:
    """Flat, stable file name per upstream (its own slot space). Only host and port are shown; a path (a
    llama-swap model's `/upstream/<model>`, a name from a request body) is in the digest alone."""
    host = upstream.split("://", 1)[-1].split("/", 1)[0]
    safe = "".join(c if c.isalnum() else "-" for c in host).strip("-")[:48]
    return f"state-{safe}-{hashlib.sha256(upstream.encode()).hexdigest()[:8]}.json"


class CorruptFile(ValueError):
    """The file exists but is not valid JSON (it has been moved aside)."""


def parse(raw: bytes) -> Any:
    """A state document from its bytes; CorruptFile for anything that is not JSON, nesting too deep for the
    parser included (a `RecursionError` is corrupt, not a crash: every new session failed on one)."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise CorruptFile("not JSON") from None


def read_document(path: str | Path) -> Any:
    """The JSON document in `path` (FileNotFoundError when missing); CorruptFile when it does not parse or is
    larger than MAX_BYTES, which is never read (a 1 GB sparse file cost 1.28 GB of memory before). Never through
    a symlink, and only a regular file (a FIFO would block the reading thread: `private_dir.open_regular`)."""
    try:
        fd = private_dir.open_regular(path)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.EINVAL):
            raise
        raise CorruptFile("a symlink, or not a regular file") from None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_BYTES + 1) if os.fstat(f.fileno()).st_size <= MAX_BYTES else b""
    if not raw or len(raw) > MAX_BYTES:
        raise CorruptFile("empty, or larger than MAX_BYTES")
    return parse(raw)


class JsonFile:
    """One locked, atomically written, private JSON document."""

    def __init__(self, path: str | Path, emit: Emit = _drop, *, compact: bool = False) -> None:
        self.path = Path(path)
        self.emit = emit
        self.compact = compact  # no indentation, no fsync: the state file is read and written on every new session
        self.dir = self.path.parent
        self.lock_path = str(self.path) + ".lock"
        self._locks: dict[int, asyncio.Lock] = {}

    def _local(self) -> asyncio.Lock:
        # asyncio locks bind to one loop; tests (and reloads) may run several loops in one process.
        loop_id = id(asyncio.get_running_loop())
        lock = self._locks.get(loop_id)
        if lock is None:
            lock = self._locks[loop_id] = asyncio.Lock()
        return lock

    def ensure_dir(self) -> None:
        """Create the directory 0700 when missing (raises private_dir.UnsafeDir for one others can write);
        the first time in this process, also remove stale temp files of interrupted writes."""
        if not os.path.isdir(self.dir):
            private_dir.ensure(self.dir)
        private_dir.sweep_stale_tmp(self.dir)

    def load(self) -> Any:
        """The document, None when missing; raises CorruptFile (after moving it aside) when damaged."""
        try:
            return read_document(self.path)
        except FileNotFoundError:
            return None
        except CorruptFile:
            self._move_aside()
            raise

    def _move_aside(self) -> None:
        dest = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
        with contextlib.suppress(OSError):
            os.replace(self.path, dest)
        self.emit(CorruptMovedAside("", str(self.path), str(dest)))

    def save(self, data: Any) -> None:
        self.ensure_dir()
        raw = (json.dumps(data, separators=(",", ":")) if self.compact
               else json.dumps(data, indent=1, sort_keys=True)).encode()
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.dir)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
                if not self.compact:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @contextlib.asynccontextmanager
    async def locked(self) -> AsyncIterator[None]:
        self.ensure_dir()
        async with self._local(), AsyncFileLock(self.lock_path, timeout=LOCK_TIMEOUT, mode=0o600):
            yield

    @contextlib.contextmanager
    def locked_sync(self) -> Iterator[None]:
        """Blocking variant for shutdown (`done` must stay sync: docs/mitmproxy.md)."""
        self.ensure_dir()
        with FileLock(self.lock_path, timeout=LOCK_TIMEOUT, mode=0o600):
            yield


class StateFile:
    """The per-upstream `ServerState`, read and written under the file lock."""

    remote = False
    slot_locks = None  # the processes of one machine page under their own locks, as before

    def __init__(self, directory: str | Path, upstream: str, emit: Emit = _drop) -> None:
        self.upstream = upstream
        self.file = JsonFile(Path(directory) / state_file_name(upstream), emit, compact=True)
        self.last = shared.ServerState(upstream=upstream)  # as of the last transaction: for sync views
        self.dir, self.path = self.file.dir, self.file.path
        self._seen: tuple[tuple[int, int, int], shared.ServerState] | None = None  # (file's stamp, its state)
        self._held = False  # a transaction holds the lock, suspended on the event loop (shutdown goes on under it)
        self._superseded = False  # the shutdown flush wrote meanwhile: the suspended transaction must not

    def _stamp(self) -> tuple[int, int, int] | None:
        """The file's inode, size and mtime: every write replaces the file, so a new inode is a new state."""
        return file_stamp(self.path)

    async def fresh(self) -> shared.ServerState:
        """The state as it is now, without reading it when the file is the one this process last read or
        wrote (a `stat`; the slow path asks this at a placement's turn). Read-only: never change what it gives."""
        stamp = self._stamp()
        if stamp is not None and self._seen is not None and self._seen[0] == stamp:
            return self._seen[1]
        state = await self.aread()
        if stamp is not None and self._stamp() == stamp:  # unchanged while it was read
            self._seen = (stamp, state)
        return state

    def read(self) -> shared.ServerState:
        """Read without the lock (status views, the hash fallback); tolerant of anything."""
        try:
            return shared.from_dict(self.file.load(), self.upstream)
        except CorruptFile:
            return shared.ServerState(upstream=self.upstream)

    async def aread(self) -> shared.ServerState:
        """`read` in a worker thread (the `slotkeeper.drivers.store.StateStore` interface)."""
        return await asyncio.to_thread(self.read)

    def watch(self, on_claim: Callable[[ClaimNotice], None]) -> None:
        """Nothing to watch: the proxies sharing a file are on one machine, and its reconcile covers them."""

    def write(self, state: shared.ServerState) -> None:
        self.file.save(shared.to_dict(state))

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[shared.ServerState]:
        """Locked read-modify-write. The state is written back only when the body completes.

        The file I/O (and its fsync) runs in a worker thread: a slow disk must never stall other flows."""
        async with self.file.locked():
            self._held = True
            try:
                state = await asyncio.to_thread(self.read)
                yield state
                if self._superseded:  # the shutdown flush wrote a newer state under this lock meanwhile
                    return
                await asyncio.to_thread(self.write, state)
                self.last = state
                stamp = self._stamp()  # still under the lock: nobody else wrote since
                self._seen = (stamp, state) if stamp else None
            finally:
                self._held = False

    @contextlib.contextmanager
    def transaction_sync(self) -> Iterator[shared.ServerState]:
        """At shutdown (`done`, sync, on the event loop). A transaction of this process suspended on that loop
        holds the lock and cannot run to let go: waiting would wait out the whole timeout, so the flush goes on
        under the lock it holds, and that transaction writes nothing when it resumes."""
        held = self._held
        with contextlib.nullcontext() if held else self.file.locked_sync():
            state = self.read()
            yield state
            self.write(state)
            self.last = state
            self._superseded = held


def file_stamp(path: str | Path) -> tuple[int, int, int] | None:
    """A file's inode, size and mtime (None: not there): a file replaced or rewritten has another stamp."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns
