"""The mitmproxy adapter, driven with mitmproxy's own test helpers (taddons/tflow) and a fake server client."""

from __future__ import annotations

import gzip
import json
import logging

import pytest
from mitmproxy import ctx, exceptions, http
from mitmproxy.test import taddons, tflow

import addon as addon_module
from drivers import state_store

UP = "http://127.0.0.1:8080"
SYS = "You are a coding agent. " * 20


def chat(first="task A", **extra):
    return {"model": "m", "messages": [{"role": "system", "content": SYS}, {"role": "user", "content": first}],
            **extra}


def flow(body, path="/v1/chat/completions", method="POST", headers=None, raw: bytes | None = None):
    content = raw if raw is not None else json.dumps(body).encode()
    req = http.Request.make(method, UP + path, content, {"content-type": "application/json", **(headers or {})})
    return tflow.tflow(req=req)


@pytest.fixture
def keeper(tmp_path, fake_llama):
    k = addon_module.SlotKeeper()
    with taddons.context(k) as tctx:
        tctx.configure(k, slots_state_dir=str(tmp_path / "state"), slots_probe_interval=0,
                       slots_log_requests="mitmproxy")  # caplog sees the per-request line
        k.runtime(UP).client = fake_llama
        yield k


def sent(f) -> dict:
    return json.loads(f.request.get_content())


async def test_new_session_is_pinned_and_known_session_costs_no_io(keeper, fake_llama, monkeypatch):
    f1 = flow(chat())
    await keeper.request(f1)
    assert sent(f1)["id_slot"] in range(4) and sent(f1)["cache_prompt"] is True
    assert fake_llama.calls == ["props", "slots"]

    transactions = []
    real = state_store.StateStore.transaction
    monkeypatch.setattr(state_store.StateStore, "transaction",
                        lambda self: transactions.append(1) or real(self))
    f2 = flow(chat())
    await keeper.request(f2)
    assert sent(f2)["id_slot"] == sent(f1)["id_slot"]
    assert fake_llama.calls == ["props", "slots"]  # no network for a known session
    assert transactions == []  # no lock, no disk: touches are flushed later


async def test_a_known_sessions_next_turn_skips_the_parse_and_gets_the_same_rewrite(keeper, monkeypatch):
    first = chat("task A")
    f1 = flow(first)
    await keeper.request(f1)
    parsed = []
    real = addon_module.read_json
    monkeypatch.setattr(addon_module, "read_json", lambda req: parsed.append(1) or real(req))
    later = chat("task A") | {"messages": [*first["messages"], {"role": "assistant", "content": "done"}]}
    f2 = flow(later)
    await keeper.request(f2)
    assert parsed == [] and keeper.flows[f2.id].reason == "known"
    rt = keeper.runtime(UP)  # the order requests leave the proxy in: what paging saves on a slot later
    assert rt.table.dispatched == {sent(f1)["id_slot"]: keeper.flows[f2.id].plan.session.key}
    assert f2.request.content == json.dumps(later).encode()[:-1] + b',"id_slot":%d,"cache_prompt":true}' % (
        sent(f1)["id_slot"])
    assert keeper.flows[f2.id].client_fields == {"id_slot": None, "cache_prompt": None}
    # a session header names the session: that request is parsed (and its key comes from the header)
    f3 = flow(later, headers={"x-session-id": "abc"})
    await keeper.request(f3)
    assert parsed == [1]
    # the client's own id_slot among the new messages: parsed, and respected
    f4 = flow(later | {"messages": [*later["messages"], {"role": "user", "content": "x"}], "id_slot": 2})
    await keeper.request(f4)
    assert parsed == [1, 1] and sent(f4)["id_slot"] == 2


async def test_a_displaced_session_is_parsed_and_placed_again(keeper, monkeypatch):
    a, b = chat("task A"), chat("task B")
    fa = flow(a)
    await keeper.request(fa)
    await keeper.request(flow(b))
    rt = keeper.runtime(UP)
    rt.table.holders[sent(fa)["id_slot"]] = "someone-else"
    parsed = []
    real = addon_module.read_json
    monkeypatch.setattr(addon_module, "read_json", lambda req: parsed.append(1) or real(req))
    again = flow(a)
    await keeper.request(again)
    assert parsed == [1] and keeper.flows[again.id].reason.startswith("displaced:")


async def test_two_sessions_two_slots(keeper):
    a, b = flow(chat("task A")), flow(chat("task B"))
    await keeper.request(a)
    await keeper.request(b)
    assert sent(a)["id_slot"] != sent(b)["id_slot"]


async def test_client_slot_respected_and_overridable(keeper):
    f = flow(chat(id_slot=2))
    await keeper.request(f)
    assert sent(f)["id_slot"] == 2 and keeper.flows[f.id].reason == "client-id_slot"
    ctx.options.update(slots_override_client=True)
    g = flow(chat("other", id_slot=2))
    await keeper.request(g)
    assert keeper.flows[g.id].reason.startswith("free") and sent(g)["id_slot"] == keeper.flows[g.id].slot


