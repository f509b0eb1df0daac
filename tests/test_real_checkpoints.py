"""Prefix checkpoints end to end on a real llama-server with --slot-save-path, through a real mitmdump."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from bench.real.llama_server import LlamaServer
from bench.real.mitmdump import MitmProxy
from tests.real_helpers import SYSTEM, THREADS, ask, jsonl

pytestmark = pytest.mark.real


def conv(first: str, cwd: str = "/home/u/proj") -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM + f"\n<cwd>{cwd}</cwd>"}, {"role": "user", "content": first}]


def checkpoints(log: Path) -> list[dict]:
    return [r for r in jsonl(log) if r.get("kind") == "checkpoint"]


@pytest.fixture
def dirs(tmp_path):
    slots = tmp_path / "slots"
    slots.mkdir()
    return tmp_path, slots


def proxy_opts(tmp: Path, slots: Path) -> dict[str, object]:
    return {"slots_state_dir": str(tmp / "state"), "slots_save_dir": str(slots),
            "slots_log_file": str(tmp / "req.jsonl"), "slots_probe_interval": 0}


def test_new_sessions_start_warm_and_a_restarted_server_restores(dirs):
    tmp, slots = dirs
    log = tmp / "req.jsonl"
    srv = LlamaServer(threads=THREADS, slots=4, ctx_per_slot=4096, slot_save_path=str(slots),
                      log_path=str(tmp / "s.log"))
    with srv, MitmProxy(srv.url, proxy_opts(tmp, slots), log_path=str(tmp / "p.log")) as px:
        a = ask(px.url, conv("Task A: first window."))
        b = ask(px.url, conv("Task B: second window, other project.", cwd="/srv/other"))
        first, second = checkpoints(log)
        assert first["outcome"] == "warmed-saved" and second["outcome"] == "restored"
        prefix_tokens = first["prompt_n"]
        assert a.slot != b.slot
        assert a.cache_n >= 0.9 * prefix_tokens and b.cache_n >= 0.9 * prefix_tokens  # both start warm
        assert len(list(slots.glob("prefix-*.bin"))) == 1
        d = ask(px.url, conv("Task D: a third window.", cwd="/srv/third"))
        assert checkpoints(log)[2]["outcome"] == "restored" and d.cache_n >= 0.9 * prefix_tokens

        srv.restart()  # a new process: every slot is empty, only the files survive
        c = ask(px.url, conv("Task C: after the restart."))
    third = checkpoints(log)[3]
    assert third["outcome"] == "restored"
    assert c.cache_n >= 0.9 * prefix_tokens, (c, prefix_tokens)  # the first request after a restart
    assert c.prompt_n <= 0.1 * prefix_tokens + 60  # ≤ 10% of the prefix + its own user message
    text = (tmp / "p.log").read_text()
    assert "prefix-cache SAVED prefix-" in text
    # the gates ran once per server process, and not for the file this proxy saved on it itself: b and d
    # restored as saved there, c after the restart passed them
    assert text.count("prefix-cache RESTORE verified: identical") == 1
    assert text.count("prefix-cache RESTORE as verified before on this server") == 2


def test_corrupt_or_stale_checkpoint_is_detected_erased_and_rebuilt(dirs):
    tmp, slots = dirs
    log = tmp / "req.jsonl"
    srv = LlamaServer(threads=THREADS, slots=2, ctx_per_slot=4096, slot_save_path=str(slots),
                      log_path=str(tmp / "s.log"))
    with srv, MitmProxy(srv.url, proxy_opts(tmp, slots), log_path=str(tmp / "p.log")) as px:
        ask(px.url, conv("Task A: build the checkpoint."))
        (good,) = slots.glob("prefix-*.bin")

        # 1) garbage bytes: the restore fails (400), the slot is rebuilt cold and the file rewritten
        good.write_bytes(b"ggsq" + b"\x00" * 64)
        srv.restart()
        r1 = ask(px.url, conv("Task B: garbage file."))
        # 2) a valid file of another prefix under this name: restore succeeds, the identical gate catches it
        other = tmp / "other.bin"
        shutil.copy(good, other)
        ask(px.url, [{"role": "system", "content": "Unrelated assistant prompt. " * 30 + "\n<cwd>/x"},
                     {"role": "user", "content": "other"}])
        (other_file,) = set(slots.glob("prefix-*.bin")) - {good}
        shutil.copy(other_file, good)
        srv.restart()
        r2 = ask(px.url, conv("Task C: stale file."))
        srv.restart()
        r3 = ask(px.url, conv("Task D: the rebuilt file restores again."))
    records = checkpoints(log)
    outcomes = [c["outcome"] for c in records]
    assert outcomes[1] == "warmed-saved"  # garbage: restore 400 → cold → saved anew
    assert outcomes[3] == "warmed-saved"  # stale: verify failed → erase → cold → saved anew
    assert outcomes[4] == "restored"
    # r3 starts from the rebuilt file: (nearly) the whole prefix, the first build's prompt_n (215 tokens; this
    # was "> 250" when real_helpers.SYSTEM made a ~455-token prefix)
    assert r1.prompt_n > 0 and r2.prompt_n > 0 and r3.cache_n >= 0.9 * records[0]["prompt_n"], (r3, records[0])
    text = (tmp / "p.log").read_text()
    assert "RESTORE rejected: identical" in text and "no checkpoint (restore HTTP 400" in text
    assert "Traceback" not in text


def test_missing_slot_save_path_is_reported_and_the_request_still_served(tmp_path):
    """Persistence asked for, but llama-server was started without --slot-save-path: one clear warning."""
    log = tmp_path / "p.log"
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_prefix_cache": "disk", "slots_probe_interval": 0}
    with LlamaServer(threads=THREADS, slots=2, ctx_per_slot=4096, log_path=str(tmp_path / "s.log")) as srv, \
            MitmProxy(srv.url, opts, log_path=str(log)) as px:
        first = ask(px.url, conv("Task A: no save path."))
        second = ask(px.url, conv("Task B: no save path either."))
    text = log.read_text()
    assert text.count("has no --slot-save-path") == 1 and "slots_save_dir=DIR" in text
    assert first.cache_n > 0 and second.prompt_n > 0  # warmed in memory, requests served


def generic(first: str, cwd: str) -> list[dict[str, str]]:
    """No known marker: the shared part, then a per-session environment block."""
    env = f"\n\n# Environment\nWorking directory: {cwd}\nToday's date: 2026-11-30"
    return [{"role": "system", "content": SYSTEM.replace(". ", ".\n") + env}, {"role": "user", "content": first}]


@contextmanager
def four_slots(tmp: Path, slots: Path, **opts: object) -> Iterator[tuple[LlamaServer, MitmProxy]]:
    srv = LlamaServer(threads=THREADS, slots=4, ctx_per_slot=4096, slot_save_path=str(slots),
                      log_path=str(tmp / "s.log"))
    with srv, MitmProxy(srv.url, {**proxy_opts(tmp, slots), **opts}, log_path=str(tmp / "p.log")) as px:
        yield srv, px


def test_a_marker_less_prompt_is_learned_and_the_third_session_restores_it(dirs):
    """No known marker, a per-session environment block after the shared part: the first session teaches
    nothing, the second teaches the shared part (a cold build, saved), the third restores it."""
    tmp, slots = dirs
    log = tmp / "req.jsonl"

    with four_slots(tmp, slots) as (_, px):
        a = ask(px.url, generic("Task A.", "/srv/a"))
        b = ask(px.url, generic("Task B.", "/srv/b"))
        c = ask(px.url, generic("Task C.", "/home/c"))
    learned, restored = checkpoints(log)
    assert learned["outcome"] == "warmed-saved" and restored["outcome"] == "restored"
    shared_tokens = learned["prompt_n"]
    assert a.cache_n < 0.1 * shared_tokens  # nothing to learn from yet
    assert b.cache_n >= 0.9 * shared_tokens and c.cache_n >= 0.9 * shared_tokens, (b, c, shared_tokens)
    assert len({a.slot, b.slot, c.slot}) == 3
    assert "no stable-prefix marker" in (tmp / "p.log").read_text()


def test_two_marker_less_sessions_that_start_together_prefill_the_shared_part_once(dirs):
    """The second session arrives while the first is still running its first request: it waits for that slot
    (`slots_seed_wait`) and starts from a copy of it, instead of a warm-up that prefills the shared part again
    next to the first session's own prefill."""
    tmp, slots = dirs
    log = tmp / "req.jsonl"

    # a wait cap no loaded CI machine reaches (no prefill speed is measured before the first answer)
    with four_slots(tmp, slots, slots_seed_wait=300) as (srv, px):
        body = {"messages": generic("Task A: write a long answer.", "/srv/a"), "max_tokens": 64, "temperature": 0}
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(httpx.post, px.url + "/v1/chat/completions", json=body, timeout=120)
            deadline = time.monotonic() + 30
            while not any(s.get("is_processing") and (s.get("params") or {}).get("n_predict") == body["max_tokens"]
                          for s in httpx.get(srv.url + "/slots").json()):  # A itself, not a start-up probe
                assert time.monotonic() < deadline and not first.done(), ("the first request never ran", first)
                time.sleep(0.02)
            b = ask(px.url, generic("Task B.", "/srv/b"))
            a = first.result().json()["timings"]
    records = jsonl(log)
    waits = [r for r in records if r.get("kind") == "source-wait"]
    assert [w["idle"] for w in waits] == [True], records
    assert b.cache_n >= 0.8 * a["prompt_n"], (a, b)                    # the shared part, copied from A's slot
    assert all(c["prompt_n"] < 0.5 * a["prompt_n"] for c in checkpoints(log)), records  # no second prefill of it
    assert "waited" in (tmp / "p.log").read_text()
