"""The slots.* commands: they act at once in memory, and the state file follows without blocking."""

from __future__ import annotations

import json

from mitmproxy import http

from tests.conftest import chat, flow, sent


async def test_pin_then_release(proxy, tmp_path):
    f = await proxy.request(flow(chat()))
    slot = sent(f)["id_slot"]
    await proxy.answer(f, http.Response.make(200, b"{}", {}))
    short = f.metadata["slotkeeper"]["session"][:8]
    target = (slot + 1) % 4
    assert proxy.command("slots.pin", short, str(target)).startswith(f"pinned: {short} → slot {target}")
    g = await proxy.request(flow(chat()))
    assert sent(g)["id_slot"] == target
    assert "out of range" in proxy.command("slots.pin", short, "9")
    assert proxy.command("slots.release", short).startswith(f"released: {short} (slot {target})")
    await proxy.settle()
    state = json.loads(next((tmp_path / "state").glob("state-*.json")).read_text())
    assert state["sessions"] == {} and state["slots"][str(target)]["owner"] is None
    assert "no session matches" in proxy.command("slots.release", "ffffffff")
    h = await proxy.request(flow(chat()))
    await proxy.answer(h, http.Response.make(200, b"{}", {}))
    assert h.metadata["slotkeeper"]["reason"] != "known"  # a released session starts over


async def test_status_and_cleanup(proxy):
    await proxy.request(flow(chat()))
    text = proxy.command("slots.status")
    assert '"total_slots": 4' in text
    assert proxy.command("slots.cleanup") == "deleted: nothing"
