"""The checkpoint driver with a scripted server client: sidecar matching and concurrent cold builds."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from drivers.checkpoint_runner import CheckpointRunner
from slotlogic.checkpoint_machine import Outcome
from slotlogic.prefix import StablePrefix
from slotlogic.server import ServerInfo
from slotlogic.settings import CheckpointMode, Settings

PROPS = ServerInfo.parse({"build_info": "b1", "model_path": "/nonexistent/m.gguf", "total_slots": 4,
                         "default_generation_settings": {"n_ctx": 4096}})
PREFIX = StablePrefix("You are pi.", "system", None, None)


class ScriptedServer:
    """Answers like llama-server: warm-ups prefill 300 tokens cold, re-sends hit the cache; save/restore work."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.saved: set[str] = set()

    async def post_json(self, path: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, Any]:
        if path.startswith("/slots/"):
            slot, action = int(path.split("/")[2].split("?")[0]), path.split("action=")[1]
            self.calls.append((action, slot))
            if action == "save":
                self.saved.add(body["filename"])
                return 200, {"n_saved": 301}
            if action == "restore":
                ok = body["filename"] in self.saved
                return (200, {"n_restored": 301}) if ok else (400, {"error": {"message": "no file"}})
            return 200, {"n_erased": 0}
        self.calls.append(("chat", body["id_slot"]))
        await asyncio.sleep(0.05)  # a cold warm-up takes a while: the window for a second session
        warm = any(a in ("restore", "save") and s == body["id_slot"] for a, s in self.calls)
        return 200, {"timings": {"cache_n": 300 if warm else 0, "prompt_n": 1 if warm else 300}}


def manager(tmp_path, server) -> CheckpointRunner:
    settings = Settings(checkpoints=CheckpointMode.DISK, save_dir=None)
    return CheckpointRunner(server, tmp_path, settings, [].append)  # type: ignore[arg-type]


async def test_sessions_starting_together_build_the_prefix_once(tmp_path):
    server = ScriptedServer()
    m = manager(tmp_path, server)
    a, b = await asyncio.gather(m.prepare(0, PREFIX, PROPS, holds_prefix=False),
                                m.prepare(1, PREFIX, PROPS, holds_prefix=False))
    assert (a.outcome, b.outcome) == (Outcome.WARMED_SAVED, Outcome.RESTORED)
    assert [c for c in server.calls if c[0] == "chat" and c[1] == 0] == [("chat", 0)]  # one cold build
    assert ("restore", 1) in server.calls and a.spent_prefill == 300 and b.spent_prefill <= 2
    index = json.loads((tmp_path / "checkpoints.json").read_text())
    (entry,) = index.values()
    assert entry["build_info"] == "b1" and entry["total_slots"] == 4 and entry["n_ctx"] == 4096


async def test_a_file_from_another_server_configuration_is_not_restored(tmp_path):
    server = ScriptedServer()
    m = manager(tmp_path, server)
    await m.prepare(0, PREFIX, PROPS, holds_prefix=False)
    other = ServerInfo.parse({**PROPS.raw, "total_slots": 2})
    server.calls.clear()
    o = await m.prepare(1, PREFIX, other, holds_prefix=False)
    assert "restore" not in [c[0] for c in server.calls] and o.outcome is Outcome.WARMED_SAVED


async def test_holding_slot_costs_nothing(tmp_path):
    server = ScriptedServer()
    o = await manager(tmp_path, server).prepare(2, PREFIX, PROPS, holds_prefix=True)
    assert o.outcome is Outcome.HIT and server.calls == []
