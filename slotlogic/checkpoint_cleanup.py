"""Which checkpoint files to delete from the server's --slot-save-path (pure).

Only `prefix-<16 hex>.bin` files are candidates (the rest is the operator's); a corrupt index disables
deletion. Kept: the current fingerprints' files, those used within `ttl_days` and the `keep_recent` newest;
then, with a cap, the least recently used go until the rest and an incoming file fit (`make_room`), never one
in use. docs/checkpoints.md.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from slotlogic.prefix import FILE_RE

DAY = 86400.0
AUTO_SHARE = 4  # the default cap: a quarter of the page budget (the two share one save dir)


@dataclass(frozen=True)
class FileInfo:
    name: str
    size: int
    mtime: float


def default_cap(page_max_bytes: int) -> int:
    """The checkpoint cap when none is set: a quarter of the page budget (2 GB of the default 8 GB), so pages
    and prefix checkpoints together stay within 1.25 times what the operator sized the save dir for."""
    return max(page_max_bytes // AUTO_SHARE, 1)


def _last_used(index: Mapping[str, Mapping[str, object]] | None, f: FileInfo) -> float:
    entry = index.get(f.name) if index is not None else None
    value = entry.get("last_used") if isinstance(entry, Mapping) else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else f.mtime


def make_room(files: Iterable[FileInfo], index: Mapping[str, Mapping[str, object]] | None, *, max_bytes: int,
              incoming: int = 0, protect: Collection[str] = ()) -> tuple[list[str], bool]:
    """The least recently used prefix files to delete so that the rest, plus `incoming` bytes about to be
    written, fit `max_bytes` (never one in `protect`: in use now), and whether they then fit. `max_bytes` ≤ 0:
    no cap. A corrupt index (None) deletes nothing: it only says whether the new file fits as things are."""
    ours = [f for f in files if FILE_RE.match(f.name)]
    if max_bytes <= 0:
        return [], True
    total = sum(f.size for f in ours) + max(incoming, 0)
    doomed: list[str] = []
    if index is not None:
        for f in sorted(ours, key=lambda f: (_last_used(index, f), f.name)):  # least recently used first
            if total <= max_bytes:
                break
            if f.name in protect:
                continue
            doomed.append(f.name)
            total -= f.size
    return doomed, total <= max_bytes


def plan_cleanup(files: Iterable[FileInfo], index: Mapping[str, Mapping[str, object]] | None, *,
                 current: set[str], now: float, ttl_days: float, keep_recent: int,
                 max_bytes: int = 0, protect: Collection[str] | None = None) -> list[str]:
    """Names to delete, oldest first. `index is None` means the index is corrupt: delete nothing. `protect`:
    files the cap never takes (in use now; the current fingerprints' when not given)."""
    if index is None:
        return []
    ours = [f for f in files if FILE_RE.match(f.name)]
    by_recency = sorted(ours, key=lambda f: _last_used(index, f), reverse=True)
    recent = {f.name for f in by_recency[:max(keep_recent, 0)]}
    keep = [f for f in by_recency
            if f.name in current or f.name in recent or now - _last_used(index, f) < ttl_days * DAY]
    kept_names = {f.name for f in keep}
    delete = [f.name for f in by_recency if f.name not in kept_names]
    capped, _ = make_room(keep, index, max_bytes=max_bytes, protect=current if protect is None else protect)
    by_name = {f.name: f for f in ours}
    return sorted(delete + capped, key=lambda n: _last_used(index, by_name[n]))
