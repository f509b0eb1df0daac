"""Where the shared state lives: the interface every store keeps, and `Stores`, which opens the one
`slots_state_url` names for each server: files in a directory on this machine (`store_file`), or Redis/Valkey
shared by proxies anywhere (`store_redis`, one connection per proxy).

`Upstream` reaches its server's state only through `StateStore`: `transaction()` is the exclusive
read-modify-write every claim is made in (`transaction_sync()` for shutdown), `read()`/`aread()` read without
the lock, `last` is this process's last copy, `watch` hears other proxies' claims and `slot_locks` are the
paging locks shared across proxies (Redis only; None for the file store, whose proxies share a machine).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol
from urllib.parse import unquote, urlsplit

from slotlogic import shared
from slotlogic.events import Event
from slotlogic.notices import ClaimNotice

if TYPE_CHECKING:
    from slotkeeper.drivers.build_claims import BuildClaims

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


class Stores:
    """The store of each server, all from one `slots_state_url`; the Redis connection is shared by them."""

    def __init__(self, url: str, state_dir: Path, emit: Emit) -> None:
        self.kind, where = parse_url(url, state_dir)
        self.url = url
        self.state_dir = where if isinstance(where, Path) else state_dir
        self.emit = emit
        self.redis = None
        self.builds: BuildClaims | None = None  # one prefix build for all proxies: only with a shared store
        if self.kind == "redis":  # the client is imported only when used
            from slotkeeper.drivers.build_claims import BuildClaims
            from slotkeeper.drivers.store_redis import RedisConnection

            self.redis = RedisConnection(str(where), emit)
            self.builds = BuildClaims(self.redis)

    def for_server(self, upstream: str) -> StateStore:
        if self.redis is not None:
            from slotkeeper.drivers.store_redis import RedisState

            return RedisState(self.redis, upstream)
        from slotkeeper.drivers.store_file import StateFile

        return StateFile(self.state_dir, upstream, self.emit)

    def close_sync(self) -> None:
        if self.redis is not None:
            self.redis.close_sync()
