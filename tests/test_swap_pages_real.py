"""Conversations that survive a model swap: a llama-swap in front of one model at a time (its default, no groups),
two conversations on the main model and a helper model's request after each round (a title or summary call) that
swaps the main model out. Real llama-servers (one per model, started and stopped by the stand-in as llama-swap
does, tests/swap_stub.py) and a real mitmdump with the addon."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from bench.real.mitmdump import MitmProxy
from tests.real_helpers import THREADS, conversation, extend, jsonl
from tests.router_server import RouterServer, router_binary
from tests.swap_stub import SwapStub

pytestmark = pytest.mark.real
HELPER_SYSTEM = "You write a five-word title for the conversation you are shown."


def turn(base: str, msgs: list[dict[str, str]], model: str) -> dict:
    r = httpx.post(base + "/v1/chat/completions", json={"model": model, "messages": msgs, "max_tokens": 4,
                                                        "temperature": 0}, timeout=120)
    r.raise_for_status()
    return r.json()["timings"]


def helper_call(base: str, n: int) -> None:
    turn(base, [{"role": "system", "content": HELPER_SYSTEM}, {"role": "user", "content": f"Title {n}: setup."}],
         "helper")


def specs(tmp_path, save) -> dict[str, dict]:
    common = {"threads": THREADS, "ctx_per_slot": 2048, "slot_save_path": str(save)}
    return {"main": {**common, "slots": 2, "log_path": str(tmp_path / "main.log")},
            "helper": {**common, "slots": 1, "log_path": str(tmp_path / "helper.log")}}


def two_model_workflow(tmp_path, opts: dict, *, rounds: int = 2, router: bool = False, names: str = "AB"
                       ) -> tuple[list[float], Any, str]:
    """Each round: both conversations take a turn on `main`, then one helper request. Returns each conversation's
    reuse after each swap back (the share of what its previous prompt left in its slot that its next turn found),
    the swapper (the llama-swap stand-in, or the real router), and the proxy's log."""
    save = tmp_path / "slots"
    save.mkdir(exist_ok=True)
    convs = {c: conversation(f"Task {c}: a long refactor, keep the whole conversation.") for c in names}
    reuse: list[float] = []
    swapper = RouterServer(tmp_path, ["main", "helper"], save) if router else \
        SwapStub(specs(tmp_path, save), exclusive=True)
    with swapper as swap:
        with MitmProxy(swap.url, {"slots_upstreams": [swap.url], **opts}, log_path=str(tmp_path / "p.log")) as px:
            swap.load("main")
            left = {}
            for c in names:  # two turns each: known sessions with a conversation worth a page
                turn(px.url, convs[c], "main")
                extend(convs[c], 1)
                t = turn(px.url, convs[c], "main")
                left[c] = t["cache_n"] + t["prompt_n"]
            for r in range(rounds):
                helper_call(px.url, r)
                for c in names:
                    extend(convs[c], r + 2)
                    t = turn(px.url, convs[c], "main")
                    reuse.append(t["cache_n"] / left[c])
                    left[c] = t["cache_n"] + t["prompt_n"]
            time.sleep(0.5)
        text = (tmp_path / "p.log").read_text()
    return reuse, swap, text


def test_each_conversation_is_paged_out_before_its_model_is_swapped_out_and_back_in_after(tmp_path):
    log = tmp_path / "p.jsonl"
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_log_file": str(log),
            "slots_save_dir": str(tmp_path / "slots"), "slots_prefix_cache": "off"}
    reuse, swap, text = two_model_workflow(tmp_path, opts)
    records = jsonl(log)
    swaps = [r for r in records if r["kind"] == "swap-out"]
    assert all(x >= 0.9 for x in reuse), reuse  # stock: the shared system prompt only (about a quarter)
    # the loads the traffic itself makes (main, then helper and main again each round): none added by the proxy
    assert swap.load_log == ["main", "helper", "main", "helper", "main"], swap.load_log
    main_out = [r for r in swaps if r["upstream"].endswith("/upstream/main")]
    # each conversation saved, unless its page was current already (B's first turn started from a copy of A's
    # slot, saved as A's page: the first swap finds it whole and does not write it again; on a loaded machine a
    # session placed on the other's slot after a swap back pages that one out there, before the next swap)
    assert len(main_out) == 2 and all(r["saved"] >= 1 and r["lost"] == 0 for r in main_out), swaps
    # pages go back only where they came from: every page-in is on the main model's server, of a main session
    ins = [r for r in records if r["kind"] == "page" and r["in"] and not r["seed"]]
    assert len(ins) >= 4 and all(r["upstream"].endswith("/upstream/main") for r in ins), ins
    assert "paged out first" in text


@pytest.mark.slow
def test_a_swap_with_no_room_to_save_still_serves_and_labels_the_loss(tmp_path):
    """The save dir cannot take a page (a budget of 1 MB, where one page takes ~9): the helper request is served,
    the main model's conversation is labelled lost, and its next turn prefills (nothing restored from elsewhere)."""
    log = tmp_path / "p.jsonl"
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_log_file": str(log),
            "slots_save_dir": str(tmp_path / "slots"), "slots_prefix_cache": "off", "slots_page_max_mb": 1}
    reuse, swap, text = two_model_workflow(tmp_path, opts, rounds=1, names="A")
    swaps = [r for r in jsonl(log) if r["kind"] == "swap-out" and r["upstream"].endswith("/upstream/main")]
    assert len(swaps) == 1 and swaps[0]["saved"] == 0 and swaps[0]["lost"] == 1, swaps
    assert "page budget" in swaps[0]["why_lost"], swaps
    assert "not paged out" in text
    assert all(x < 0.9 for x in reuse), reuse
    assert swap.load_log == ["main", "helper", "main"], swap.load_log


@pytest.mark.slow
@pytest.mark.skipif(router_binary() is None, reason="router mode needs the llama-server binary (LLAMA_SERVER_BIN "
                    "or `make llama-server`): xllamacpp refuses models_dir ('disabled the router server feature')")
def test_router_mode_pages_each_conversation_out_before_an_eviction_and_back_in_after(tmp_path):
    """llama-server's own router, `--models-max 1`: the helper request evicts the main model; its conversations
    are paged out first through the router (`?model=`, `model` in the body) and paged back in after."""
    log = tmp_path / "p.jsonl"
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_log_file": str(log),
            "slots_save_dir": str(tmp_path / "slots"), "slots_prefix_cache": "off"}
    reuse, router, _ = two_model_workflow(tmp_path, opts, router=True)
    swaps = [r for r in jsonl(log) if r["kind"] == "swap-out" and r["upstream"].endswith("?model=main")]
    assert all(x >= 0.9 for x in reuse), reuse
    assert router.load_log == ["main", "helper", "main", "helper", "main"], router.load_log
    assert len(swaps) == 2 and all(r["saved"] >= 1 and r["lost"] == 0 for r in swaps), swaps