async def test_gzip_body_is_rewritten_and_stays_gzip(keeper):
    f = flow(chat(), headers={"content-encoding": "gzip"})  # make() gzips the body for us
    assert f.request.raw_content[:2] == b"\x1f\x8b"
    await keeper.request(f)
    assert f.request.headers["content-encoding"] == "gzip"
    assert json.loads(gzip.decompress(f.request.raw_content))["id_slot"] in range(4)


async def test_chunked_body_gets_a_content_length(keeper):
    f = flow(chat(), headers={"transfer-encoding": "chunked"})
    f.request.headers.pop("content-length", None)
    await keeper.request(f)
    assert "transfer-encoding" not in f.request.headers
    assert int(f.request.headers["content-length"]) == len(f.request.raw_content)
    assert "id_slot" in sent(f)


@pytest.mark.parametrize(("method", "path", "raw"), [
    ("GET", "/slots", b""),
    ("POST", "/v1/chat/completions", b"not json"),
    ("POST", "/v1/chat/completions", b"[1, 2]"),
    ("POST", "/v1/embeddings", json.dumps(chat()).encode()),
    ("POST", "/tokenize", b'{"content": "x"}'),
])
async def test_untouched(keeper, fake_llama, method, path, raw):
    f = flow(None, path=path, method=method, raw=raw)
    before = f.request.raw_content
    await keeper.request(f)
    assert f.request.raw_content == before and fake_llama.calls == []


async def test_messages_route_passes_through_and_says_why(keeper, caplog):
    f = flow({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5}, path="/v1/messages")
    before = f.request.raw_content
    await keeper.request(f)
    assert f.request.raw_content == before
    f.response = http.Response.make(200, b'{"usage":{"cache_read_input_tokens":3,"input_tokens":2}}',
                                    {"content-type": "application/json"})
    with caplog.at_level(logging.INFO):
        keeper.responseheaders(f)
        keeper.response(f)
    assert "not pinnable" in caplog.text and "cache_n=3" in caplog.text


async def test_policy_off_observes_only(keeper, fake_llama, caplog):
    ctx.options.update(slots_policy="off")
    f = flow(chat())
    before = f.request.raw_content
    await keeper.request(f)
    assert f.request.raw_content == before and fake_llama.calls == []
    f.response = http.Response.make(200, b'{"timings":{"cache_n":0,"prompt_n":50}}', {})
    with caplog.at_level(logging.INFO):
        keeper.response(f)
    assert "why=policy off" in caplog.text and "prompt_n=50" in caplog.text


async def test_internal_error_fails_open(keeper, fake_llama, caplog):
    fake_llama.fail = RuntimeError("boom")
    f = flow(chat())
    before_body, before_headers = f.request.raw_content, f.request.headers.copy()
    with caplog.at_level(logging.WARNING):
        await keeper.request(f)
    assert f.request.raw_content == before_body and f.request.headers == before_headers
    assert "forwarded unchanged" in caplog.text and caplog.text.count("boom") == 1


async def test_unreachable_server_hash_fallback_or_unpinned(keeper, fake_llama, caplog):
    fake_llama.props_data = None
    f = flow(chat())
    with caplog.at_level(logging.WARNING):
        await keeper.request(f)
    assert "id_slot" not in sent(f) and "passes unpinned" in caplog.text
    keeper.runtimes[UP].total_slots = 4  # known from an earlier answer
    g = flow(chat("other"))
    with caplog.at_level(logging.WARNING):
        await keeper.request(g)
    assert sent(g)["id_slot"] in range(4) and "hash fallback" in caplog.text


async def test_sse_stream_is_passed_byte_for_byte_and_observed(keeper, caplog):
    f = flow(chat(stream=True))
    await keeper.request(f)
    f.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
    f.response.content = None
    keeper.responseheaders(f)
    assert callable(f.response.stream)
    assert f.response.headers["x-slot-id"] == str(sent(f)["id_slot"])
    stream = (b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
              b'data: {"choices":[],"timings":{"cache_n":120,"prompt_n":8}}\n\ndata: [DONE]\n\n')
    out = b"".join(f.response.stream(stream[i:i + 7]) for i in range(0, len(stream), 7))
    out += f.response.stream(b"")
    assert out == stream
    with caplog.at_level(logging.INFO):
        keeper.response(f)
    assert "cache_n=120 prompt_n=8 reuse=94%" in caplog.text
    assert f.marked == ":zap:" and "slot=" in f.comment and f.metadata["slotkeeper"]["cache_n"] == 120


async def test_broken_observer_never_breaks_the_stream(keeper):
    f = flow(chat(stream=True))
    await keeper.request(f)
    f.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
    keeper.responseheaders(f)
    keeper.flows[f.id].stream.feed = None  # any exception inside the observer
    assert f.response.stream(b"data: 1\n\n") == b"data: 1\n\n"
    assert f.response.stream(b"more") == b"more"


