"""Settings are built once; what a server gets depends on whether this proxy fronts it."""

import dataclasses

import pytest

from slotlogic.settings import CheckpointMode, Settings


def test_only_a_fronted_server_gets_slot_files():
    s = Settings(checkpoints=CheckpointMode.DISK, save_dir="/srv/slots", paging=True)
    assert s.for_upstream(True) is s
    other = s.for_upstream(False)
    assert (other.checkpoints, other.save_dir, other.paging) == (CheckpointMode.OFF, None, False)


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().ttl = 5  # type: ignore[misc]
    assert Settings(session_headers=("x-a",)).header_bytes == frozenset({b"x-a"})
