"""The state directory: ours 0700, a shared one refused, nothing chmod-ed that we did not create, no symlink
followed; stale temp files of interrupted writes removed."""

from __future__ import annotations

import os
import stat
import time

import pytest
from mitmproxy import exceptions
from mitmproxy.test import taddons

from slotkeeper import addon as addon_module
from slotkeeper.drivers import private_dir
from slotkeeper.drivers.store_file import StateFile
from slotlogic import shared


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


async def claim(directory) -> StateFile:
    store = StateFile(directory, "http://u:1")
    async with store.transaction() as s:
        shared.claim(s, "a", 0, 1.0)
    return store


@pytest.mark.parametrize("umask", [0o022, 0o000, 0o077])
async def test_a_directory_we_create_is_0700_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        store = await claim(tmp_path / "new" / "state")
    finally:
        os.umask(old)
    assert mode(store.dir) == 0o700 and mode(store.dir.parent) == 0o700
    assert mode(store.path) == 0o600


async def test_an_existing_directory_is_never_chmod_ed(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    os.chmod(mine, 0o755)
    await claim(mine)
    assert mode(mine) == 0o755  # the old code made it 0700 on every lock


async def test_a_symlink_is_not_followed_to_chmod_its_target(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    os.chmod(target, 0o751)
    link = tmp_path / "link"
    link.symlink_to(target)
    await claim(link)
    assert mode(target) == 0o751 and (target / StateFile(link, "http://u:1").path.name).exists()


@pytest.mark.parametrize("bits", [0o777 | stat.S_ISVTX, 0o770, 0o702])
def test_a_directory_others_can_write_to_is_refused_with_a_clear_error(tmp_path, bits):
    shared_dir = tmp_path / "tmp-like"
    shared_dir.mkdir()
    os.chmod(shared_dir, bits)
    addons = addon_module.make_addons()
    with taddons.context(*addons) as tctx, pytest.raises(exceptions.OptionsError, match="writable by others"):
        tctx.configure(addons[1], slots_state_dir=str(shared_dir))
    assert stat.S_IMODE(os.stat(shared_dir).st_mode) == bits & 0o7777  # untouched


def test_a_file_or_a_missing_directory(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(private_dir.UnsafeDir, match="not a directory"):
        private_dir.check(tmp_path / "f")
    private_dir.check(tmp_path / "missing")  # created on first use


async def test_stale_temp_files_of_an_interrupted_write_are_removed_at_start(tmp_path):
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    name = StateFile(d, "http://u:1").path.name
    stale, fresh = d / f"{name}.abc123.tmp", d / f"{name}.def456.tmp"
    other = d / "notes.tmp"
    for p in (stale, fresh, other, d / "checkpoints.json.x1.tmp"):
        p.write_text("{")
    old = time.time() - 3600
    for p in (stale, other, d / "checkpoints.json.x1.tmp"):
        os.utime(p, (old, old))
    await claim(d)
    assert not stale.exists() and not (d / "checkpoints.json.x1.tmp").exists()
    assert fresh.exists() and other.exists()  # a write in flight, and a file that is not ours
