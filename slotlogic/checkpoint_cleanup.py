"""Which checkpoint files to delete from the server's --slot-save-path (seed 001's cleanup, made pure).

Rules, in order:
1. Only files named `prefix-<16 hex>.bin` are ever candidates: anything else in the directory is the
   operator's and is never touched.
2. An index that could not be read (corrupt) disables cleanup entirely: never delete against an index
   that cannot be trusted. A missing index is an empty one.
3. Keep = the current fingerprints' files ∪ files used within `ttl_days` ∪ the `keep_recent` most
   recently used (last use from the index, else the file's mtime).
4. Then, with `max_bytes` > 0, delete the oldest kept files (never a current one) until under the cap.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from slotlogic.prefix import FILE_RE

DAY = 86400.0


@dataclass(frozen=True)
class FileInfo:
    name: str
    size: int
    mtime: float


def plan_cleanup(files: Iterable[FileInfo], index: Mapping[str, Mapping[str, object]] | None, *,
                 current: set[str], now: float, ttl_days: float, keep_recent: int,
                 max_bytes: int = 0) -> list[str]:
    """Names to delete, oldest first. `index is None` means the index is corrupt: delete nothing."""
    if index is None:
        return []
    ours = [f for f in files if FILE_RE.match(f.name)]

    def last_used(f: FileInfo) -> float:
        entry = index.get(f.name)
        value = entry.get("last_used") if isinstance(entry, Mapping) else None
        return float(value) if isinstance(value, int | float) else f.mtime

    by_recency = sorted(ours, key=last_used, reverse=True)
    recent = {f.name for f in by_recency[:max(keep_recent, 0)]}
    keep = [f for f in by_recency
            if f.name in current or f.name in recent or now - last_used(f) < ttl_days * DAY]
    kept_names = {f.name for f in keep}
    delete = [f for f in by_recency if f.name not in kept_names]
    if max_bytes > 0:
        total = sum(f.size for f in keep)
        for f in sorted(keep, key=last_used):  # oldest first
            if total <= max_bytes:
                break
            if f.name in current:
                continue
            delete.append(f)
            total -= f.size
    return [f.name for f in sorted(delete, key=last_used)]