async def test_context_overflow_warning(keeper, caplog):
    f = flow(chat())
    await keeper.request(f)
    err = {"error": {"code": 400, "type": "exceed_context_size_error", "message": "x",
                     "n_prompt_tokens": 9000, "n_ctx": 4096}}
    f.response = http.Response.make(400, json.dumps(err), {"content-type": "application/json"})
    with caplog.at_level(logging.WARNING):
        keeper.response(f)
    assert "9000 tokens exceeds the per-slot context n_ctx=4096" in caplog.text and f.marked == ":x:"


async def test_side_call_goes_to_reserved_slot(keeper):
    side = chat(first="summarise") | {"messages": [
        {"role": "system", "content": "You are a context summarization assistant."},
        {"role": "user", "content": "..."}]}
    f = flow(side)
    await keeper.request(f)
    assert sent(f)["id_slot"] == 3 and keeper.flows[f.id].reason == "side-call"
    again = flow(side)
    await keeper.request(again)  # recognised from its bytes: still a side call
    assert sent(again)["id_slot"] == 3 and keeper.flows[again.id].reason == "side-call"


async def test_local_status_endpoint(keeper):
    await keeper.request(flow(chat()))
    f = flow(None, path="/_slots/status", method="GET", raw=b"")
    await keeper.request(f)
    data = json.loads(f.response.content)
    assert data["policy"] == "auto" and data["servers"][0]["total_slots"] == 4
    g = flow(None, path="/_slots/nope", method="GET", raw=b"")
    await keeper.request(g)
    assert g.response.status_code == 404


@pytest.mark.parametrize(("opt", "value"), [("slots_policy", "bogus"), ("slots_ttl", 0),
                                            ("slots_side_patterns", ["("]), ("slots_side_slot", -5)])
def test_bad_options_are_refused(opt, value):
    k = addon_module.SlotKeeper()
    with taddons.context(k) as tctx, pytest.raises(exceptions.OptionsError):
        tctx.configure(k, **{opt: value})


def test_options_from_strings():
    k = addon_module.SlotKeeper()
    with taddons.context(k) as tctx:
        tctx.options.set("slots_policy=seed", "slots_ttl=30", "slots_session_headers=X-A",
                         "slots_session_headers=x-b")
        assert k.cfg.policy.value == "seed" and k.cfg.ttl == 30 and k.cfg.header_names == ("x-a", "x-b")


async def test_state_survives_and_is_flushed_on_done(keeper, tmp_path):
    f = flow(chat())
    await keeper.request(f)
    await keeper.request(flow(chat()))
    keeper.done()
    state = json.loads(next((tmp_path / "state").glob("state-*.json")).read_text())
    ((_key, rec),) = state["sessions"].items()
    assert rec["slot"] == sent(f)["id_slot"] and rec["requests"] >= 2


async def test_release_and_pin_commands(keeper, tmp_path):
    f = flow(chat())
    await keeper.request(f)
    short = keeper.flows[f.id].plan.session.short
    slot = sent(f)["id_slot"]
    target = (slot + 1) % 4
    assert keeper.pin_command(short, target).startswith(f"pinned: {short} → slot {target}")
    g = flow(chat())
    await keeper.request(g)
    assert sent(g)["id_slot"] == target and keeper.flows[g.id].reason == "known"
    assert "out of range" in keeper.pin_command(short, 9)
    assert keeper.release_command(short).startswith(f"released: {short} (slot {target})")
    state = json.loads(next((tmp_path / "state").glob("state-*.json")).read_text())
    assert state["sessions"] == {} and state["slots"][str(target)]["owner"] is None
    assert "no session matches" in keeper.release_command("ffffffff")
    h = flow(chat())
    await keeper.request(h)
    assert keeper.flows[h.id].reason != "known"  # a released session starts over


async def test_saved_flows_replay_offline_with_the_same_decisions(keeper, fake_llama, tmp_path):
    """A flow saved with -w carries the rewritten body; replaying it (flow.live False) must undo our rewrite,
    reuse the recorded server facts instead of the network and reach the same decision."""
    live = flow(chat())
    await keeper.request(live)
    live.response = http.Response.make(200, b'{"timings":{"cache_n":0,"prompt_n":40}}', {})
    keeper.response(live)
    meta = live.metadata["slotkeeper"]
    assert meta["client"] == {"id_slot": None, "cache_prompt": None} and meta["facts"]["props"]["total_slots"] == 4

    saved = live.copy()
    saved.live = False
    saved.response = None
    fake_llama.calls.clear()
    await keeper.request(saved)
    info = keeper.flows[saved.id]
    assert fake_llama.calls == []  # no network in replay
    assert (info.slot, info.reason) == (meta["slot"], meta["reason"])
    assert "replay:" + UP in keeper.runtimes
