"""The slot simulator behaves as llama-server does where slotkeeper depends on it (docs/simulator.md)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from bench.sim.clock import VirtualClock, run
from bench.sim.llama import SimServer, render_chat
from bench.sim.transport import transport
from slotkeeper.drivers.llama_http import LlamaClient


def body(*turns: str, system: str = "You are a coding agent . " * 10, **extra: Any) -> dict[str, Any]:
    msgs = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return {"messages": msgs, **extra}


def sim(main: Any) -> Any:
    return run(VirtualClock(), main)


def test_a_pinned_turn_reuses_its_previous_turn_and_the_ground_truth_says_so():
    async def main() -> None:
        s = SimServer(2)
        first = await s.completion("/v1/chat/completions", body("task A", id_slot=0), tag="A").done
        n1 = len(render_chat(body("task A")))
        assert first["timings"] == first["timings"] | {"cache_n": 0, "prompt_n": n1}
        second = body("task A", first["content"], "go on", id_slot=0)
        r = await s.completion("/v1/chat/completions", second, tag="A").done
        gen = len(first["content"].split())
        assert r["timings"]["cache_n"] == n1 + gen and s.done[-1].expected == n1 + gen and s.done[-1].lost == 0
        assert s.prefill_tokens == n1 + r["timings"]["prompt_n"]
        assert s.now() > 0  # the prefill took virtual time
    sim(main)


def test_a_full_hit_evaluates_the_last_token_again():
    async def main() -> None:
        s = SimServer(1)
        await s.completion("/completion", {"prompt": "a b c d", "id_slot": 0}).done
        r = await s.completion("/completion", {"prompt": "a b c d", "id_slot": 0}).done
        assert (r["timings"]["cache_n"], r["timings"]["prompt_n"]) == (3, 1)
    sim(main)


def test_unpinned_requests_take_the_most_similar_idle_slot_else_lru_with_ties_to_the_highest():
    async def main() -> None:
        s = SimServer(3)
        r = await s.completion("/v1/chat/completions", body("x")).done
        assert r["id_slot"] == 2  # a fresh server: every t_last_used ties, the highest id wins
        r = await s.completion("/v1/chat/completions", body("x", "y", "z")).done
        assert r["id_slot"] == 2  # similarity: slot 2 holds the shared prefix
        r = await s.completion("/v1/chat/completions", body("other", system="a different prompt " * 10)).done
        assert r["id_slot"] == 1
    sim(main)


def test_a_busy_slot_defers_save_and_restore_until_it_is_idle(tmp_path: Path):
    async def main() -> None:
        s = SimServer(2, save_dir=tmp_path)
        long = s.completion("/v1/chat/completions", body("long " * 4000, id_slot=0), tag="A")
        await long.started
        save = s.action(0, "save", "page-a.bin")
        await asyncio.sleep(0.1)
        assert not save.done.done()  # waits for the request
        status, data = await save.done
        assert long.done.done() and status == 200 and data["n_saved"] == len(s.slots[0].tokens)
        assert (tmp_path / "page-a.bin").stat().st_size == data["n_written"]
        await s.action(1, "restore", "page-a.bin").done
        assert s.slots[1].tokens == s.slots[0].tokens
    sim(main)


def test_a_slot_action_waits_for_the_prompt_batch_running_on_another_slot(tmp_path: Path):
    """The server takes queued tasks only between two batches: a save of an idle slot sent while another slot
    prefills waits for that batch (a prompt shorter than `n_batch`: all of it), not for the whole request."""
    async def main() -> None:
        s = SimServer(2, save_dir=tmp_path, prefill_speed=1000.0, n_batch=512)
        long = s.completion("/v1/chat/completions", body("long " * 1500, id_slot=0), tag="A")
        await long.started
        t0 = s.now()
        await asyncio.sleep(0.1)
        status, _ = await s.action(1, "save", "page-b.bin").done
        assert status == 200 and s.now() - t0 == pytest.approx(0.513, abs=0.002)  # batch of 512 ends, + the save
        assert not long.done.done()                                    # the request itself runs on
        await long.done
        t1 = s.now()
        await s.action(1, "save", "page-b.bin").done
        assert s.now() - t1 < 0.01                                     # nothing prefills: at once
    sim(main)


def test_a_failed_restore_wipes_the_slot(tmp_path: Path):
    async def main() -> None:
        s = SimServer(1, save_dir=tmp_path)
        await s.completion("/completion", {"prompt": "a b c", "id_slot": 0}).done
        status, _ = await s.action(0, "restore", "missing.bin").done
        assert status == 400 and s.slots[0].tokens == []
        await s.action(0, "save", "x.bin").done
        (tmp_path / "x.bin").unlink()  # the proxy deleted the page: the server cannot read it
        assert (await s.action(0, "restore", "x.bin").done)[0] == 400
    sim(main)


def test_a_restart_empties_the_slots_fails_what_runs_and_rejects_files_of_another_build(tmp_path: Path):
    async def main() -> None:
        s = SimServer(2, save_dir=tmp_path)
        await s.completion("/completion", {"prompt": "a b c", "id_slot": 0}).done
        await s.action(0, "save", "p.bin").done
        running = s.completion("/completion", {"prompt": "x " * 5000, "id_slot": 1})
        await running.started
        marker = s.props()["media_marker"]
        s.restart(build="b2-sim")
        assert s.props()["media_marker"] != marker and all(not e.get("n_prompt_tokens") for e in s.slots_view())
        assert isinstance(await asyncio.gather(running.done, return_exceptions=True), list)
        assert running.done.exception() is not None
        assert (await s.action(0, "restore", "p.bin").done)[0] == 400
    sim(main)


def test_unified_kv_clears_idle_slots_when_another_starts():
    async def main() -> None:
        s = SimServer(2, unified_idle_clear=True)
        await s.completion("/completion", {"prompt": "a b c", "id_slot": 0}).done
        await s.completion("/completion", {"prompt": "d e f", "id_slot": 1}).done
        assert s.slots[0].tokens == []
    sim(main)


def test_the_real_http_client_talks_to_the_simulator(tmp_path: Path):
    async def main() -> None:
        s = SimServer(4, save_dir=tmp_path)
        c = LlamaClient("http://sim:8080", transport=transport(s))
        props = await c.props()
        assert props is not None and props["total_slots"] == 4
        status, data = await c.post_json("/v1/chat/completions", body("hi", id_slot=3, max_tokens=2), 5.0)
        assert status == 200 and data["timings"]["prompt_n"] > 0 and data["choices"][0]["message"]["content"]
        assert (await c.slots())[3]["n_prompt_tokens"] > 0
        assert (await c.post_json("/slots/3?action=save", {"filename": "f.bin"}, 5.0))[1]["n_saved"] > 0
        assert (await c.post_json("/slots/9?action=save", {"filename": "f.bin"}, 5.0))[0] == 400
        assert await c.health() == "ok"
        await c.aclose()
    sim(main)
