"""Where the shared state lives: the interface every store keeps (`slotkeeper.drivers.stores` opens the named one).

`Upstream` reaches its server's state only through `StateStore`: `transaction()` is the exclusive
read-modify-write every claim is made in (`transaction_sync()` for shutdown), `read()`/`aread()` read without
the lock, `last` is this process's last copy, `watch` hears other proxies' claims and `slot_locks` are the
paging locks shared across proxies (Redis only; None for the file store, whose proxies share a machine).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlsplit

from slotlogic import shared
from slotlogic.events import Event
from slotlogic.notices import ClaimNotice

Emit = Callable[[Event], None]
SCHEMES = ("file", "redis", "rediss")
BUILT = "built"  # a shared store's prefix-build marker once its build saved the file (slotkeeper.drivers.store_redis)


class SlotLocks(Protocol):
    async def hold(self, slot: int, token: str, wait: float = ...) -> tuple[bool, tuple[str, float] | None]: ...

    async def let_go(self, slot: int, token: str, session: str | None, at: float) -> None: ...


class StateStore(Protocol):
    last: shared.ServerState
    remote: bool   # shared beyond this machine (other proxies' use of a slot is learned from it)
    slot_locks: SlotLocks | None

    def transaction(self) -> contextlib.AbstractAsyncContextManager[shared.ServerState]: ...

    def transaction_sync(self) -> contextlib.AbstractContextManager[shared.ServerState]: ...

    def read(self) -> shared.ServerState: ...

    async def aread(self) -> shared.ServerState: ...

    async def fresh(self) -> shared.ServerState:
        """The state as it is now (what the last read or transaction saw, when nothing changed it since)."""
        ...

    def watch(self, on_claim: Callable[[ClaimNotice], None]) -> None: ...


def parse_url(url: str, default_dir: Path) -> tuple[str, Path | str]:
    """("file", directory) or ("redis", url); ValueError names what is wrong (never the password)."""
    if not url:
        return "file", default_dir
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"the scheme must be one of {', '.join(s + '://' for s in SCHEMES)}")
    if parts.scheme == "file":
        path = unquote(parts.path or "")
        if parts.netloc and parts.netloc != "localhost":
            path = "/" + parts.netloc + path  # file://relative/dir is a common slip: take it as written
        if not path:
            raise ValueError("file:// needs a directory")
        return "file", Path(path).expanduser()
    if not parts.hostname:
        raise ValueError("redis:// needs a host")
    return "redis", url


def redacted(url: str) -> str:
    """The URL as a log line may show it: scheme, host, port and db, never the credentials."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"
