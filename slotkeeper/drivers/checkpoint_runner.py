"""Runs `slotlogic.checkpoint_machine.Orchestrator` against llama-server: prefix checkpoints.

It performs the machine's actions (slot restore, save, erase, pinned warm-up and verification requests, each
with a time-out), keeps the private checkpoint index, never restores a file whose entry does not match the
running server, runs the cleanup, and holds the cap on prefix files at every moment (room made before a save;
a file that cannot fit is not saved). docs/checkpoints.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slotkeeper.drivers import checkpoint_files
from slotkeeper.drivers.llama_http import LlamaClient
from slotkeeper.drivers.store_file import CorruptFile, JsonFile, file_stamp
from slotlogic import __version__, costs
from slotlogic import prefix as pfx
from slotlogic.checkpoint_machine import Action, ActionKind, Orchestrator, Outcome, Result
from slotlogic.costs import SlotFileAnswer
from slotlogic.events import (
    CheckpointForeign,
    CheckpointStarted,
    CheckpointStep,
    CheckpointWaiting,
    CostWeighed,
    Event,
    Failed,
    NoSavePath,
    Stage,
)
from slotlogic.server import ServerInfo
from slotlogic.settings import CheckpointMode, Settings

ACTION_TIMEOUT = 120.0
INDEX_FILE = "checkpoints.json"
KNOWN_PREFIXES = 64  # prefixes remembered to build longer ones on (their text stays in memory only)



@dataclass
class PrefixRegistry:
    """Prefix checkpoints being built and prefixes restored or built, shared by the servers of one pool (they
    share one save dir: a build for one is waited for and restored by the others, and a longer prefix is built
    on the longest one any of them holds). Memory only: prompt text is never written anywhere."""

    building: dict[str, asyncio.Future[None]] = field(default_factory=dict)  # cold builds in flight
    known: OrderedDict[str, pfx.StablePrefix] = field(default_factory=OrderedDict)
    # Saves in flight, by file: the bytes each made room for under the cap (0: size unknown, the only one then).
    reserved: dict[str, int] = field(default_factory=dict)
    # Held (by worker threads only, `ROOM_WAIT` at most) while the save dir is counted and room made for a save.
    room: threading.Lock = field(default_factory=threading.Lock)


class CheckpointRunner:
    def __init__(self, client: LlamaClient, state_dir: Path, settings: Settings, emit: Callable[[Event], None],
                 upstream: str = "", registry: PrefixRegistry | None = None) -> None:
        self.client = client
        self.settings = settings
        self.emit = emit
        self.upstream = upstream
        self.index = JsonFile(Path(state_dir) / INDEX_FILE, emit)
        self.current: set[str] = set()
        registry = self.registry = registry or PrefixRegistry()
        self.building = registry.building  # cold builds in flight (every server of the pool)
        self.elsewhere: set[str] = set()  # files another proxy built and saved (the shared store says so)
        # prefixes this process (every server of its pool) restored or built: a longer one is built on the longest
        # of them it starts with.
        self.known = registry.known
        self.warned: set[str] = set()
        self.cleaned = False
        # files that passed the restore gates on this server: name -> (its media_marker, the file's stamp, n_restored)
        self.verified: OrderedDict[str, tuple[str, tuple[int, int, int], int]] = OrderedDict()
        self.on_answer: Callable[[SlotFileAnswer], None] = lambda a: None  # each save/restore's size and time
        self.rates: Callable[[], costs.Rates] = costs.Rates  # the server's measured speeds (none: restore)
        # With the save dir out of reach: how many checkpoint names the cap allows (`pfx.bucket_file`); 0: one
        # name per fingerprint, kept within the cap by deletion
        self.buckets: Callable[[], int] = lambda: 0

    @property
    def persist(self) -> bool:
        return self.settings.checkpoints is CheckpointMode.DISK

    def fingerprint(self, prefix: pfx.StablePrefix, info: ServerInfo) -> str:
        size = mtime = None
        if info.model_path and os.path.exists(info.model_path):
            stat = os.stat(info.model_path)
            size, mtime = stat.st_size, stat.st_mtime
        return pfx.fingerprint(prefix, model_path=info.model_path, model_size=size, model_mtime=mtime,
                               build_info=info.build_info,
                               server_id=self.settings.server_id + ("|kv=" + info.identity["kv_cache"]
                                                                    if "kv_cache" in info.identity else ""),
                               addon_version=__version__)

    def name_of(self, fp: str) -> str:
        """The file a fingerprint's checkpoint is saved as: named by it, or (save dir out of reach) one of a
        bounded set of names, which a checkpoint of another fingerprint may take over."""
        k = self.buckets()
        if k <= 0:
            return pfx.file_name(fp)
        # a checkpoint keeps its name while it holds it (the count of names grows once the KV size is known)
        held = [name for name, e in (self.read_index() or {}).items()
                if isinstance(e, dict) and e.get("fingerprint") == fp]
        return held[0] if held else pfx.bucket_file(self.upstream, int(fp[:12], 16) % k)

    def read_index(self) -> dict[str, Any] | None:
        """The index (empty when missing); None when corrupt."""
        try:
            data = self.index.load()
        except CorruptFile:
            return None
        return data if isinstance(data, dict) else {}

    def file_known(self, name: str, info: ServerInfo, built_elsewhere: bool = False, fp: str | None = None) -> bool:
        """Whether `name` is worth a restore: this state dir's index knows it for this server (holding `fp`, when
        names are shared by fingerprints), or (no entry here) another proxy built it for a server sharing the
        save dir (`built_elsewhere`)."""
        entry = (self.read_index() or {}).get(name)
        if isinstance(entry, dict) and fp is not None and self.buckets() > 0 and entry.get("fingerprint") != fp:
            return False  # the name holds another prefix's checkpoint now
        if not isinstance(entry, dict):
            return built_elsewhere and (not self.settings.save_dir or (Path(self.settings.save_dir) / name).exists())
        mismatch = tuple(k for k, v in info.identity.items() if entry.get(k) != v)
        if mismatch:
            self.emit(CheckpointForeign(self.upstream, name, mismatch))
            return False
        return not self.settings.save_dir or (Path(self.settings.save_dir) / name).exists()

    async def prepare(self, slot: int, prefix: pfx.StablePrefix, info: ServerInfo, *,
                      holds_prefix: bool, copied: bool = False) -> Orchestrator:
        """Make `slot` hold `prefix` before a new session's first request (`copied`: the slot holds a copy of a
        conversation that starts with it). Never raises for HTTP trouble."""
        fp = self.fingerprint(prefix, info)
        name = self.name_of(fp)
        self.current.add(name)
        waited = False
        while self.persist and not holds_prefix and (pending := self.building.get(name)) is not None:
            # Sessions that start together share a prefix: wait for the one build (this process's, or another
            # proxy's: `build_claims` puts a future here), then restore it instead of prefilling the same
            # prefix once per session. Again after each wait: a sibling woken by the same build may be
            # restoring or building it now.
            if not waited:
                self.emit(CheckpointWaiting(self.upstream, name))
            waited = True
            await asyncio.shield(pending)
        own: asyncio.Future[None] | None = None
        if self.persist and not holds_prefix:
            own = self.building[name] = asyncio.get_running_loop().create_future()
        try:
            return await self._prepare(slot, prefix, info, fp, name, holds_prefix, waited or name in self.elsewhere,
                                       copied)
        finally:
            self.registry.reserved.pop(name, None)
            if own is not None:
                if self.building.get(name) is own:
                    del self.building[name]
                own.set_result(None)

    async def _prepare(self, slot: int, prefix: pfx.StablePrefix, info: ServerInfo, fp: str, name: str,
                       holds_prefix: bool, built: bool, copied: bool = False) -> Orchestrator:
        """`built`: a build of this file just ended (here or in another proxy): restore it even if this state
        dir's index does not know it; a failed restore falls back to warming (and saving) as for a cold one."""
        known = self.persist and self.file_known(name, info, built, fp)
        persist = self.persist
        if known and (choice := self._weigh(name, slot)) is not None and not choice.worth:
            known = persist = False  # warming the prefix up is quicker than reading its file: warm, keep the file
        base = self._base(prefix, info, name) if self.persist and not known and not holds_prefix else None
        orch = Orchestrator(slot, prefix, name, persist=persist, holds_prefix=holds_prefix, file_known=known,
                            base=base, copied=copied, verified_tokens=self._verified_tokens(name, info) if known
                            else None)
        self.emit(CheckpointStarted(self.upstream, fp, slot))
        while (action := orch.next_action()) is not None:
            orch.feed(await self._perform_within_cap(orch, action))
        self._remember_verified(name, info, orch)
        for note in orch.notes:
            self.emit(CheckpointStep(self.upstream, note))
        if orch.outcome in (Outcome.RESTORED, Outcome.RESTORED_UNVERIFIED, Outcome.WARMED_SAVED):
            self.known[name] = prefix
            self.known.move_to_end(name)
            while len(self.known) > KNOWN_PREFIXES:
                self.known.popitem(last=False)
        if orch.outcome is Outcome.WARMED_SAVED or orch.file_bad:
            self.elsewhere.discard(name)  # the file is this proxy's now (in its index), or not worth a restore
        if orch.missing_save_path and "save-path" not in self.warned:
            self.warned.add("save-path")
            self.emit(NoSavePath(self.upstream, paging=False))
        if self.persist:
            await self.record(name, fp, info, orch)
            if not self.cleaned or orch.outcome is Outcome.WARMED_SAVED:  # the new file's real size, under the cap
                self.cleaned = True
                await self.cleanup(name if orch.outcome is Outcome.WARMED_SAVED else None)
        return orch

    def _verified_tokens(self, name: str, info: ServerInfo) -> int | None:
        """The n_restored with which `name` passed the restore gates on this server process (its media_marker),
        if the file is the same one (inode, size, mtime); None: verify it."""
        got = self.verified.get(name)
        if got is None or info.media_marker is None:
            return None
        marker, stamp, tokens = got
        return tokens if marker == info.media_marker and stamp == self._stamp(name) else None

    def _remember_verified(self, name: str, info: ServerInfo, orch: Orchestrator) -> None:
        """A file that passed both gates on this server process, or that this runner saved there itself from
        the slot it had just warmed, is restored without them until it or the process changes: each gate is a
        request that waits its turn in the server's batch loop, and behind another slot's long prefill each
        turn can take many seconds (a restore waits behind another slot's long warm-up)."""
        stamp = self._stamp(name)
        tokens = orch.restored_tokens if orch.verified else \
            orch.saved_tokens if orch.outcome is Outcome.WARMED_SAVED else None
        if info.media_marker and tokens is not None and stamp is not None:
            self.verified[name] = (info.media_marker, stamp, tokens)
            self.verified.move_to_end(name)
            while len(self.verified) > KNOWN_PREFIXES:
                self.verified.popitem(last=False)
        elif orch.file_bad:
            self.verified.pop(name, None)

    def _stamp(self, name: str) -> tuple[int, int, int] | None:
        return file_stamp(Path(self.settings.save_dir) / name) if self.settings.save_dir else None

    def _weigh(self, name: str, slot: int) -> costs.Choice | None:
        """Restoring checkpoint `name` against warming its prefix up, at the measured speeds (None: not
        measured, or its size unknown: restore)."""
        rates = self.rates()
        if not rates.measured or not self.settings.cost_model:
            return None
        entry = (self.read_index() or {}).get(name)
        tokens = entry.get("n_saved") if isinstance(entry, dict) else None
        if not isinstance(tokens, int) or tokens <= 0:
            return None
        size = 0
        if self.settings.save_dir:
            with contextlib.suppress(OSError):
                size = os.stat(Path(self.settings.save_dir) / name).st_size
        choice = costs.prefix_restore(tokens, size, rates)
        if choice is not None:
            self.emit(CostWeighed(self.upstream, slot, None, choice))
        return choice

    def _base(self, prefix: pfx.StablePrefix, info: ServerInfo, name: str) -> str | None:
        """The file restored before a cold prefix's warm-up (`longest_base`): the warm-up then prefills only
        what the file does not hold."""
        best = self.longest_base(prefix, info, name)
        return best[1] if best else None

    async def unbuilt(self, prefix: pfx.StablePrefix, info: ServerInfo) -> int | None:
        """No checkpoint file holds `prefix` yet (so a warm-up would prefill it): how much of it the longest
        shorter checkpoint gives (a family's base prompt; 0: none). None: it is built, or being built."""
        if not self.persist:
            return None
        fp = self.fingerprint(prefix, info)
        name = self.name_of(fp)
        if name in self.building or await asyncio.to_thread(self.file_known, name, info, False, fp):
            return None
        base = await asyncio.to_thread(self.longest_base, prefix, info, name)
        return base[0] if base is not None else 0

    def longest_base(self, prefix: pfx.StablePrefix, info: ServerInfo, name: str | None = None
                     ) -> tuple[int, str] | None:
        """The known file that holds the most of `prefix` (same route, tools and template arguments), when it is
        there to restore, with how many of its characters: one of a longer prefix that starts with it holds all
        of it (a family's, for the shared role), else the longest shorter one it starts with (the shared role,
        for a family). Reads the index: a worker thread's or a placement's work, never the hot path's."""
        best: tuple[int, str] | None = None
        for other_name, other in self.known.items():
            covered = len(prefix.text) if other.text.startswith(prefix.text) else \
                len(other.text) if prefix.text.startswith(other.text) else 0
            if (other_name == name or not covered or (best is not None and covered <= best[0])
                    or (other.role, other.route, other.tools, other.template_kwargs)
                    != (prefix.role, prefix.route, prefix.tools, prefix.template_kwargs)):
                continue
            other_fp = self.fingerprint(other, info)
            file = self.name_of(other_fp)
            if self.file_known(file, info, False, other_fp):
                best = (covered, file)
        return best

    async def _perform_within_cap(self, orch: Orchestrator, action: Action) -> Result:
        """`action`, a save only when its file fits the checkpoint cap once the least recently used files are
        gone (else a 507 for the machine: the prefix stays warm in its slot, nothing is written)."""
        if action.kind is ActionKind.SAVE and action.filename and self.settings.checkpoint_max_bytes > 0 \
                and not await asyncio.to_thread(self.room_sync, orch.warmed_to or 0, action.filename):
            return Result(507, {"error": {"type": "over_checkpoint_cap"}})
        return await self.perform(action)

    async def perform(self, action: Action) -> Result:
        if action.kind.slot_action:
            body = {"filename": action.filename} if action.filename else None
            status, data = await self.client.post_json(f"/slots/{action.slot}?action={action.kind.value}", body,
                                                        ACTION_TIMEOUT)
            answer = SlotFileAnswer.parse(action.kind.value, data) if status == 200 else None
            if answer is not None:
                self.on_answer(answer)
            return Result(status, data)
        body = dict(action.body or {})
        limit = "max_output_tokens" if action.path.endswith("/responses") else "max_tokens"
        body.update({"id_slot": action.slot, "cache_prompt": True, limit: 1, "temperature": 0.0, "stream": False})
        status, data = await self.client.post_json(action.path, body, ACTION_TIMEOUT)
        return Result(status, data)

    async def record(self, name: str, fp: str, info: ServerInfo, orch: Orchestrator) -> None:
        now = time.time()
        try:
            async with self.index.locked():
                data = self.read_index()
                if data is None:
                    return  # corrupt index: leave it for the operator (cleanup is disabled too)
                if orch.save_mismatch:  # the file holds another conversation: neither it nor its entry stays
                    if data.pop(name, None) is not None:
                        self.index.save(data)
                    if self.settings.save_dir:
                        (Path(self.settings.save_dir) / name).unlink(missing_ok=True)
                    return
                entry = data.get(name) if isinstance(data.get(name), dict) else None
                restored = orch.outcome is not None and orch.outcome.restored
                if orch.outcome is Outcome.WARMED_SAVED or (entry is None and restored):
                    entry = {"fingerprint": fp, **info.identity, "created": now,
                             "n_saved": orch.saved_tokens or orch.restored_tokens}
                if entry is not None:
                    entry["last_used"] = now
                    data[name] = entry
                    self.index.save(data)
        except Exception as e:  # the index is a convenience: never fail the request for it
            self.emit(Failed(self.upstream, Stage.CHECKPOINT_INDEX, type(e).__name__))

    async def cleanup(self, saved: str | None = None) -> list[str]:
        return await asyncio.to_thread(self.cleanup_sync, saved)

    def cleanup_sync(self, saved: str | None = None) -> list[str]:
        """Delete stale `prefix-*.bin` files from the save dir, and the least recently used beyond the cap
        (`checkpoint_files.cleanup`); `saved`, a file just written, too when it alone is over the cap."""
        return checkpoint_files.cleanup(self, saved)

    def room_sync(self, tokens: int, name: str) -> bool:
        """Room under the cap for `tokens` about to be saved as `name` (`checkpoint_files.make_room`)."""
        return checkpoint_files.make_room(self, tokens, name)
