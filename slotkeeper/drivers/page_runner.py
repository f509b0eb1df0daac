"""Performs a `slotlogic.paging.PagePlan` against llama-server: session paging's slot saves and restores.

Order matters more than speed: llama-server runs one slot's work in arrival order, so a page-in helps only if
its session's request reaches the slot next. Hence one lock per slot, held from the save or restore until that
request's response headers (slow-path requests only), and a save waits until every earlier request sent there
has reached the server (`SlotGate.quiet`), so it writes the conversation it stands for. With Redis the lock is
also taken in the store, so proxies on several machines never page one slot at once; an unreachable store or
a wait that runs out leaves the local lock (fail open). docs/paging.md, docs/scale-out.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slotkeeper.drivers.llama_http import LlamaClient
from slotkeeper.drivers.page_budget import PageBudget
from slotkeeper.drivers.slot_gate import SlotGate
from slotkeeper.drivers.store import SlotLocks
from slotlogic import numbers
from slotlogic.checkpoint_machine import Failure
from slotlogic.costs import SlotFileAnswer
from slotlogic.events import Event, Failed, PageFailed, PageGone, PageRejected, PagingLockTimeout, Stage
from slotlogic.paging import PageFile, PagePlan, restore_checked

ACTION_TIMEOUT = 120.0
LOCK_WAIT = 300.0  # longer than any sane request; a leaked hold only delays, never blocks, a slot
SAVE_WAIT = 60.0  # a save waits for the slot's running request; re-prefilling would usually take longer


@dataclass
class PageOutcome:
    saved_tokens: int | None = None
    saved_bytes: int = 0
    restored_tokens: int | None = None
    restore_failed: bool = False  # a failed or rejected restore: the page is dropped (a failure empties the slot)
    seed_tokens: int | None = None  # a live seed's save: what its slot held
    seed_bytes: int = 0
    missing_save_path: bool = False
    seconds: float = 0.0  # wall time, including the wait for a busy slot's running request
    server_ms: float = 0.0  # what the server spent writing and reading the files (its timings)


class PageRunner:
    def __init__(self, client: LlamaClient, save_dir: str | None, max_bytes: int, emit: Callable[[Event], None],
                 upstream: str = "") -> None:
        self.client = client
        # None: the server's save dir is out of this machine's reach; its files are named from a bounded ring
        # and overwritten, never listed, checked or deleted from here
        self.save_dir = Path(save_dir) if save_dir else None
        self.budget = PageBudget(self.save_dir, max_bytes)  # the page budget in force, the ring's size
        self.emit = emit
        self.upstream = upstream
        self.locks: dict[int, asyncio.Lock] = {}
        self.holding: dict[str, asyncio.Lock] = {}  # flow id -> the slot lock it holds
        self.saving: dict[str, asyncio.Event] = {}  # session key -> set once its page-out is recorded
        self._saves_changed = asyncio.Event()  # set (and renewed) whenever a page-out starts or ends
        self.shared: SlotLocks | None = None          # the store's slot locks (proxies on several machines)
        self.remote: dict[str, tuple[int, str, str | None]] = {}  # flow id -> (slot, token, session) held there
        self.last_sent: dict[int, tuple[str, float] | None] = {}  # slot -> its last paged send, as the lock said
        self._tasks: set[asyncio.Task[None]] = set()
        self._doomed: set[str] = set()  # replaced page files whose deletion waits (`delete_later`)
        self._waits: dict[int, int] = {}  # slot whose lock is held -> the slot its holder waits for (`wait_free`)
        self.gate: SlotGate = SlotGate(upstream, emit)  # which requests reached the server (Upstream shares its own)
        self.on_answer: Callable[[SlotFileAnswer], None] = lambda a: None  # each save/restore's size and time
        # A request of ours is running at the server: a slot call sent now waits for its batch step, so its wall
        # time is no sample of the call's fixed cost (`slotlogic.costs`, the move overhead).
        self.server_busy: Callable[[], bool] = lambda: False
        # a seed's slot on another server of the pool saved there (`pool_seeds.PoolSeeds.copy`)
        self.copy_from: Callable[[str, int, str, str], Awaitable[tuple[int, int] | None]] = _no_copy
        # whether `slot` holds `session`'s current conversation, as the ledger has it (a copy's fence)
        self.holds: Callable[[int, str], bool] = lambda slot, session: True

    def busy(self, slot: int) -> bool:
        lock = self.locks.get(slot)
        return lock is not None and lock.locked()

    def locked(self) -> frozenset[int]:
        """The slots whose lock a placement (or a copy) holds now: their next work is someone's already."""
        return frozenset(slot for slot, lock in self.locks.items() if lock.locked())

    def placed(self, slot: int) -> bool:
        """A placement holds `slot`'s lock (it is about to write the slot), not merely a copy of it (`copy_out`)."""
        lock = self.locks.get(slot)
        return lock is not None and any(held is lock for held in self.holding.values())

    async def hold(self, slot: int, flow_id: str, session: str | None = None, within: float | None = None) -> bool:
        """Take `slot`'s lock for `flow_id` (let go by `unlock` at its response headers or its end); with a
        shared store, the slot's lock there too, and `last_sent[slot]` says what the previous pager sent.
        `within`: a request's own wait bound, which running out is no fault of the lock (nothing logged)."""
        lock = self.locks.setdefault(slot, asyncio.Lock())
        try:
            await asyncio.wait_for(lock.acquire(), LOCK_WAIT if within is None else max(0.0, within))
        except TimeoutError:
            if within is None:
                self.emit(PagingLockTimeout(self.upstream, slot, LOCK_WAIT))
            return False
        self.holding[flow_id] = lock
        self.last_sent.pop(slot, None)
        if self.shared is not None:
            token = secrets.token_hex(8)
            try:
                held, sent = await self.shared.hold(slot, token)
            except BaseException:
                self.unlock(flow_id, sent=False)
                raise
            if held:
                self.remote[flow_id] = (slot, token, session)
                self.last_sent[slot] = sent
        return True

    async def wait_free(self, slot: int, mine: int, timeout: float) -> bool:
        """Wait until the placement holding `slot`'s lock lets it go (the slot is not taken: only waited for),
        while this one holds `mine`'s; False when `timeout` ran out first, or when that placement waits for
        `mine` itself (two sessions trading slots: one of them goes on without waiting)."""
        if self._waits.get(slot) == mine:
            return False
        lock = self.locks.setdefault(slot, asyncio.Lock())
        self._waits[mine] = slot
        try:
            await asyncio.wait_for(lock.acquire(), timeout)
        except TimeoutError:
            return False
        finally:
            self._waits.pop(mine, None)
        lock.release()
        return True

    def save_starts(self, session_key: str) -> asyncio.Event:
        """`session_key`'s page-out starts: the event its waiters (`settled`) wait for, set by `save_ends`."""
        event = self.saving[session_key] = asyncio.Event()
        self._changed()
        return event

    def save_ends(self, session_key: str, event: asyncio.Event) -> None:
        """The page-out `save_starts` began is recorded, or failed: its waiters go on."""
        event.set()
        if self.saving.get(session_key) is event:
            del self.saving[session_key]
        self._changed()

    async def save_begins(self, session_key: str, timeout: float, recorded: Callable[[], bool]) -> bool:
        """Wait until `session_key`'s page-out starts (True), or until `recorded()` says its page is there
        already or `timeout` seconds pass (False). Woken by every start and end of a page-out, never polled."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while session_key not in self.saving:
            if recorded() or loop.time() >= end:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._saves_changed.wait(), end - loop.time())
        return True

    def _changed(self) -> None:
        self._saves_changed.set()
        self._saves_changed = asyncio.Event()

    async def settled(self, session_key: str, timeout: float | None = None) -> None:
        """Wait (at most SAVE_WAIT, or `timeout` when shorter) while `session_key` is being paged out, so it can
        be paged back in."""
        event = self.saving.get(session_key)
        if event is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), SAVE_WAIT if timeout is None else min(SAVE_WAIT, timeout))

    def unlock(self, flow_id: str, *, sent: bool = True) -> None:
        """Let the slot go (`sent`: the flow's request reached the server, so the store records its session
        as the slot's last paged send)."""
        lock = self.holding.pop(flow_id, None)
        if lock is not None and lock.locked():
            lock.release()
        held = self.remote.pop(flow_id, None)
        if held is not None and self.shared is not None:
            slot, token, session = held
            with contextlib.suppress(RuntimeError):  # no loop: the lock's TTL lets it go
                task = asyncio.get_running_loop().create_task(
                    self.shared.let_go(slot, token, session if sent else None, time.time()))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def run(self, plan: PagePlan) -> PageOutcome:
        """Save the slot's holder, then restore the session's page. Never raises for HTTP trouble."""
        out = PageOutcome()
        started = time.monotonic()
        if plan.save_file is not None:
            saved = await self._save(plan.slot, plan.save_file, out)
            if saved is not None:
                out.saved_tokens, out.saved_bytes = saved
        expected = plan.restore_tokens
        if plan.seed is not None and plan.seed.slot is not None and plan.seed_file is not None:
            # A live seed: its slot is saved first (its lock held meanwhile: the caller saw it free, so this
            # takes it at once), then that file goes into ours. On another server of the pool: saved there.
            if plan.seed.server is not None:
                saved = await self.copy_from(plan.seed.server, plan.seed.slot, plan.seed_file, plan.seed.source)
            else:
                saved = await self.copy_out(plan.seed.slot, plan.seed_file, out, plan.seed.source)
            if saved is None:
                out.seconds = time.monotonic() - started
                return out
            out.seed_tokens, out.seed_bytes = saved
            expected = out.seed_tokens
        if plan.restore_file is not None:
            if self.save_dir is not None and not os.path.lexists(self.save_dir / plan.restore_file):
                self.emit(PageGone(self.upstream, plan.restore_file))
                out.restore_failed = True
            else:
                asked = self._asked()
                status, data = await self._action(plan.slot, "restore", plan.restore_file)
                restored = numbers.count(data.get("n_restored")) if isinstance(data, dict) else None
                if status == 200 and isinstance(data, dict) and restored is not None:
                    check = restore_checked(expected, restored)
                    out.server_ms += _ms(data, "restore_ms")
                    self._measured("restore", data, asked)
                    if check is None:
                        out.restored_tokens = restored
                    else:  # the slot holds something other than the page we recorded: not a page-in
                        out.restore_failed = True
                        self.emit(PageRejected(self.upstream, plan.slot, check))
                else:
                    out.restore_failed = True
                    out.missing_save_path |= status == 501
                    self.emit(PageFailed(self.upstream, plan.slot, "in", Failure.of(status, data)))
        out.seconds = time.monotonic() - started
        return out

    async def copy_out(self, slot: int, filename: str, out: PageOutcome | None = None,
                       source: str | None = None) -> tuple[int, int] | None:
        """Save `slot` for a seed (of this server, or of another of the pool: `pool_seeds`) under its lock, once
        every request sent there reached the server: the tokens and bytes written, or None (also while a
        placement holds the slot's lock: it is about to write the slot; another copy's save is waited for).
        Fenced by `source`: once every request sent there reached the server, the ledger must still say the
        slot holds that session's conversation (else a slot the source has left is copied, holding another
        family's conversation, and the family prompt is warmed up cold over it)."""
        lock = self.locks.setdefault(slot, asyncio.Lock())
        if self.placed(slot):
            return None
        async with lock:
            if not await self.gate.quiet(slot):
                return None
            if source is not None and not self.holds(slot, source):
                return None
            return await self._save(slot, filename, out if out is not None else PageOutcome())

    async def _save(self, slot: int, filename: str, out: PageOutcome) -> tuple[int, int] | None:
        """Save `slot` into `filename`: (tokens, bytes) written, or None (logged once per failure)."""
        asked = self._asked()
        status, data = await self._action(slot, "save", filename)
        saved = numbers.count(data.get("n_saved")) if isinstance(data, dict) else None
        if status == 200 and isinstance(data, dict) and saved is not None:
            out.server_ms += _ms(data, "save_ms")
            self._measured("save", data, asked)
            written = numbers.count(data.get("n_written"))  # the page budget adds it up: never negative
            self._private(filename)
            return saved, written if written is not None else self._size(filename)
        out.missing_save_path |= status == 501
        self.emit(PageFailed(self.upstream, slot, "out", Failure.of(status, data)))
        return None

    def _asked(self) -> float | None:
        """When a slot call is sent (monotonic), for its wall time; None while a request of ours runs."""
        return None if self.server_busy() else time.monotonic()

    def _measured(self, action: str, data: dict[str, Any], asked: float | None) -> None:
        """One save or restore answer into the speeds; its wall time only when no request of ours ran while it
        did: a call queued behind a prefill would price every later move too high, and a move never made again
        never brings the estimate back down."""
        wall = None if asked is None or self.server_busy() else (time.monotonic() - asked) * 1000
        answer = SlotFileAnswer.parse(action, data, wall)
        if answer is not None:
            self.on_answer(answer)

    async def _action(self, slot: int, action: str, filename: str) -> tuple[int, Any]:
        return await self.client.post_json(f"/slots/{slot}?action={action}", {"filename": filename},
                                           ACTION_TIMEOUT)

    def _private(self, name: str) -> None:
        """A page holds a conversation's tokens: 0600, when this process owns the file (same user as the
        server); otherwise the server's umask decides and the README says to keep the directory private.
        Never through a symlink: one planted under a page's name must not make us chmod its target."""
        if self.save_dir is None:
            return
        with contextlib.suppress(OSError):
            fd = os.open(self.save_dir / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    os.fchmod(fd, 0o600)
            finally:
                os.close(fd)

    def _size(self, name: str) -> int:
        if self.save_dir is None:
            return 0  # out of reach: the answer's byte count stands
        with contextlib.suppress(OSError):
            return os.lstat(self.save_dir / name).st_size
        return 0

    def delete_later(self, names: list[str], seconds: float) -> None:
        """Delete `names` after `seconds` (a restore already planned from them still finds them); at once when
        no loop runs. A clean shutdown deletes them then (`delete_doomed_now`); a killed process leaves them to
        the next one's orphan sweep."""
        if not names:
            return
        try:
            asyncio.get_running_loop().call_later(seconds, self._delete_doomed, list(names))
        except RuntimeError:
            self.delete(names)
            return
        self._doomed.update(names)

    def _delete_doomed(self, names: list[str]) -> None:
        self._doomed.difference_update(names)
        self.delete(names)

    def delete_doomed_now(self) -> None:
        """At shutdown: the files `delete_later` still keeps go now (else only the next orphan sweep finds them)."""
        names, self._doomed = list(self._doomed), set()
        self.delete(names)

    def delete(self, names: list[str]) -> None:
        if self.save_dir is None:
            return  # out of reach: the ring's names are overwritten instead
        for name in names:
            try:
                os.unlink(self.save_dir / name)
            except FileNotFoundError:
                pass
            except OSError as e:
                self.emit(Failed(self.upstream, Stage.DELETE, type(e).__name__))

    def files(self) -> dict[str, PageFile]:
        """Page-looking regular files in the save dir (not symlinks), for the orphan sweep."""
        out: dict[str, PageFile] = {}
        if self.save_dir is None:
            return out  # out of reach: the page records alone count against the budget
        with contextlib.suppress(OSError), os.scandir(self.save_dir) as entries:
            for entry in entries:
                if entry.name.startswith("page-") and entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    out[entry.name] = PageFile(st.st_mtime, st.st_size)
        return out


def _ms(data: dict[str, Any], key: str) -> float:
    timings = data.get("timings")
    value = timings.get(key) if isinstance(timings, dict) else None
    return numbers.millis(value) or 0.0


async def _no_copy(url: str, slot: int, file: str, source: str) -> tuple[int, int] | None:
    return None  # one server: no other server's slot to copy
