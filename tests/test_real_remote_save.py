"""Paging with the save dir out of the proxy's reach, end to end: a real llama-server with --slot-save-path, a real
mitmdump with `slots_save_remote` and no `slots_save_dir` (as on another host)."""

from __future__ import annotations

import time

import pytest

from bench.real.llama_server import LlamaServer
from bench.real.mitmdump import MitmProxy
from slotlogic import paging
from slotlogic import prefix as pfx
from tests.real_helpers import THREADS, ask, conversation, extend, jsonl

pytestmark = pytest.mark.real


def test_an_evicted_session_is_paged_back_in_through_a_save_dir_the_proxy_cannot_read(tmp_path):
    """Two slots, three sessions: C evicts B, whose conversation is saved through the server under a name of the
    bounded ring; B returns and is paged back in, prefilling only its new turn. The proxy never touched the
    directory: every file in it is one the server wrote under a bounded name (pages, and the shared prompt's
    prefix checkpoint)."""
    save = tmp_path / "server-only"
    save.mkdir()
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_log_file": str(tmp_path / "req.jsonl"),
            "slots_save_remote": True}  # prefix checkpoints on disk too (the default with a save dir)
    convs = {c: conversation(f"Task {c}: remote paging test, keep the whole conversation.") for c in "ABC"}
    with LlamaServer(threads=THREADS, slots=2, ctx_per_slot=2048, slot_save_path=str(save),
                     log_path=str(tmp_path / "s.log")) as srv, \
            MitmProxy(srv.url, opts, log_path=str(tmp_path / "p.log")) as px:
        first = {c: ask(px.url, convs[c]) for c in "AB"}
        time.sleep(3.0)  # A calls again after a pause of its own: its turn gap is 3 s (`slotlogic.returns`)
        extend(convs["A"], 1)
        ask(px.url, convs["A"])
        time.sleep(3.5)  # A is due back about now, B has been idle 6.5 s: B is the owner least surely back
        first["C"] = ask(px.url, convs["C"])
        extend(convs["B"], 2)
        back_b = ask(px.url, convs["B"])
    reqs = [(r["session"][:8], r["slot"], r["reason"]) for r in jsonl(tmp_path / "req.jsonl") if r["kind"] == "request"]
    assert first["C"].slot == first["B"].slot, reqs
    b_before = first["B"].cache_n + first["B"].prompt_n
    assert back_b.slot == first["B"].slot and "paged-in" in reqs[4][2], reqs
    assert back_b.cache_n >= b_before - 2, (back_b, b_before)  # its whole first turn came back from the file
    names = {paging.ring_file(srv.url, i) for i in range(4096)} | {pfx.bucket_file(srv.url, i) for i in range(4096)}
    files = {p.name for p in save.iterdir()}
    assert files and files <= names, files
    assert any(f.startswith("prefix-") for f in files) and any(f.startswith("page-") for f in files), files
