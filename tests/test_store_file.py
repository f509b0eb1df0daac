"""The state file driver: private, atomic, tolerant of damage, serialised across processes."""

import asyncio
import json
import multiprocessing
import os
import stat
import tracemalloc

from slotkeeper.drivers import store_file
from slotkeeper.drivers.store_file import StateFile
from slotlogic import placement
from slotlogic import shared as st
from slotlogic.settings import Settings


async def test_transaction_writes_private_file(tmp_path):
    store = StateFile(tmp_path / "sk", "http://127.0.0.1:8080")
    async with store.transaction() as s:
        st.claim(s, "a", 1, 5.0)
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(store.dir).st_mode) == 0o700
    assert json.loads(store.path.read_text())["sessions"]["a"]["slot"] == 1
    assert [p.name for p in store.dir.iterdir() if p.suffix == ".tmp"] == []


async def test_failed_transaction_keeps_the_old_file(tmp_path):
    store = StateFile(tmp_path, "u")
    async with store.transaction() as s:
        st.claim(s, "a", 0, 1.0)
    try:
        async with store.transaction() as s:
            st.claim(s, "b", 1, 2.0)
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert set(store.read().sessions) == {"a"}


async def test_corrupt_file_is_moved_aside_not_lost(tmp_path):
    store = StateFile(tmp_path, "u")
    store.dir.mkdir(exist_ok=True)
    store.path.write_text("{not json")
    async with store.transaction() as s:
        assert s.sessions == {}
        st.claim(s, "a", 0, 1.0)
    kept = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert len(kept) == 1 and kept[0].read_text() == "{not json"
    assert "a" in store.read().sessions


async def test_concurrent_coroutines_serialise(tmp_path):
    stores = [StateFile(tmp_path, "u") for _ in range(2)]  # two objects, as two addon instances would be

    async def claim_one(store, key):
        async with store.transaction() as s:
            choice = placement.assign(Settings(), s, placement.Seeker(key, None), placement.SlotsSeen([], 8), 100.0)
            await asyncio.sleep(0.01)  # widen the race window
            return choice.slot

    slots = await asyncio.gather(*(claim_one(stores[i % 2], f"s{i}") for i in range(8)))
    assert sorted(slots) == list(range(8))


def _claim_in_process(directory: str, keys: list[str], out: "multiprocessing.Queue[int]") -> None:
    async def run() -> None:
        store = StateFile(directory, "http://shared")
        for key in keys:
            async with store.transaction() as s:
                choice = placement.assign(Settings(), s, placement.Seeker(key, None), placement.SlotsSeen([], 6), 100.0)
                out.put(choice.slot)
    asyncio.run(run())


def test_two_processes_never_share_a_slot_while_one_is_free(tmp_path):
    q: multiprocessing.Queue[int] = multiprocessing.Queue()
    procs = [multiprocessing.Process(target=_claim_in_process, args=(str(tmp_path), [f"p{n}-{i}" for i in range(3)], q))
             for n in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    slots = sorted(q.get(timeout=5) for _ in range(6))
    assert slots == [0, 1, 2, 3, 4, 5]


DEEP = b"[" * 200_000 + b"]" * 200_000


async def test_a_state_file_nested_too_deep_to_parse_is_corrupt_moved_aside_and_replaced(tmp_path):
    store = StateFile(tmp_path, "u")
    store.dir.mkdir(exist_ok=True)
    store.path.write_bytes(b'{"sessions":' + DEEP + b"}")
    assert store.read().sessions == {}  # status views: an empty state, no RecursionError
    store.path.write_bytes(b'{"sessions":' + DEEP + b"}")
    async with store.transaction() as s:
        st.claim(s, "a", 0, 1.0)
    kept = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert kept and all(p.read_bytes().endswith(b"]}") for p in kept)
    assert "a" in store.read().sessions


async def test_a_1_gb_sparse_state_file_is_moved_aside_without_being_read(tmp_path):
    store = StateFile(tmp_path, "u")
    store.dir.mkdir(exist_ok=True)
    with open(store.path, "wb") as f:
        f.truncate(1 << 30)
    tracemalloc.start()
    try:
        async with store.transaction() as s:
            st.claim(s, "a", 0, 1.0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20
    kept = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert len(kept) == 1 and kept[0].stat().st_size == 1 << 30
    assert "a" in store.read().sessions


def test_the_size_cap_is_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(store_file, "MAX_BYTES", 100)
    store = StateFile(tmp_path, "u")
    store.dir.mkdir(exist_ok=True)
    doc = json.dumps({"x": "y" * 100})[:100 - 2] + '"}'
    store.path.write_text(doc)
    assert len(store.path.read_bytes()) == 100 and store.file.load() == json.loads(doc)
    store.path.write_text(doc[:-2] + 'y"}')
    assert store.read().sessions == {} and not store.path.exists()


async def test_the_shutdown_flush_does_not_wait_out_a_transaction_of_its_own_suspended_on_the_loop(tmp_path):
    """`done` (sync, on the event loop) waited the lock's whole timeout for a flush of this same process that
    could not run to let go (as on Redis in CI), then lost the last touches."""
    store = StateFile(tmp_path, "http://127.0.0.1:8080")
    inside, resume = asyncio.Event(), asyncio.Event()

    async def background_flush() -> None:
        async with store.transaction() as s:
            st.claim(s, "b" * 16, 1, 1.0)
            inside.set()
            await resume.wait()

    task = asyncio.create_task(background_flush())
    await inside.wait()
    t0 = asyncio.get_running_loop().time()
    with store.transaction_sync() as s:  # blocks the loop, as `done` does
        st.claim(s, "d" * 16, 0, 2.0)
    assert asyncio.get_running_loop().time() - t0 < 2
    resume.set()
    await task
    assert store.read().slots[0].owner == "d" * 16  # the suspended flush did not write its older state over it
    async with store.transaction() as s:  # the lock was let go
        assert s.slots[0].owner == "d" * 16


async def test_a_fifo_or_a_symlink_as_the_state_file_is_moved_aside_never_read_through(tmp_path):
    """Opening a FIFO for reading blocks until a writer comes (the transaction's worker thread hung for good), and a
    link planted under the state file's name must not be read through: both are damaged files, moved aside."""
    store = StateFile(tmp_path, "u")
    store.dir.mkdir(exist_ok=True)
    os.mkfifo(store.path)
    async with asyncio.timeout(5):
        async with store.transaction() as s:
            st.claim(s, "a", 0, 1.0)
    assert "a" in store.read().sessions and stat.S_ISREG(os.lstat(store.path).st_mode)
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"sessions": {}}))
    store.path.unlink()
    store.path.symlink_to(target)
    async with store.transaction() as s:
        assert "a" not in s.sessions  # the target was not read as our state
    assert json.loads(target.read_text()) == {"sessions": {}} and not store.path.is_symlink()
