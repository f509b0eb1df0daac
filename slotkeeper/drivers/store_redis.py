"""The shared state in Redis or Valkey (`slots_state_url=redis://…`), for proxies on several machines.

The model is the file store's (`slotlogic.shared.ServerState`), one JSON document per server, changed only
under the server's lock, with TTLs instead of sweeps. The keys are anyone's to write, so every value read is
checked, a foreign or stale lock is taken over, and an unreachable store fails open to this process's last
copy. Claim notices tell other proxies at once that a slot changed hands. docs/scale-out.md explains each rule.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aredis
from redis.exceptions import LockError, RedisError

from slotkeeper.drivers.notice_listener import NoticeListener, OnClaim
from slotkeeper.drivers.store import BUILT, redacted
from slotlogic import notices, shared
from slotlogic.events import Event, StoreBack, StoreLockBusy, StoreUnavailable, StoreValueRefused
from slotlogic.routing import backoff
from slotlogic.settings import SESSION_KEEP_SECONDS

LOCK_SECONDS = 10.0       # a lock whose holder died expires after this
LOCK_WAIT = 2.0           # how long a transaction waits for the lock (a proxy holds it for milliseconds)
MAX_STATE_BYTES = 1 << 20  # a state larger than this is not a proxy's (1,024 slot owners and 256 pages: 0.4 MB)
MAX_SHORT = 512           # a marker or a slot's last send: a longer value is not one of ours
IO_TIMEOUT = 2.0          # connect and per-command time-out
KEEP_MS = int(SESSION_KEEP_SECONDS * 1000)
BUILD_KEY = "slotkeeper:v1:build:"
BUILD_MS = 120_000        # a build marker whose proxy died expires after this (the checkpoint time-out)
# The state, unless it is too large (its size instead) or not a string (-1): never megabytes on the wire.
READ_LUA = ("local t = redis.call('type', KEYS[1])['ok'] "
            "if t == 'none' then return false end "
            "if t ~= 'string' then return -1 end "
            "local n = redis.call('strlen', KEYS[1]) "
            "if n > tonumber(ARGV[1]) then return n end "
            "return redis.call('get', KEYS[1])")
# Take the lock (1), taking over one that is not a proxy's (no expiry, a longer one, another type) or the holder
# ARGV[4] asks to break; else the holder's first 64 bytes.
ACQUIRE_LUA = ("if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end "
               "local t = redis.call('type', KEYS[1])['ok'] "
               "local ttl = redis.call('pttl', KEYS[1]) "
               "local held = '' "
               "if t == 'string' then held = redis.call('getrange', KEYS[1], 0, 63) end "
               "if t ~= 'string' or ttl == -1 or ttl > tonumber(ARGV[2]) or (ARGV[4] == '1' and held == ARGV[3]) "
               "then redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end "
               "return held")
# A short string key's value, or nothing (another type, or longer than ARGV[1]: not ours).
SHORT_LUA = ("if redis.call('type', KEYS[1])['ok'] ~= 'string' "
             "or redis.call('strlen', KEYS[1]) > tonumber(ARGV[1]) then return false end "
             "return redis.call('get', KEYS[1])")
RELEASE_LUA = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
FINISH_LUA = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
              "return redis.call('set', KEYS[1], ARGV[2], 'PX', ARGV[3]) end return 0")
# A slot's paging lock: taken with the slot's last send in one round trip; let go with the send it covered.
# A lock key with no expiry, a longer one, or another type is no proxy's: taken over; the last send is read only
# when it is a short string.
HOLD_LUA = ("local took = redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) "
            "if not took then "
            "local ttl = redis.call('pttl', KEYS[1]) "
            "if redis.call('type', KEYS[1])['ok'] ~= 'string' or ttl == -1 or ttl > tonumber(ARGV[2]) then "
            "redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2]) took = true end end "
            "if not took then return {0, ''} end "
            "local sent = '' "
            "if redis.call('type', KEYS[2])['ok'] == 'string' and redis.call('strlen', KEYS[2]) <= 512 then "
            "sent = redis.call('get', KEYS[2]) end "
            "return {1, sent}")
LET_GO_LUA = ("if redis.call('get', KEYS[1]) == ARGV[1] then redis.call('del', KEYS[1]) "
              "if ARGV[2] ~= '' then redis.call('set', KEYS[2], ARGV[2], 'PX', ARGV[3]) "
              "redis.call('publish', KEYS[3], ARGV[4]) end return 1 end return 0")
SLOT_LOCK_MS = 60_000     # a paging lock whose proxy died (or hung) expires after this
SLOT_WAIT = 60.0          # how long a pager waits for another proxy's pager of the slot (then goes on: fail open)
SENT_MS = 86_400_000      # a slot's last paged send is remembered this long
Emit = Callable[[Event], None]
ERRORS = (RedisError, OSError, TimeoutError)


def state_key(upstream: str) -> str:
    """The document's key: a digest of the server's URL (every proxy fronting it agrees)."""
    return f"slotkeeper:v1:{hashlib.sha256(upstream.encode()).hexdigest()[:16]}:state"


def claims_channel(upstream: str) -> str:
    """The pub/sub channel of the server's claim notices (the same digest as its document)."""
    return f"slotkeeper:v1:{hashlib.sha256(upstream.encode()).hexdigest()[:16]}:claims"


