"""The model checks of one llama-server, at start and after a restart with another model: the I/O half.

It reads the GGUF header when the model file is on this machine, runs the start-up probe when it matters (a
sliding-window or recurrent model with slot files wanted: does this build put checkpoints into slot files?)
or when asked (`slots_throughput_probe`), logs what it found and keeps the verdict. `slotlogic.capability` and
`slotlogic.model_facts` decide. Fails open: anything that goes wrong leaves files on and no measured speed,
with one line. docs/model-capability.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from slotkeeper.drivers import gguf_io
from slotkeeper.drivers.llama_http import LlamaClient
from slotlogic import capability, numbers
from slotlogic.capability import Throughput, Verdict
from slotlogic.costs import SlotFileAnswer
from slotlogic.events import Event, Failed, ModelDescribed, ModelHeader, Probed, Stage
from slotlogic.ledger import Fence
from slotlogic.model_facts import ModelFacts
from slotlogic.server import ServerInfo
from slotlogic.settings import CheckpointMode, Settings

PROBE_TIMEOUT = 120.0


class ProbeTurns(Protocol):
    """The core's rules for the probe's slot (`slotlogic.turns.Turns`)."""

    def probe_slot(self, live: Sequence[Mapping[str, Any]] | None, total: int) -> Fence | None: ...

    def probe_may_write(self, fence: Fence) -> bool: ...

    def probe_done(self, fence: Fence, erased: bool) -> None: ...


class ModelCheck:
    def __init__(self, client: LlamaClient, emit: Callable[[Event], None], upstream: str,
                 on_speed: Callable[[float | None], None] = lambda pps: None, turns: ProbeTurns | None = None) -> None:
        self.client = client
        self.turns = turns  # the core's word on which slot the probe may write, and when (`Turns.probe_slot`)
        self.on_speed = on_speed  # the measured prefill speed, for answers without timings (Keeper.prefill_speed)
        self.on_answer: Callable[[SlotFileAnswer], None] = lambda a: None  # the probe save's size and time
        self.emit = emit
        self.upstream = upstream
        self.facts: ModelFacts | None = None
        self.verdict: Verdict | None = None
        self.speed: Throughput | None = None
        self.files_blocked = False
        self.n_ctx: int | None = None
        self._seen: tuple[str | None, str | None] | None = None   # (model_path, media_marker) last checked
        self._described: tuple[object, ...] | None = None
        self._probed: str | None = None                           # media_marker of the server last probed

    def due(self, info: ServerInfo) -> bool:
        """A `/props` answer from a server (or a server process, or a model file) not checked yet."""
        return (info.model_path, info.media_marker) != self._seen

    def forget(self) -> None:
        """Settings the verdict depends on changed: the next `/props` checks again (the header stays cached)."""
        self._seen = None
        self._probed = None

    def claim(self, info: ServerInfo) -> None:
        """Mark `info` as being checked (before the check's task runs: one check per server process)."""
        self._seen = (info.model_path, info.media_marker)

    async def run(self, info: ServerInfo, settings: Settings, on_change: Callable[[], None]) -> None:
        """Check the model behind `info`; `on_change` is called when the slot-file verdict changes."""
        self.claim(info)
        self.n_ctx = info.n_ctx
        try:
            facts, read = await gguf_io.model_facts_async(info.model_path)
            if read.status is not gguf_io.ReadStatus.OK or self.facts != facts:
                self.emit(ModelHeader(self.upstream, read.status.value, len(read.metadata or {}), read.seconds,
                                      read.peak_rss_growth, read.detail))
            self.facts = facts
            wanted = bool(settings.save_dir) and (settings.paging or settings.checkpoints is CheckpointMode.DISK)
            check = facts is not None and capability.needs_file_check(facts, settings.swa_full, wanted)
            if check and not self.files_blocked:   # until the probe save has told
                self.files_blocked = True
                on_change()
            in_files = self.verdict.checkpoints_in_files if self.verdict and not check else None
            if (check or settings.throughput_probe) and self._probed != info.media_marker:
                self._probed = info.media_marker
                in_files = await self._probe(info, settings, facts if check else None)
            self.verdict = capability.verdict(facts, settings.swa_full, in_files)
            blocked = wanted and not self.verdict.files_ok
            if facts is not None:
                described = (facts, settings.swa_full, settings.cache_type_k, settings.cache_type_v, info.n_ctx,
                             in_files, wanted)
                if described != self._described:
                    self._described = described
                    paging = settings.page_max_bytes if settings.paging and settings.save_dir \
                        and not settings.page_budget_auto else 0  # a budget of the user's: said if too small
                    self.emit(ModelDescribed(self.upstream, facts, settings.cache_type_k, settings.cache_type_v,
                                             info.n_ctx, settings.swa_full, in_files, wanted, paging,
                                             info.total_slots))
            if blocked != self.files_blocked:
                self.files_blocked = blocked
                on_change()
        except Exception as e:  # fail open: files as configured
            self.emit(Failed(self.upstream, Stage.MODEL_CHECK, type(e).__name__))
            if self.files_blocked:
                self.files_blocked = False
                on_change()

    async def _probe(self, info: ServerInfo, settings: Settings, facts: ModelFacts | None) -> bool | None:
        """The start-up probe; returns whether the saved probe file carried checkpoints (None: not saved)."""
        live = await self.client.slots()
        if self.turns is not None:
            fence = self.turns.probe_slot(live, info.total_slots)
            slot = fence.slot if fence is not None else None
        else:  # no core at hand (a check on its own): an empty idle slot as `/slots` shows it
            fence, slot = None, capability.probe_slot(live, info.total_slots)
        if slot is None:
            self.emit(Probed(self.upstream, None, None, None, None, None, None))
            return None

        def may_write() -> bool:  # a session of ours placed on the slot since (every slot busy): leave it alone
            return fence is None or self.turns is None or self.turns.probe_may_write(fence)

        erased = False
        try:
            status, answer = await self.client.post_json("/completion", capability.probe_request(slot), PROBE_TIMEOUT)
            speed = capability.throughput(answer, slot) if status == 200 else None
            if settings.throughput_probe and speed is not None:
                self.speed = speed
                self.on_speed(speed.prefill_tok_s)
            in_files = None
            name = capability.probe_file(self.upstream)
            if (facts is not None or settings.throughput_probe) and status == 200 and settings.save_dir \
                    and may_write():
                code, saved = await self.client.post_json(f"/slots/{slot}?action=save", {"filename": name},
                                                          PROBE_TIMEOUT)
                answer = SlotFileAnswer.parse("save", saved) if code == 200 else None
                if answer is not None:
                    self.on_answer(answer)
                if answer is not None and settings.throughput_probe and may_write():  # the restore speed too
                    code, restored = await self.client.post_json(f"/slots/{slot}?action=restore",
                                                                 {"filename": name}, PROBE_TIMEOUT)
                    back = SlotFileAnswer.parse("restore", restored) if code == 200 else None
                    if back is not None:
                        self.on_answer(back)
                n_saved, n_written = (numbers.count(saved.get("n_saved")), numbers.count(saved.get("n_written"))) \
                    if isinstance(saved, dict) else (None, None)
                if facts is not None and n_saved is not None and n_written is not None:
                    in_files = facts.file_has_checkpoints(n_saved, n_written, n_streams=info.total_slots)
                await asyncio.to_thread(_remove, Path(settings.save_dir) / name)
            if settings.save_dir and may_write():
                await self.client.post_json(f"/slots/{slot}?action=erase", None, PROBE_TIMEOUT)
                erased = True
        finally:
            if fence is not None and self.turns is not None:
                self.turns.probe_done(fence, erased)
        self.emit(Probed(self.upstream, slot, speed.prefill_tok_s if speed else None,
                         speed.decode_tok_s if speed else None, speed.prompt_n if speed else None,
                         speed.predicted_n if speed else None, in_files))
        return in_files

    def status(self, settings: Settings) -> dict[str, object]:
        return capability.status(self.facts, self.verdict, self.speed, page_budget_bytes=settings.page_max_bytes,
                                 paging=settings.paging, cache_type_k=settings.cache_type_k,
                                 cache_type_v=settings.cache_type_v, n_ctx=self.n_ctx)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)
