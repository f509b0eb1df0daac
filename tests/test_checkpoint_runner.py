"""The checkpoint driver with a scripted server client: sidecar matching and concurrent cold builds."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from slotkeeper.drivers.checkpoint_runner import CheckpointRunner
from slotlogic.checkpoint_machine import Outcome
from slotlogic.costs import Rates
from slotlogic.prefix import StablePrefix, file_name
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


async def test_sessions_waiting_for_another_proxys_build_restore_it_and_never_warm_it_again(tmp_path):
    # Another proxy builds the file (its marker in the shared store: `slotkeeper.drivers.pool` puts a future in
    # `building`); this proxy's index, in another state dir, never hears of it. Both waiting sessions restore.
    server = ScriptedServer()
    m = manager(tmp_path, server)
    name = file_name(m.fingerprint(PREFIX, PROPS))
    other = m.building[name] = asyncio.get_running_loop().create_future()
    waiting = asyncio.gather(m.prepare(0, PREFIX, PROPS, holds_prefix=False),
                             m.prepare(1, PREFIX, PROPS, holds_prefix=False))
    await asyncio.sleep(0.05)
    server.saved.add(name)  # the other proxy's save, in the server's save dir
    del m.building[name]
    other.set_result(None)
    a, b = await waiting
    assert (a.outcome, b.outcome) == (Outcome.RESTORED, Outcome.RESTORED)
    assert a.spent_prefill + b.spent_prefill <= 4  # verification probes only: no 300-token warm-up
    assert sorted(c for c in server.calls if c[0] == "restore") == [("restore", 0), ("restore", 1)]


async def test_a_file_another_proxy_built_is_restored_and_a_missing_one_is_warmed(tmp_path):
    server = ScriptedServer()
    m = manager(tmp_path, server)
    name = file_name(m.fingerprint(PREFIX, PROPS))
    m.elsewhere.add(name)  # the shared store says another proxy saved it, but that file is not there
    o = await m.prepare(0, PREFIX, PROPS, holds_prefix=False)
    assert o.outcome is Outcome.WARMED_SAVED and server.calls[0] == ("restore", 0)  # tried first, then warmed
    assert name not in m.elsewhere
    m2 = manager(tmp_path / "other", server)  # a proxy with its own state dir: the file is there now
    m2.elsewhere.add(name)
    server.calls.clear()
    o2 = await m2.prepare(1, PREFIX, PROPS, holds_prefix=False)
    assert o2.outcome is Outcome.RESTORED and o2.spent_prefill <= 2


async def test_a_cold_prefix_restores_a_known_file_that_holds_it_whole_before_its_warm_up(tmp_path):
    """A family's file (the shared role + its own rules) is known; the shared role alone is not built yet: its
    warm-up restores the family file first (which starts with all of it), so it prefills the boundary, not the
    role again. A shorter file it starts with is the base otherwise; the longer one wins (it holds all)."""
    server = ScriptedServer()
    m = manager(tmp_path, server)
    role = StablePrefix("You are a research subagent.\n", "system", None, None)
    family = StablePrefix(role.text + "Family A rules.\n", "system", None, None)
    shorter = StablePrefix("You are a", "system", None, None)
    await m.prepare(0, family, PROPS, holds_prefix=False)
    await m.prepare(2, shorter, PROPS, holds_prefix=False)
    assert m.longest_base(role, PROPS) == (len(role.text), file_name(m.fingerprint(family, PROPS)))
    server.calls.clear()
    o = await m.prepare(1, role, PROPS, holds_prefix=False)
    assert server.calls[0] == ("restore", 1) and o.outcome is Outcome.WARMED_SAVED and o.spent_prefill == 1


class FilingServer(ScriptedServer):
    """Writes each saved file into the save dir, as llama-server does."""

    def __init__(self, save_dir) -> None:
        super().__init__()
        self.save_dir = save_dir

    async def post_json(self, path: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, Any]:
        if "action=save" in path and body is not None:
            (self.save_dir / body["filename"]).write_bytes(b"kv" * 100)
        return await super().post_json(path, body, timeout)


async def test_a_file_verified_on_this_server_process_is_restored_again_without_the_gates(tmp_path):
    """The restore gates (the warm-up re-sent, then a divergent probe) prefill about 12 tokens a restore, and
    each waits its turn in the server's batch loop (behind another slot's long prefill, 10-15 s a turn): once per
    file and server process is enough, until the server restarts (a new media_marker) or the file changes. A file
    the runner saved itself on this server process, from the slot it had just warmed, needs none."""
    save = tmp_path / "slots"
    save.mkdir()
    server = FilingServer(save)
    m = CheckpointRunner(server, tmp_path, Settings(checkpoints=CheckpointMode.DISK, save_dir=str(save)),  # type: ignore[arg-type]
                         [].append)
    props = {"build_info": "b1", "model_path": "/nonexistent/m.gguf", "total_slots": 8, "media_marker": "one",
             "default_generation_settings": {"n_ctx": 4096}}
    info = ServerInfo.parse(props)

    def gates(slot: int) -> int:
        return len([c for c in server.calls if c == ("chat", slot)])

    assert (await m.prepare(0, PREFIX, info, holds_prefix=False)).outcome is Outcome.WARMED_SAVED
    own = await m.prepare(1, PREFIX, info, holds_prefix=False)
    assert own.outcome is Outcome.RESTORED and gates(1) == 0 and own.spent_prefill == 0
    assert ("restore", 1) in server.calls and not own.verified
    restarted = ServerInfo.parse(props | {"media_marker": "two"})  # same file, a new server process
    verified = await m.prepare(3, PREFIX, restarted, holds_prefix=False)
    assert verified.outcome is Outcome.RESTORED and gates(3) == 2 and verified.verified
    assert (await m.prepare(4, PREFIX, restarted, holds_prefix=False)).outcome is Outcome.RESTORED and gates(4) == 0
    (name,) = [p.name for p in save.iterdir()]
    (save / name).write_bytes(b"kv" * 101)  # rewritten since it was verified
    assert (await m.prepare(5, PREFIX, restarted, holds_prefix=False)).outcome is Outcome.RESTORED and gates(5) == 2


async def test_a_save_that_holds_another_conversation_is_deleted_and_never_restored(tmp_path):
    """Another request ran on the slot between the warm-up and the save (its count is not the warm-up's): the
    file under the prefix's name holds that conversation, so it leaves the save dir and the index, and the next
    session of the prefix warms it up again instead of restoring it."""

    class Overwritten(ScriptedServer):
        async def post_json(self, path: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, Any]:
            status, data = await super().post_json(path, body, timeout)
            if path.endswith("action=save"):
                (save_dir / body["filename"]).write_bytes(b"another conversation")
                self.saves = getattr(self, "saves", 0) + 1
                return status, {"n_saved": 3049} if self.saves == 1 else data
            return status, data

    save_dir = tmp_path / "slots"
    save_dir.mkdir()
    server = Overwritten()
    m = CheckpointRunner(server, tmp_path, Settings(checkpoints=CheckpointMode.DISK, save_dir=str(save_dir)),
                         [].append)  # type: ignore[arg-type]
    first = await m.prepare(0, PREFIX, PROPS, holds_prefix=False)
    assert first.outcome is Outcome.WARMED and first.save_mismatch
    assert list(save_dir.iterdir()) == [] and m.read_index() in ({}, None)
    server.calls.clear()
    again = await m.prepare(1, PREFIX, PROPS, holds_prefix=False)
    assert "restore" not in [c[0] for c in server.calls] and again.outcome is Outcome.WARMED_SAVED


class FileWritingServer(ScriptedServer):
    """Saves write real files (`per_token` bytes a token, as llama-server's slot files: KV bytes × tokens) into the
    save dir; each save's moment is sampled: the save dir's prefix bytes right after the file is written."""

    def __init__(self, save_dir, per_token: int) -> None:
        super().__init__()
        self.save_dir, self.per_token, self.peaks = save_dir, per_token, []

    async def post_json(self, path: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, Any]:
        status, data = await super().post_json(path, body, timeout)
        if path.endswith("action=save"):
            (self.save_dir / body["filename"]).write_bytes(b"\0" * (data["n_saved"] * self.per_token))
            self.peaks.append(self.prefix_bytes())
            return status, {**data, "n_written": data["n_saved"] * self.per_token}
        return status, data

    def prefix_bytes(self) -> int:
        """The save dir's prefix bytes now; a file the runner deletes between the listing and its stat (its
        cleanup runs in a worker thread) no longer counts."""
        total = 0
        for path in self.save_dir.glob("prefix-*.bin"):
            with contextlib.suppress(FileNotFoundError):
                total += path.stat().st_size
        return total


async def test_prefix_checkpoints_stay_under_their_cap_at_every_save(tmp_path):
    """40 sessions, each with its own text before the marker (any client can do it), filled the save dir with 40
    prefix files: no cap by default, cleanup once per process and only past 30 days. Now the cap holds at every
    save: the least recently used files go first to make room, the first save included (its size from the
    measured KV bytes per token, else the files already indexed)."""
    save_dir = tmp_path / "slots"
    save_dir.mkdir()
    server = FileWritingServer(save_dir, per_token=1000)  # 301 tokens: ~301 KB a file
    cap = 1 << 20
    m = CheckpointRunner(server, tmp_path, Settings(checkpoints=CheckpointMode.DISK, save_dir=str(save_dir),
                                                    checkpoint_max_bytes=cap), [].append)  # type: ignore[arg-type]
    prefixes = [StablePrefix(f"You are agent {i}.", "system", None, None) for i in range(40)]
    for i in range(0, 40, 4):  # four at a time, as sessions arrive together
        await asyncio.gather(*(m.prepare(j % 4, prefixes[j], PROPS, holds_prefix=False) for j in range(i, i + 4)))
    files = list(save_dir.glob("prefix-*.bin"))
    assert max(server.peaks) <= cap and server.prefix_bytes() <= cap and 2 <= len(files) <= 3
    last = [p for p in prefixes[-4:] if file_name(m.fingerprint(p, PROPS)) in {f.name for f in files}]
    assert last  # the most recently used stay (saves that found no room in time only warmed their slot)
    server.calls.clear()
    again = await m.prepare(0, last[0], PROPS, holds_prefix=False)
    assert again.outcome is Outcome.RESTORED and ("restore", 0) in server.calls


async def test_a_prefix_larger_than_the_whole_cap_is_never_saved(tmp_path):
    save_dir = tmp_path / "slots"
    save_dir.mkdir()
    server = FileWritingServer(save_dir, per_token=10_000)  # ~3 MB a file against a 1 MB cap
    m = CheckpointRunner(server, tmp_path, Settings(checkpoints=CheckpointMode.DISK, save_dir=str(save_dir),
                                                    checkpoint_max_bytes=1 << 20), [].append)  # type: ignore[arg-type]
    first = await m.prepare(0, PREFIX, PROPS, holds_prefix=False)  # size unknown yet: saved, then deleted
    assert first.outcome is Outcome.WARMED_SAVED and list(save_dir.iterdir()) == []
    m.rates = lambda: Rates(kv_bytes_per_token=10_000.0)  # measured from that save's answer
    server.calls.clear()
    second = await m.prepare(1, StablePrefix("You are other.", "system", None, None), PROPS, holds_prefix=False)
    assert second.outcome is Outcome.WARMED and "save" not in [c[0] for c in server.calls]
    assert list(save_dir.iterdir()) == []