class RedisConnection:
    """One client per event loop (a client bound to a closed loop cannot be used again), and the one
    up/down status of the store that every server's `RedisState` shares."""

    def __init__(self, url: str, emit: Emit) -> None:
        self.url = url
        self.shown = redacted(url)
        self.emit = emit
        self._clients: dict[int, aredis.Redis] = {}
        self.available = True
        self.failures = 0
        self.retry_at = 0.0
        self.calls = 0  # commands sent (tests assert the hot path sends none)
        self.instance = os.urandom(8).hex()  # this process, in the claim notices it publishes
        self.notices = NoticeListener(url, self.shown, self.instance, emit)

    def client(self) -> aredis.Redis:
        loop_id = id(asyncio.get_running_loop())
        c = self._clients.get(loop_id)
        if c is None:
            c = self._clients[loop_id] = aredis.Redis.from_url(
                self.url, socket_timeout=IO_TIMEOUT, socket_connect_timeout=IO_TIMEOUT, health_check_interval=30)
            self.notices.ensure()  # the first store operation in this loop starts the notice listener
        return c

    def usable(self) -> bool:
        """False while the store is down and its back-off has not run out (no connection attempt then)."""
        return self.available or time.monotonic() >= self.retry_at

    def failed(self, e: BaseException) -> None:
        self.failures += 1
        self.retry_at = time.monotonic() + backoff(self.failures)
        if self.available:
            self.available = False
            self.emit(StoreUnavailable("", self.shown, type(e).__name__))

    def ok(self) -> None:
        if not self.available:
            self.emit(StoreBack("", self.shown))
        self.available, self.failures = True, 0

    def close_sync(self) -> None:
        self.notices.close()
        self._clients.clear()  # their loop is closing; the sockets go with the process

    # A prefix checkpoint built once for all proxies: the first to claim the build builds it, the others wait
    # for the marker to go and then restore the file (docs/scale-out.md).

    async def claim_build(self, name: str, token: str) -> bool | None:
        """True: this proxy builds `name`; False: another proxy is building it; None: the store is down."""
        if not self.usable():
            return None
        try:
            self.calls += 1
            got = await self.client().set(BUILD_KEY + name, token, nx=True, px=BUILD_MS)
        except ERRORS as e:
            self.failed(e)
            return None
        self.ok()
        return bool(got)

    async def build_owner(self, name: str) -> str | None:
        """The token of the build marker of `name`, `BUILT` once a build saved it (None: no build ran lately,
        or the store is down)."""
        try:
            self.calls += 1
            value = await self.client().eval(SHORT_LUA, 1, BUILD_KEY + name, MAX_SHORT)
        except ERRORS as e:
            self.failed(e)
            return None
        return value.decode() if isinstance(value, bytes) else value

    async def release_build(self, name: str, token: str) -> None:
        """Delete the marker if it is still ours (a Lua compare-and-delete: never another proxy's)."""
        with contextlib.suppress(*ERRORS):
            self.calls += 1
            await self.client().eval(RELEASE_LUA, 1, BUILD_KEY + name, token)

    async def finish_build(self, name: str, token: str, saved: bool) -> None:
        """The end of this proxy's build: a saved file leaves `BUILT` behind (kept as long as the state, so a
        proxy whose own index does not know the file restores it from the server's save dir instead of building
        it again); a failed build just lets go. Never another proxy's marker (compare-and-set in Lua)."""
        if not saved:
            await self.release_build(name, token)
            return
        with contextlib.suppress(*ERRORS):
            self.calls += 1
            await self.client().eval(FINISH_LUA, 1, BUILD_KEY + name, token, BUILT, KEEP_MS)


