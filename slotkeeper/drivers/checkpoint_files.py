"""The save dir's prefix checkpoint files under their cap (`slots_checkpoint_max_mb`), for `CheckpointRunner`.

The cap holds at every moment: before a save the least recently used files go to make room for it (its size:
the warmed tokens at the measured KV bytes per token), the saves in flight of the pool's servers counted, and a
file that cannot fit is not saved (the prefix stays warm in its slot only). The count and the room are made
under the pool's `PrefixRegistry.room` lock, in worker threads only, waited for at most `ROOM_WAIT` seconds.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING

from slotlogic import checkpoint_cleanup
from slotlogic import prefix as pfx
from slotlogic.events import CheckpointIndexCorrupt, Failed, FilesDeleted, Stage

if TYPE_CHECKING:
    from slotkeeper.drivers.checkpoint_runner import CheckpointRunner

ROOM_WAIT = 10.0  # seconds a save waits to count the save dir (another save's count); then it is not made


def _files(cp: CheckpointRunner) -> list[checkpoint_cleanup.FileInfo]:
    """The save dir's prefix files (regular files only: a symlink is neither counted nor followed)."""
    files = []
    with contextlib.suppress(OSError), os.scandir(cp.settings.save_dir or ".") as entries:
        for entry in entries:
            if pfx.FILE_RE.match(entry.name) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    files.append(checkpoint_cleanup.FileInfo(entry.name, st.st_size, st.st_mtime))
    return files


def cleanup(cp: CheckpointRunner, saved: str | None = None) -> list[str]:
    """Delete stale `prefix-*.bin` files from the save dir, and the least recently used beyond the cap (see
    slotlogic.checkpoint_cleanup); `saved`, a file just written, too when it alone is over the cap."""
    s = cp.settings
    if not s.save_dir or not os.path.isdir(s.save_dir):
        return []
    index = cp.read_index()
    if index is None:
        cp.emit(CheckpointIndexCorrupt(cp.upstream, str(cp.index.path)))
        return []
    if not cp.registry.room.acquire(timeout=ROOM_WAIT):
        return []
    try:
        doomed = checkpoint_cleanup.plan_cleanup(_files(cp), index, current=cp.current, now=time.time(),
                                                 ttl_days=s.checkpoint_ttl_days, keep_recent=s.checkpoint_keep,
                                                 max_bytes=s.checkpoint_max_bytes, protect=_in_use(cp) - {saved})
        _delete(cp, doomed)
    finally:
        cp.registry.room.release()
    return doomed


def make_room(cp: CheckpointRunner, tokens: int, name: str) -> bool:
    """Make room under the cap for `tokens` about to be saved as `name` (the file it replaces does not count),
    the other saves in flight counted; whether it fits (then its bytes are reserved until its `prepare` ends).
    Its size: the measured KV bytes per token, else the most any indexed file took a token, else the largest
    prefix file there; with none known, it is the only save in flight or none. Worker thread."""
    if not cp.settings.save_dir or not os.path.isdir(cp.settings.save_dir):
        return True
    reg = cp.registry
    if not reg.room.acquire(timeout=ROOM_WAIT):
        return False
    try:
        files, index = _files(cp), cp.read_index()
        others = [f for f in files if f.name != name]
        per_token = cp.rates().kv_bytes_per_token or max(
            (f.size / e["n_saved"] for f in others if isinstance(e := (index or {}).get(f.name), dict)
             and isinstance(e.get("n_saved"), int) and e["n_saved"] > 0), default=0.0)
        incoming = int(tokens * per_token) if per_token else max((f.size for f in others), default=0)
        pending = [v for k, v in reg.reserved.items() if k != name]
        if not incoming and pending:
            return False  # a size no file tells yet: one such save at a time
        doomed, fits = checkpoint_cleanup.make_room(others, index, max_bytes=cp.settings.checkpoint_max_bytes,
                                                    incoming=incoming + sum(pending), protect=_in_use(cp))
        _delete(cp, doomed)
        if fits:
            reg.reserved[name] = incoming
        return fits
    finally:
        reg.room.release()


def _in_use(cp: CheckpointRunner) -> frozenset[str]:
    """Files being built or restored now (by any server of the pool): never taken by the cap."""
    return frozenset(cp.building)


def _delete(cp: CheckpointRunner, doomed: list[str]) -> None:
    s = cp.settings
    for name in doomed:
        try:
            os.unlink(os.path.join(s.save_dir or ".", name))
        except OSError as e:
            cp.emit(Failed(cp.upstream, Stage.DELETE, type(e).__name__))
    if doomed:
        cp.emit(FilesDeleted(cp.upstream, "prefix-cache cleanup", tuple(doomed)))
        with cp.index.locked_sync():
            data = cp.read_index() or {}
            for name in doomed:
                data.pop(name, None)
            cp.index.save(data)
