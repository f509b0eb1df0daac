"""One prefix checkpoint build for all the proxies that share a Redis store (docs/scale-out.md).

Otherwise every proxy would prefill the same prefix cold once. Before a new session's slot is warmed, `claim`
asks the store: nobody builds it (this proxy claims the marker, builds, and `finish` marks it built or lets it
go), another proxy is building it (the runner waits, at most `BUILD_WAIT`, then restores), or it is built (the
runner restores it first and warms only if that fails). With the store down each proxy builds locally. Only
file names (hashes) and random tokens reach the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import Protocol

from slotkeeper.drivers.checkpoint_runner import CheckpointRunner
from slotkeeper.drivers.store import BUILT
from slotlogic import prefix as pfx
from slotlogic.server import ServerInfo

BUILD_WAIT = 120.0  # the longest wait for other proxies' prefix build (a checkpoint step's time-out)
POLL = 0.25         # seconds between looks at another proxy's build marker


class BuildStore(Protocol):
    """What a shared store offers for builds (`slotkeeper.drivers.store_redis.RedisConnection`)."""

    async def claim_build(self, name: str, token: str) -> bool | None: ...

    async def build_owner(self, name: str) -> str | None: ...

    async def finish_build(self, name: str, token: str, saved: bool) -> None: ...


@dataclass(frozen=True, slots=True)
class Claim:
    """A build this proxy claimed: the file and the marker's token (only its holder may change it)."""

    name: str
    token: str


class BuildClaims:
    """The build markers of one proxy process (one per Redis connection, shared by all its servers)."""

    def __init__(self, store: BuildStore) -> None:
        self.store = store
        self.process = uuid.uuid4().hex[:12]   # this proxy process, in its tokens
        self.claims: dict[str, str] = {}       # file -> token of the builds this process claimed
        self._waits: set[asyncio.Task[None]] = set()

    def _ours(self, owner: str) -> bool:
        return owner.startswith(self.process + ":")

    async def claim(self, cp: CheckpointRunner, stable: pfx.StablePrefix, info: ServerInfo) -> Claim | None:
        """A `Claim` when this proxy builds the file; None when it need not (built or being built here, on
        disk already, built or being built by another proxy: the runner then restores it), or when the store
        cannot say (fail open: build locally). Never raises."""
        if not cp.persist:
            return None
        try:
            name = cp.name_of(cp.fingerprint(stable, info))
            if name in cp.building or name in self.claims or await asyncio.to_thread(cp.file_known, name, info):
                return None  # built here (this process's runners wait for each other), or already on disk
        except (OSError, ValueError):
            return None
        token = f"{self.process}:{uuid.uuid4().hex}"
        got = await self.store.claim_build(name, token)
        if got:
            self.claims[name] = token
            return Claim(name, token)
        if got is False and name not in cp.building:
            await self._follow(cp, name)
        return None

    async def _follow(self, cp: CheckpointRunner, name: str) -> None:
        """Another proxy's marker is there: restore what it built, or wait for its build (a background task
        resolves the runner's future, so a cancelled request never strands the waiters behind it)."""
        owner = await self.store.build_owner(name)
        if owner == BUILT:
            cp.elsewhere.add(name)
            return
        if owner is None or self._ours(owner) or name in cp.building:
            return  # gone already, or a sibling request of this process claimed it: its runner builds
        loop = asyncio.get_running_loop()
        waiter = cp.building[name] = loop.create_future()
        task = loop.create_task(self._await_build(cp, name, waiter))
        self._waits.add(task)
        task.add_done_callback(self._waits.discard)

    async def _await_build(self, cp: CheckpointRunner, name: str, waiter: asyncio.Future[None]) -> None:
        """While another proxy holds the build marker, at most one build's time in all. Any other proxy's
        marker counts, not only the first one seen (a proxy that let its claim go may claim again with a new
        token, and a marker whose proxy died expires). Never this process's own marker (its runner is waited
        for locally). Whatever ends the wait, the runner then tries the restore."""
        deadline = time.monotonic() + BUILD_WAIT
        try:
            while time.monotonic() < deadline:
                owner = await self.store.build_owner(name)
                if owner is None or owner == BUILT or self._ours(owner):
                    break
                await asyncio.sleep(POLL)
        finally:
            if cp.building.get(name) is waiter:
                del cp.building[name]
            if not waiter.done():
                waiter.set_result(None)

    async def finish(self, cp: CheckpointRunner, info: ServerInfo, claim: Claim) -> None:
        """Let this proxy's build claim go: `BUILT` if the file is saved now (this process's index has it), so
        other proxies restore it instead of building it."""
        self.claims.pop(claim.name, None)
        saved = False
        with contextlib.suppress(OSError, ValueError):
            saved = await asyncio.to_thread(cp.file_known, claim.name, info)
        await self.store.finish_build(claim.name, claim.token, saved)