class RedisSlotLocks:
    """The paging lock of each slot of one server, shared by every proxy (`slotkeeper.drivers.page_runner`): a pager
    decides what to save and restore only once the slot's previous pager, of any proxy, has sent its request;
    and it learns which session that was (`Sent`: the conversation its save will write, whoever sent it)."""

    def __init__(self, conn: RedisConnection, upstream: str) -> None:
        self.conn = conn
        self.prefix = state_key(upstream).removesuffix(":state") + ":slot:"
        self.channel = claims_channel(upstream)

    async def hold(self, slot: int, token: str, wait: float = SLOT_WAIT) -> tuple[bool, tuple[str, float] | None]:
        """(held, the slot's last paged send: session and time). Not held: the store is down or the wait ran
        out; the caller goes on without (as before this lock existed)."""
        deadline = time.monotonic() + wait
        pause = 0.01
        while self.conn.usable():
            try:
                self.conn.calls += 1
                got = await self.conn.client().eval(HOLD_LUA, 2, f"{self.prefix}{slot}:lock",
                                                    f"{self.prefix}{slot}:sent", token, SLOT_LOCK_MS)
            except ERRORS as e:
                self.conn.failed(e)
                return False, None
            if got and int(got[0]) == 1:
                return True, _sent(got[1])
            if time.monotonic() >= deadline:
                return False, None
            await asyncio.sleep(pause)
            pause = min(0.1, pause * 1.5)
        return False, None

    async def let_go(self, slot: int, token: str, session: str | None, at: float) -> None:
        """Release the lock if it is still ours, recording the send it covered (None: nothing was sent) and
        telling the other proxies (a `sent` claim notice: whoever believed the slot was theirs is not on top)."""
        sent = json.dumps({"session": session, "at": at}) if session else ""
        notice = notices.encode(notices.ClaimNotice(slot, session, None, self.conn.instance, at, sent=True)
                                ) if session else ""
        with contextlib.suppress(*ERRORS):
            self.conn.calls += 1
            await self.conn.client().eval(LET_GO_LUA, 3, f"{self.prefix}{slot}:lock", f"{self.prefix}{slot}:sent",
                                          self.channel, token, sent, SENT_MS, notice)


def _sent(raw: Any) -> tuple[str, float] | None:
    try:
        data = json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError, TypeError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    session, at = data.get("session"), data.get("at")
    if not isinstance(session, str) or not isinstance(at, int | float) or isinstance(at, bool):
        return None
    return session, float(at)


class Squat:
    """The lock's holder as this process last saw it, and since when. A proxy's lock lives `LOCK_SECONDS` at
    most (set once, never renewed), so a holder seen for longer is one that renews it: no proxy's, taken over."""

    def __init__(self) -> None:
        self.holder: bytes | None = None
        self.since = 0.0

    def args(self) -> tuple[bytes, str]:
        """ACQUIRE_LUA's last two arguments: the holder to break, and whether to."""
        if self.holder is not None and time.monotonic() - self.since > LOCK_SECONDS:
            return self.holder, "1"
        return b"", "0"

    def saw(self, got: Any) -> bool:
        """ACQUIRE_LUA's answer: taken (True), or who holds it (remembered)."""
        if isinstance(got, int) and got == 1:
            self.holder = None
            return True
        held = got if isinstance(got, bytes) else str(got).encode()
        if held != self.holder:
            self.holder, self.since = held, time.monotonic()
        return False


class _Squatted:
    """redis-py's lock (token, Lua release) taken by ACQUIRE_LUA: a squatted key does not hold it up."""

    name: Any

    def __init__(self, client: Any, name: str, squat: Squat) -> None:
        super().__init__(client, name, timeout=LOCK_SECONDS, sleep=0.05,  # type: ignore[call-arg]
                         blocking_timeout=LOCK_WAIT)
        self.squat = squat

    def acquire_args(self, token: str | bytes) -> tuple[Any, ...]:
        return (ACQUIRE_LUA, 1, self.name, token, int(LOCK_SECONDS * 1000), *self.squat.args())


