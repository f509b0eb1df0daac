"""The async driver for prefix checkpoints: runs `slotlogic.checkpoint.Orchestrator` against llama-server.

It performs the actions the pure state machine asks for (`POST /slots/{id}?action=restore|save|erase`,
pinned warm-up and verification requests, each with a 120 s timeout), keeps the checkpoint index (one
private JSON file in the state dir: per file the fingerprint, `build_info`, `model_path`, `total_slots`,
per-slot `n_ctx`, created and last-used times), refuses files whose sidecar does not match the running
server, and runs the stale-file cleanup once per process and on command.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drivers.llama_client import LlamaClient
from drivers.state_store import CorruptFile, JsonFile
from slotlogic import __version__, cleanup
from slotlogic import prefix as pfx
from slotlogic.checkpoint import Action, Orchestrator, Result

log = logging.getLogger("slotkeeper")
ACTION_TIMEOUT = 120.0
INDEX_FILE = "checkpoints.json"


@dataclass
class CheckpointSettings:
    mode: str = "off"                 # off | memory | disk
    save_dir: str | None = None       # must equal llama-server's --slot-save-path
    server_id: str = ""
    markers: tuple[str, ...] = pfx.DEFAULT_MARKERS
    ttl_days: float = 30.0
    keep_recent: int = 3
    max_mb: int = 0


@dataclass
class ServerFacts:
    """What the sidecar must match before a file is restored."""

    build_info: str | None
    model_path: str | None
    total_slots: int | None
    n_ctx: int | None

    @classmethod
    def from_props(cls, props: dict[str, Any]) -> ServerFacts:
        dgs = props.get("default_generation_settings")
        return cls(props.get("build_info"), props.get("model_path"), props.get("total_slots"),
                   dgs.get("n_ctx") if isinstance(dgs, dict) else None)

    def as_dict(self) -> dict[str, Any]:
        return {"build_info": self.build_info, "model_path": self.model_path, "total_slots": self.total_slots,
                "n_ctx": self.n_ctx}


@dataclass
class CheckpointManager:
    client: LlamaClient
    state_dir: Path
    settings: CheckpointSettings
    current: set[str] = field(default_factory=set)
    building: dict[str, asyncio.Future[None]] = field(default_factory=dict)  # cold builds in flight
    warned: set[str] = field(default_factory=set)
    cleaned: bool = False

    @property
    def index(self) -> JsonFile:
        return JsonFile(self.state_dir / INDEX_FILE)

    @property
    def persist(self) -> bool:
        return self.settings.mode == "disk"

    def fingerprint(self, prefix: pfx.StablePrefix, props: dict[str, Any]) -> str:
        model_path = props.get("model_path") if isinstance(props.get("model_path"), str) else None
        size = mtime = None
        if model_path and os.path.exists(model_path):
            stat = os.stat(model_path)
            size, mtime = stat.st_size, stat.st_mtime
        return pfx.fingerprint(prefix, model_path=model_path, model_size=size, model_mtime=mtime,
                               build_info=props.get("build_info"), server_id=self.settings.server_id,
                               addon_version=__version__)

    def read_index(self) -> dict[str, Any] | None:
        """The index (empty when missing); None when corrupt."""
        try:
            data = self.index.load()
        except CorruptFile:
            return None
        return data if isinstance(data, dict) else {}

    def file_known(self, name: str, facts: ServerFacts) -> bool:
        entry = (self.read_index() or {}).get(name)
        if not isinstance(entry, dict):
            return False
        mismatch = [k for k, v in facts.as_dict().items() if entry.get(k) != v]
        if mismatch:
            log.info("slotkeeper: prefix-cache %s was saved by another server configuration (%s differ); not "
                     "restored", name, ", ".join(mismatch))
            return False
        return not self.settings.save_dir or (Path(self.settings.save_dir) / name).exists()

    async def prepare(self, slot: int, prefix: pfx.StablePrefix, props: dict[str, Any], *,
                      holds_prefix: bool) -> Orchestrator:
        """Make `slot` hold `prefix` before a new session's first request. Never raises for HTTP trouble."""
        facts = ServerFacts.from_props(props)
        fp = self.fingerprint(prefix, props)
        name = pfx.file_name(fp)
        self.current.add(name)
        pending = self.building.get(name)
        if pending is not None and not holds_prefix and self.persist:
            # Sessions that start together share a prefix: wait for the one cold build, then restore it
            # instead of prefilling the same prefix once per session.
            log.info("slotkeeper: prefix-cache waiting for the build of %s in progress", name)
            await asyncio.shield(pending)
        own: asyncio.Future[None] | None = None
        if self.persist and not holds_prefix and name not in self.building:
            own = self.building[name] = asyncio.get_running_loop().create_future()
        try:
            return await self._prepare(slot, prefix, props, facts, fp, name, holds_prefix)
        finally:
            if own is not None:
                self.building.pop(name, None)
                own.set_result(None)

    async def _prepare(self, slot: int, prefix: pfx.StablePrefix, props: dict[str, Any], facts: ServerFacts,
                       fp: str, name: str, holds_prefix: bool) -> Orchestrator:
        orch = Orchestrator(slot, prefix, name, persist=self.persist, holds_prefix=holds_prefix,
                            file_known=self.persist and self.file_known(name, facts))
        log.info("slotkeeper: prefix-cache fingerprint=%s… slot=%d", fp[:16], slot)
        while (action := orch.next_action()) is not None:
            orch.feed(await self.perform(action))
        for line in orch.lines:
            log.info("slotkeeper: prefix-cache %s", line)
        if orch.missing_save_path and "save-path" not in self.warned:
            self.warned.add("save-path")
            log.warning("slotkeeper: llama-server has no --slot-save-path (save/restore answered 501): start it "
                        "with --slot-save-path DIR and set slots_save_dir=DIR, or use slots_prefix_cache=memory")
        if self.persist:
            await self.record(name, fp, facts, orch)
            if not self.cleaned:
                self.cleaned = True
                await self.cleanup()
        return orch

    async def perform(self, action: Action) -> Result:
        if action.kind in ("restore", "save", "erase"):
            body = {"filename": action.filename} if action.filename else None
            status, data = await self.client.post_json(f"/slots/{action.slot}?action={action.kind}", body,
                                                        ACTION_TIMEOUT)
            return Result(status, data)
        body = dict(action.body or {})
        body.update({"id_slot": action.slot, "cache_prompt": True, "max_tokens": 1, "temperature": 0.0,
                     "stream": False})
        status, data = await self.client.post_json("/v1/chat/completions", body, ACTION_TIMEOUT)
        return Result(status, data)

    async def record(self, name: str, fp: str, facts: ServerFacts, orch: Orchestrator) -> None:
        now = time.time()
        try:
            async with self.index.locked():
                data = self.read_index()
                if data is None:
                    return  # corrupt index: leave it for the operator (cleanup is disabled too)
                entry = data.get(name) if isinstance(data.get(name), dict) else None
                if orch.outcome == "warmed-saved" or (entry is None and orch.outcome.startswith("restored")):
                    entry = {"fingerprint": fp, **facts.as_dict(), "created": now,
                             "n_saved": orch.saved_tokens or orch.restored_tokens}
                if entry is not None:
                    entry["last_used"] = now
                    data[name] = entry
                    self.index.save(data)
        except Exception as e:  # the index is a convenience: never fail the request for it
            log.warning("slotkeeper: prefix-cache index update failed: %r", e)

    async def cleanup(self) -> list[str]:
        return await asyncio.to_thread(self.cleanup_sync)

    def cleanup_sync(self) -> list[str]:
        """Delete stale `prefix-*.bin` files from the save dir (see slotlogic.cleanup for the rules)."""
        s = self.settings
        if not s.save_dir or not os.path.isdir(s.save_dir):
            return []
        index = self.read_index()
        if index is None:
            log.warning("slotkeeper: prefix-cache index %s is corrupt: cleanup disabled", self.index.path)
            return []
        files = []
        for entry in os.scandir(s.save_dir):
            if entry.is_file() and pfx.FILE_RE.match(entry.name):
                st = entry.stat()
                files.append(cleanup.FileInfo(entry.name, st.st_size, st.st_mtime))
        doomed = cleanup.plan_cleanup(files, index, current=self.current, now=time.time(), ttl_days=s.ttl_days,
                                      keep_recent=s.keep_recent, max_bytes=s.max_mb * 1024 * 1024)
        for name in doomed:
            try:
                os.unlink(os.path.join(s.save_dir, name))
            except OSError as e:
                log.warning("slotkeeper: prefix-cache could not delete %s: %r", name, e)
        if doomed:
            log.info("slotkeeper: prefix-cache cleanup deleted %d file(s): %s", len(doomed), ", ".join(doomed))
            with self.index.locked_sync():
                data = self.read_index() or {}
                for name in doomed:
                    data.pop(name, None)
                self.index.save(data)
        return doomed
