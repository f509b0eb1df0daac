"""The proxy's own private directories (the state dir): created 0700, checked when they already exist.

Why: the state dir holds digests, claims and page records other local users must not read or change. A
directory we create is made 0700 through an O_NOFOLLOW descriptor; an existing one is never chmod-ed (that
once made `/tmp` private) but refused (`UnsafeDir`) unless ours and closed to others; our own stale temp files
are removed once; a file opened by name is used only when it is a regular file, so a planted link or FIFO
neither redirects our writes nor hangs a thread. docs/reliability.md lists each case.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import time
from pathlib import Path

STALE_TMP_SECONDS = 60.0  # a write takes milliseconds; an older temp file is a crash's left-over
TMP_RE = re.compile(r"^(state-[A-Za-z0-9-]*-[0-9a-f]{8}\.json|checkpoints\.json)\.[A-Za-z0-9_]+\.tmp$")
_swept: set[str] = set()


class UnsafeDir(ValueError):
    """A directory the proxy must not use for private files (the message names the path and the fix)."""


def check(path: str | Path) -> None:
    """Raise UnsafeDir unless `path` is missing (it will be created 0700) or a directory we own that
    nobody else can write to. A symlink to such a directory is fine: only its target's mode matters."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise UnsafeDir(f"{path}: cannot be inspected ({type(e).__name__})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDir(f"{path} is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeDir(f"{path} belongs to another user (uid {st.st_uid}); use a directory of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDir(f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o}); use a private "
                        f"directory, or chmod go-w it yourself")


def open_regular(path: str | Path, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """A file descriptor of the regular file at `path` (`flags`: e.g. O_WRONLY | O_APPEND | O_CREAT), opened with
    O_NOFOLLOW and O_NONBLOCK: OSError(ELOOP) for a symlink, OSError(EINVAL) for anything not a regular file."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def ensure(path: str | Path) -> bool:
    """Make sure `path` is a usable private directory; True when this call created it. Raises UnsafeDir."""
    p = Path(path)
    created = False
    missing = []
    for parent in (p, *p.parents):
        if os.path.lexists(parent):
            break
        missing.append(parent)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue  # another process was quicker: checked below like any existing directory
        _private(d)
        created = True
    check(p)
    return created


def _private(d: Path) -> None:
    """0700 on a directory this process has just created, never through a symlink."""
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def sweep_stale_tmp(path: str | Path, now: float | None = None) -> list[str]:
    """Remove our own temp files older than STALE_TMP_SECONDS (once per directory per process)."""
    key = os.path.abspath(path)
    if key in _swept:
        return []
    _swept.add(key)
    now = time.time() if now is None else now
    gone = []
    with contextlib.suppress(OSError), os.scandir(path) as entries:
        for entry in entries:
            if not TMP_RE.match(entry.name) or not entry.is_file(follow_symlinks=False):
                continue
            with contextlib.suppress(OSError):
                if now - entry.stat(follow_symlinks=False).st_mtime >= STALE_TMP_SECONDS:
                    os.unlink(entry.path)
                    gone.append(entry.name)
    return gone