class StateLock(_Squatted, aredis.lock.Lock):
    async def do_acquire(self, token: str | bytes) -> bool:
        return self.squat.saw(await self.redis.eval(*self.acquire_args(token)))


class StateLockSync(_Squatted, redis.lock.Lock):
    """`StateLock` for the blocking client of the shutdown flush."""

    def do_acquire(self, token: str | bytes) -> bool:
        return self.squat.saw(self.redis.eval(*self.acquire_args(token)))


@dataclass(frozen=True)
class Refused:
    """A state value no proxy wrote: what kind of wrong (one line per kind), and why in words (its size at
    most, never its content)."""

    kind: str
    why: str


def _raw(got: Any) -> Any:
    """READ_LUA's answer: the value (None: no key), or `Refused` (its size, or -1: not a string)."""
    if not isinstance(got, int):
        return got
    if got < 0:
        return Refused("type", "not a string")
    return Refused("size", f"{got / (1 << 20):.1f} MB, over {MAX_STATE_BYTES >> 20} MB")


class RedisState:
    """The `slotkeeper.drivers.store.StateStore` of one server, in Redis."""

    remote = True

    def __init__(self, conn: RedisConnection, upstream: str) -> None:
        self.conn = conn
        self.upstream = upstream
        self.key = state_key(upstream)
        self.channel = claims_channel(upstream)
        self.last = shared.ServerState(upstream=upstream)
        self.slot_locks: RedisSlotLocks | None = RedisSlotLocks(conn, upstream)
        self.squat = Squat()
        self._held: Any = None  # the lock of a transaction suspended on the event loop (shutdown takes it over)
        self._superseded = False  # the shutdown flush wrote under that lock: the suspended one must not
        self._refusing: str | None = None  # what kind of value is being refused (one line per episode)
        self._busy = False                 # the lock was found held past the wait (one line per episode)

    def watch(self, on_claim: OnClaim) -> None:
        """Call `on_claim` with every claim another proxy makes on this server, as it is made."""
        self.conn.notices.watch(self.channel, on_claim)

    def _decode(self, raw: Any) -> shared.ServerState | Refused:
        """The state in the key (a worker thread's work: megabytes of JSON must not stall the loop); a value no
        proxy wrote (not JSON, nested too deep) is refused."""
        if isinstance(raw, Refused):
            return raw
        try:
            data = json.loads(raw) if raw else None
        except (ValueError, UnicodeDecodeError, RecursionError):
            return Refused("json", "not JSON")
        return shared.from_dict(data, self.upstream, time.time())

    def _state(self, decoded: shared.ServerState | Refused) -> shared.ServerState:
        """The decoded state, or for a refused value this process's last good copy (one line per episode)."""
        if not isinstance(decoded, Refused):
            self._refusing = None
            return decoded
        if decoded.kind != self._refusing:
            self._refusing = decoded.kind
            self.conn.emit(StoreValueRefused("", self.conn.shown, decoded.why))
        return copy.deepcopy(self.last)

    def read(self) -> shared.ServerState:
        """The last state seen (sync callers never wait for the network)."""
        return self.last

    async def fresh(self) -> shared.ServerState:
        """Another machine may have written it at any time: always a read."""
        return await self.aread()

    async def aread(self) -> shared.ServerState:
        if not self.conn.usable():
            return self.last
        try:
            self.conn.calls += 1
            raw = _raw(await self.conn.client().eval(READ_LUA, 1, self.key, MAX_STATE_BYTES))
        except ERRORS as e:
            self.conn.failed(e)
            return self.last
        self.conn.ok()
        return self._state(await asyncio.to_thread(self._decode, raw))

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[shared.ServerState]:
        """Locked read-modify-write; on a store failure, the body runs on the local copy and nothing is
        written (fail open)."""
        lock, state = await self._begin()
        if lock is None:
            local = copy.deepcopy(self.last)
            yield local
            self.last = local
            return
        self._held = lock
        try:
            before = notices.owners(state)
            yield state
            if self._superseded:  # the shutdown flush wrote a newer state under this lock meanwhile
                return
            changed = notices.changes(before, state, self.conn.instance, time.time())
            doc = self._document(state)
            try:
                pipe = self.conn.client().pipeline(transaction=False)  # one round trip: the write and the notices
                if doc is not None:
                    pipe.set(self.key, doc, px=KEEP_MS)
                for notice in changed:
                    pipe.publish(self.channel, notices.encode(notice))
                self.conn.calls += 1 + len(changed)
                await pipe.execute()
                self.conn.ok()
            except ERRORS as e:
                self.conn.failed(e)
            self.last = state
        finally:
            self._held = None
            with contextlib.suppress(*ERRORS, LockError):
                await lock.release()

    def _document(self, state: shared.ServerState) -> str | None:
        """The JSON to write; None when it is larger than any reader takes (kept local, one line)."""
        doc = json.dumps(shared.to_dict(state), separators=(",", ":"))
        if len(doc) <= MAX_STATE_BYTES:
            return doc
        why = (f"this proxy's own state is {len(doc) / (1 << 20):.1f} MB, over {MAX_STATE_BYTES >> 20} MB: not shared "
               "(lower slots_state_max_sessions)")
        self.conn.emit(StoreValueRefused("", self.conn.shown, why))
        return None

    async def _begin(self) -> tuple[Any, shared.ServerState]:
        if not self.conn.usable():
            return None, self.last
        client = self.conn.client()
        lock = StateLock(client, self.key + ":lock", self.squat)
        try:
            self.conn.calls += 2
            if not await lock.acquire():
                self._lock_busy()
                return None, self.last
            raw = _raw(await client.eval(READ_LUA, 1, self.key, MAX_STATE_BYTES))
        except (*ERRORS, LockError) as e:
            with contextlib.suppress(*ERRORS, LockError):
                await lock.release()
            self.conn.failed(e)
            return None, self.last
        self.conn.ok()
        self._busy = False
        try:
            return lock, self._state(await asyncio.to_thread(self._decode, raw))
        except BaseException:  # never leave the lock held (every other proxy would wait for it)
            with contextlib.suppress(*ERRORS, LockError):
                await lock.release()
            raise

    def _lock_busy(self) -> None:
        """The store answered, its lock stayed held: not "unreachable" (no back-off); one line per episode."""
        self.conn.ok()
        if not self._busy:
            self._busy = True
            self.conn.emit(StoreLockBusy("", self.conn.shown, LOCK_WAIT))

    def _take_over(self, client: redis.Redis, lock: Any) -> bool:
        """True when a transaction of this process holds the lock, suspended on the event loop that `done`
        now blocks: waiting for it would wait out the lock's whole TTL (it cannot run to let go), so the
        shutdown flush goes on under its token, and that transaction writes nothing when it resumes."""
        held = self._held
        token = getattr(getattr(held, "local", None), "token", None)
        if token is None or client.get(self.key + ":lock") != token:
            return False
        lock.local.token = token
        return True

    @contextlib.contextmanager
    def transaction_sync(self) -> Iterator[shared.ServerState]:
        """At shutdown (sync): a short-lived blocking client; fail open like the async one."""
        client = None
        lock = None
        state = copy.deepcopy(self.last)
        if self.conn.usable():
            try:
                client = redis.Redis.from_url(self.conn.url, socket_timeout=IO_TIMEOUT,
                                              socket_connect_timeout=IO_TIMEOUT)
                lock = StateLockSync(client, self.key + ":lock", self.squat)
                if self._take_over(client, lock) or lock.acquire():
                    state = self._state(self._decode(_raw(client.eval(READ_LUA, 1, self.key, MAX_STATE_BYTES))))
                else:
                    self._lock_busy()
                    lock = None
            except (RedisError, OSError, LockError) as e:
                self.conn.failed(e)
                if lock is not None:
                    with contextlib.suppress(RedisError, OSError, LockError):
                        lock.release()
                lock = None
        try:
            yield state
            doc = self._document(state) if lock is not None and client is not None else None
            if doc is not None and client is not None:
                with contextlib.suppress(RedisError, OSError):
                    client.set(self.key, doc, px=KEEP_MS)
                    self._superseded = self._held is not None
            self.last = state
        finally:
            if lock is not None:
                with contextlib.suppress(RedisError, OSError, LockError):
                    lock.release()
            if client is not None:
                client.close()
