"""Faults the probe found, each against a stub llama-server the real client talks to: no prompt text in any log
line, nothing left saying "pinned" for a request that went out unpinned, no 3 s wait per new session while
/slots hangs, an --api-key server."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from mitmproxy import http
from mitmproxy.test import taddons, tflow

from bench.stub_llama import StubLlama
from slotkeeper import addon as addon_module
from slotkeeper.mitm import flows
from slotlogic import events as ev
from slotlogic import rewrite
from slotlogic.keeper import Keeper
from slotlogic.reasons import Unpinned
from tests.conftest import Proxy, chat

SECRET = "TOP SECRET"


@contextlib.asynccontextmanager
async def stub_proxy(tmp_path, stub: StubLlama, **options: Any) -> AsyncIterator[Proxy]:
    await stub.start()
    addons = addon_module.make_addons()
    try:
        with taddons.context(*addons) as tctx:
            p = Proxy(tctx, addons)
            p.configure(slots_state_dir=str(tmp_path / "state"), slots_probe_interval=0,
                        slots_log_requests="mitmproxy", **options)
            yield p
            for up in p.rt.upstreams.values():
                up.close_sync()
                await up.aclose()
    finally:
        await stub.close()


def to(stub: StubLlama, body: Any = None, raw: bytes | None = None, headers: dict[str, str] | None = None,
       path: str = "/v1/chat/completions") -> http.HTTPFlow:
    content = raw if raw is not None else json.dumps(body).encode()
    req = http.Request.make("POST", stub.url + path, content, {"content-type": "application/json",
                                                              **(headers or {})})
    return tflow.tflow(req=req)


def events_of(p: Proxy) -> list[ev.Event]:
    seen: list[ev.Event] = []
    p.rt.listeners.append(seen.append)
    return seen


# ------------------------------------------------------------------------------------------- item 1: privacy


async def test_a_lone_surrogate_with_a_client_id_slot_logs_no_prompt_text(tmp_path, caplog):
    raw = (b'{"messages": [{"role": "system", "content": "You are a coding agent."}, '
           b'{"role": "user", "content": "' + SECRET.encode() + b' \\ud800"}], "id_slot": 1}')
    stub = StubLlama()
    async with stub_proxy(tmp_path, stub) as p:
        with caplog.at_level(logging.DEBUG):
            for turn in range(2):  # the surrogate stays in the conversation: every turn must pass
                f = await p.request(to(stub, raw=raw[:-1] + b', "n": %d}' % turn))
                assert json.loads(f.request.content)["id_slot"] in range(stub.slots)  # the proxy's, set in place
                assert b"\\ud800" in f.request.content  # the client's bytes, not re-serialised
                await p.answer(f, http.Response.make(200, b'{"timings":{"cache_n":0,"prompt_n":9}}', {}))
        # and when the rewrite itself fails, the fail-open line names a type, never the body
        def boom(*_: Any) -> None:
            raise ValueError(raw.decode())
        orig = rewrite.set_fields
        rewrite.set_fields = boom  # type: ignore[assignment]
        try:
            with caplog.at_level(logging.DEBUG):
                f = await p.request(to(stub, raw=raw[:-1] + b', "n": 9}'))
        finally:
            rewrite.set_fields = orig
        assert f.request.content == raw[:-1] + b', "n": 9}'
    assert "forwarded unchanged: ValueError" in caplog.text
    assert SECRET not in caplog.text and "ud800" not in caplog.text


async def test_a_checkpoint_warm_up_of_a_system_prompt_with_a_lone_surrogate_logs_no_prompt_text(tmp_path, caplog):
    stub = StubLlama()
    async with stub_proxy(tmp_path, stub) as p:
        p.configure(mode=[f"reverse:{stub.url}@127.0.0.1:1"], slots_prefix_cache="memory")
        raw = json.dumps(chat("task", system=f"{SECRET} marker \udc00 more\nCurrent date: today")).encode()
        with caplog.at_level(logging.DEBUG):
            f = await p.request(to(stub, raw=raw))
            await p.answer(f, http.Response.make(200, b'{"timings":{"cache_n":0,"prompt_n":9}}', {}))
    warm = [s for s in stub.seen if s.path == "/v1/chat/completions" and json.loads(s.body).get("max_tokens") == 1]
    assert warm and b"\\udc00" in warm[0].body  # the warm-up went out, the surrogate escaped
    assert "prefix-cache" in caplog.text and SECRET not in caplog.text and "udc00" not in caplog.text


# ------------------------------------------------------------------------------------------- item 10


async def test_a_failure_after_the_claim_leaves_nothing_saying_pinned(tmp_path, monkeypatch, caplog):
    stub = StubLlama()
    async with stub_proxy(tmp_path, stub) as p:
        def broken_pin(self: Keeper, *a: Any, **k: Any) -> Any:
            raise RuntimeError("after the claim")
        real_pin = Keeper.pin
        monkeypatch.setattr(Keeper, "pin", broken_pin)
        body = chat("A")
        with caplog.at_level(logging.WARNING):
            f = await p.request(to(stub, body))
        assert "id_slot" not in json.loads(f.request.content) and "RuntimeError" in caplog.text
        keeper = p.rt.upstreams[stub.url].keeper
        assert keeper.table.sessions == {} and keeper.table.running == {} and keeper.table.dispatched == {}
        monkeypatch.setattr(Keeper, "pin", real_pin)
        g = await p.request(to(stub, body))  # placed again, and pinned this time
        assert json.loads(g.request.content)["id_slot"] in range(4)
        assert p.rt.open[g.id].ticket.why is not None


async def test_a_failure_on_the_hot_path_rolls_back_too(tmp_path, monkeypatch):
    stub = StubLlama()
    async with stub_proxy(tmp_path, stub) as p:
        first = chat("A")
        f = await p.request(to(stub, first))
        await p.answer(f, http.Response.make(200, b'{"timings":{"cache_n":0,"prompt_n":9}}', {}))
        monkeypatch.setattr(flows, "set_content", lambda *a: 1 / 0)
        later = first | {"messages": [*first["messages"], {"role": "assistant", "content": "ok"}]}
        g = await p.request(to(stub, later))
        assert g.request.content == json.dumps(later).encode() and g.id not in p.rt.open
        assert p.rt.upstreams[stub.url].keeper.table.sessions == {}


def test_abandon_marks_the_ticket_unpinned():
    from slotlogic.decisions import Ticket
    from slotlogic.endpoints import Route
    from slotlogic.reasons import Why
    from slotlogic.session import SessionId
    from slotlogic.settings import Settings

    k = Keeper(Settings(), "u")
    k.table.assign("s", 2, 1.0, prefix=None)
    k.table.dispatch("s", 2)
    t = Ticket(SessionId("s", "content:root"), Route.PINNABLE, slot=2, why=Why.FREE_EMPTY)
    t = k.abandon(t)
    assert (t.slot, t.why, t.unpinned) == (None, None, Unpinned.FAILED) and t.reason == "unpinned: internal error"
    assert "s" not in k.table.sessions and 2 not in k.table.dispatched and 2 not in k.table.holders


async def test_while_slots_hangs_new_sessions_do_not_each_wait_for_it(tmp_path):
    stub = StubLlama(slots_delay=10.0)  # longer than the proxy's 3 s timeout
    async with stub_proxy(tmp_path, stub) as p:
        seen = events_of(p)
        t0 = time.monotonic()
        a = await p.request(to(stub, chat("A")))
        first = time.monotonic() - t0
        t0 = time.monotonic()
        b = await p.request(to(stub, chat("B")))
        second = time.monotonic() - t0
        slots_calls = sum(1 for s in stub.seen if s.path == "/slots")
    assert first >= 2.5 and second < 1.0, (first, second)
    assert slots_calls == 1 and [e for e in seen if isinstance(e, ev.SlotsSlow)] == [
        ev.SlotsSlow(stub.url, "/slots", 30.0)]
    slot_a, slot_b = (json.loads(f.request.content)["id_slot"] for f in (a, b))
    assert slot_a != slot_b  # decided from the state file: A's claim is there


async def test_a_props_that_times_out_places_new_sessions_with_its_last_answer(tmp_path):
    """On a loaded machine `/props` answered past the 3 s time-out (bench mix-4 on 2 cores), and the hash
    fallback then pinned a new session outside its slot's plan, over another placement's prefix warm-up. The
    last answer stands now: the session is placed as any other (a free slot, not A's), without the fallback."""
    stub = StubLlama()
    async with stub_proxy(tmp_path, stub) as p:
        seen = events_of(p)
        a = await p.request(to(stub, chat("A")))
        stub.props_delay = 10.0  # longer than the proxy's 3 s time-out
        t0 = time.monotonic()
        b = await p.request(to(stub, chat("B")))
        took = time.monotonic() - t0
    slot_a, slot_b = (json.loads(f.request.content)["id_slot"] for f in (a, b))
    assert slot_b in range(4) and slot_b != slot_a and 2.5 <= took < 6.0, (slot_a, slot_b, took)
    assert not [e for e in seen if isinstance(e, ev.Unreachable)]
    assert ev.SlotsSlow(stub.url, "/props", 30.0) in seen


# ------------------------------------------------------------------------------------------- --api-key


@pytest.mark.parametrize("header", ["authorization", "x-api-key"])
async def test_a_clients_key_is_never_used_for_the_proxys_own_calls(tmp_path, caplog, header):
    """With `--api-key` on the server and no `slots_api_key`, the latest client's key went with every call the
    proxy made for any client (a wrong one failed them all): now a client's key goes with its own request only,
    and one line says to set `slots_api_key`."""
    key = "sk-test-KEY-123"
    stub = StubLlama(api_key=key)
    keys = {"A": key, "B": "sk-wrong-KEY-999", "C": key}
    async with stub_proxy(tmp_path, stub) as p:
        seen = events_of(p)
        with caplog.at_level(logging.DEBUG):
            for who, k in keys.items():
                value = f"Bearer {k}" if header == "authorization" else k
                f = await p.request(to(stub, chat(who), headers={header: value}))
                assert f.request.headers[header] == value  # the client's own request keeps its own key
                await p.answer(f, http.Response.make(200, b'{"timings":{"cache_n":0,"prompt_n":9}}', {}))
    own = [s for s in stub.seen if s.path in ("/props", "/slots")]
    assert own and not any(h in s.headers for s in own for h in ("authorization", "x-api-key"))
    assert [type(e) for e in seen if isinstance(e, ev.ApiKeyNotBorrowed)] == [ev.ApiKeyNotBorrowed]
    files = b"".join(q.read_bytes() for q in tmp_path.rglob("*") if q.is_file())
    assert key not in caplog.text and key.encode() not in files and "slots_api_key" in caplog.text


async def test_the_option_key_wins_and_is_never_shown(tmp_path, caplog):
    key = "sk-option-KEY-456"
    stub = StubLlama(api_key=key)
    async with stub_proxy(tmp_path, stub, slots_api_key=key) as p:
        p.configure(mode=[f"reverse:{stub.url}@127.0.0.1:1"])
        with caplog.at_level(logging.DEBUG):
            f = await p.request(to(stub, chat("A"), headers={"authorization": "Bearer client-key"}))
        status = p.command("slots.status")
        assert key not in repr(p.rt.settings) and key not in status
    assert json.loads(f.request.content)["id_slot"] in range(4)
    assert all(s.headers.get("authorization") == f"Bearer {key}" for s in stub.seen if s.path == "/props")
    assert key not in caplog.text


# ------------------------------------------------------------------------------------------- bad input, fast

BASE = json.dumps(chat("crafted")).encode()
CRAFTED = {
    "deep nesting": b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "invalid UTF-8": BASE[:-3] + b"\xff\xfe" + BASE[-3:],
    "5000-digit int": BASE[:-1] + b', "seed": ' + b"9" * 5000 + b"}",
    "NaN and 1e400": BASE[:-1] + b', "temperature": NaN, "top_p": 1e400}',
    "escaped and repeated keys": BASE[:-1] + b', "id\\u005fslot": 2, "id_slot": "x", "cache\\u005fprompt": false}',
    "truncated": BASE[:-9],
    "deep nesting inside a message": BASE[:-3] + b'", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}]}",
}


@pytest.mark.parametrize("name", list(CRAFTED))
async def test_crafted_bodies_pass_or_are_pinned_and_nothing_fails(proxy, caplog, name):
    raw = CRAFTED[name]
    from tests.conftest import flow
    with caplog.at_level(logging.DEBUG):
        for _ in range(2):  # the second time the session may be known: the fast path sees it too
            f = await proxy.request(flow(None, raw=raw))
            out = f.request.content
            if out != raw:
                sent_doc, got = json.loads(raw), json.loads(out)
                strip = {k: v for k, v in got.items() if k not in ("id_slot", "cache_prompt")}
                assert json.dumps(strip, sort_keys=True) == json.dumps(
                    {k: v for k, v in sent_doc.items() if k not in ("id_slot", "cache_prompt")}, sort_keys=True)
    assert "internal error" not in caplog.text and "Traceback" not in caplog.text
