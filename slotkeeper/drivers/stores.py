"""The state store of each server, all opened from one `slots_state_url`: files in a directory on this
machine (`store_file`), or Redis/Valkey shared by proxies anywhere (`store_redis`). The Redis
connection is one per proxy, shared by its servers' stores and their prefix-build markers."""

from __future__ import annotations

from pathlib import Path

from slotkeeper.drivers.build_claims import BuildClaims
from slotkeeper.drivers.store import Emit, StateStore, parse_url


class Stores:
    """The store of each server, all from one `slots_state_url`; the Redis connection is shared by them."""

    def __init__(self, url: str, state_dir: Path, emit: Emit) -> None:
        self.kind, where = parse_url(url, state_dir)
        self.url = url
        self.state_dir = where if isinstance(where, Path) else state_dir
        self.emit = emit
        self.redis = None
        self.builds: BuildClaims | None = None  # one prefix build for all proxies: only with a shared store
        if self.kind == "redis":
            from slotkeeper.drivers.store_redis import RedisConnection  # the client is imported only when used

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
