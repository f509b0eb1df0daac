"""Where the shared state lives: the interface every store keeps (`slotkeeper.drivers.stores` opens the named one).

`slotkeeper.drivers.upstream.Upstream` talks to its server's state through `StateStore` only:
- `transaction()`: an exclusive read-modify-write of the server's `ServerState` (the claim of a slot is made
  inside one, so two proxies never claim the same slot at once); the state is written back when the body
  completes;
- `aread()` / `read()`: a read without the lock (status views, the hash fallback); `read()` may answer from
  memory where a read would need the network;
- `last`: the state as of this process's last transaction (sync views, commands);
- `transaction_sync()`: the blocking variant for shutdown (mitmproxy's `done` must stay sync);
- `watch(on_claim)`: other proxies' claims on the server's slots, as they are made (Redis: pub/sub notices,
  `slotlogic/notices.py`; the file store calls nothing: the proxies of one machine keep its own reconcile);
- `slot_locks`: each slot's paging lock shared by every proxy, with the slot's last paged send (Redis); None
  for the file store (each process pages under its own locks, as before).

`file://DIR` (the default: `slots_state_dir`) is `slotkeeper.drivers.store_file.StateFile`: one locked JSON file per
server, shared by the proxies of one machine. `redis://host:port/db` and `rediss://…` is
`slotkeeper.drivers.store_redis.RedisState`: one document per server in Redis or Valkey, shared by proxies anywhere.
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
