"""kill -9 of a process in the middle of its state writes: the file is always valid, and its temp files go at
the next start (the long version: `make reliability`, 200+ kills of mitmdump under load)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from slotkeeper.drivers import private_dir
from slotkeeper.drivers.store_file import StateFile

WRITER = """
import asyncio, sys, time
from slotkeeper.drivers.store_file import StateFile
from slotlogic import shared

async def main():
    store = StateFile(sys.argv[1], "http://u:1")
    i = 0
    print("ready", flush=True)
    while True:
        async with store.transaction() as s:
            for k in range(50):
                shared.claim(s, f"s{i}-{k}", k % 4, time.time())
        i += 1

asyncio.run(main())
"""


def test_a_state_file_survives_kill_9_at_any_moment(tmp_path):
    root = Path(__file__).resolve().parent.parent
    state = tmp_path / "state"
    path = StateFile(state, "http://u:1").path
    for _ in range(12):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(state)], cwd=root, stdout=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": str(root)})
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        time.sleep(random.uniform(0.01, 0.15))
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        if path.exists():
            assert isinstance(json.loads(path.read_bytes()), dict)  # never half written
    assert path.exists() and json.loads(path.read_bytes())["sessions"]
    old = time.time() - 3600
    leftovers = [p for p in state.iterdir() if p.name.endswith(".tmp")]
    for p in leftovers:
        os.utime(p, (old, old))
    private_dir._swept.discard(os.path.abspath(state))  # a new process
    StateFile(state, "http://u:1").file.ensure_dir()
    assert not [p for p in state.iterdir() if p.name.endswith(".tmp")]
