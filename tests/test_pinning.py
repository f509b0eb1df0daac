"""The pinning addon in mitmproxy's own test harness (taddons/tflow), with a scripted server client."""

from __future__ import annotations

import gzip
import json
import logging

import pytest
from mitmproxy import http
from mitmproxy.flow import Error as flow_error

from slotkeeper.drivers import store_file
from slotlogic.answers import StreamObserver
from tests.conftest import UP, chat, flow, sent, streamed


async def test_a_new_session_is_pinned_and_a_known_one_costs_no_io(proxy, fake_llama, monkeypatch):
    f1 = await proxy.request(flow(chat()))
    assert sent(f1)["id_slot"] in range(4) and sent(f1)["cache_prompt"] is True
    assert fake_llama.calls == ["props", "slots"]
    transactions = []
    real = store_file.StateFile.transaction
    monkeypatch.setattr(store_file.StateFile, "transaction", lambda self: transactions.append(1) or real(self))
    first = chat()
    later = first | {"messages": [*first["messages"], {"role": "assistant", "content": "done"}]}
    f2 = await proxy.request(flow(later))
    assert f2.request.content == json.dumps(later).encode()[:-1] + b',"id_slot":%d,"cache_prompt":true}' % (
        sent(f1)["id_slot"])
    assert fake_llama.calls == ["props", "slots"]  # no network for a known session
    assert transactions == []  # no lock, no disk: touches are flushed later


async def test_two_sessions_get_two_slots(proxy):
    a = await proxy.request(flow(chat("task A")))
    b = await proxy.request(flow(chat("task B")))
    assert sent(a)["id_slot"] != sent(b)["id_slot"]


async def test_the_clients_own_slot_is_replaced_unless_clients_are_trusted(proxy, caplog):
    proxy.configure(slots_override_client=False)
    f = await proxy.request(flow(chat(id_slot=2)))
    assert sent(f)["id_slot"] == 2
    proxy.configure(slots_override_client=True)
    g = await proxy.request(flow(chat("other", id_slot=2)))
    with caplog.at_level(logging.INFO):
        await proxy.answer(g, http.Response.make(200, b'{"timings":{"cache_n":0,"prompt_n":5}}', {}))
    assert "why=free" in caplog.text and g.metadata["slotkeeper"]["slot"] == sent(g)["id_slot"]


async def test_a_gzip_body_is_rewritten_and_stays_gzip(proxy):
    f = flow(chat(), headers={"content-encoding": "gzip"})  # make() gzips the body for us
    assert f.request.raw_content[:2] == b"\x1f\x8b"
    await proxy.request(f)
    assert f.request.headers["content-encoding"] == "gzip"
    assert json.loads(gzip.decompress(f.request.raw_content))["id_slot"] in range(4)


async def test_a_chunked_body_gets_a_content_length(proxy):
    f = flow(chat(), headers={"transfer-encoding": "chunked"})
    f.request.headers.pop("content-length", None)
    await proxy.request(f)
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
async def test_untouched(proxy, fake_llama, method, path, raw):
    f = flow(None, path=path, method=method, raw=raw)
    before = f.request.raw_content
    await proxy.request(f)
    assert f.request.raw_content == before and fake_llama.calls == []


MESSAGES = {"model": "claude", "max_tokens": 5, "system": [{"type": "text", "text": "You are Claude Code."}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
CHAT_ANSWER = {"id": "chatcmpl-1", "model": "smollm2", "choices": [{"index": 0, "finish_reason": "stop",
               "message": {"role": "assistant", "content": "Hello"}}],
               "usage": {"prompt_tokens": 20, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 15}},
               "timings": {"cache_n": 15, "prompt_n": 5}}


async def test_an_anthropic_request_is_sent_as_a_pinned_chat_completion_and_answered_natively(proxy, caplog):
    f = await proxy.request(flow(MESSAGES, path="/v1/messages?beta=true",
                                 headers={"x-claude-code-session-id": "cc-1"}))
    assert f.request.path == "/v1/chat/completions" and sent(f)["id_slot"] in range(4)
    assert sent(f)["messages"][0] == {"role": "system", "content": "You are Claude Code."}
    with caplog.at_level(logging.INFO):
        await proxy.answer(f, http.Response.make(200, json.dumps(CHAT_ANSWER), {"content-type": "application/json"}))
    answer = json.loads(f.response.content)
    assert answer["type"] == "message" and answer["content"] == [{"type": "text", "text": "Hello"}]
    assert answer["stop_reason"] == "end_turn" and answer["usage"]["cache_read_input_tokens"] == 15
    assert "connection" not in f.response.headers  # a JSON answer keeps the connection alive
    assert "/v1/messages?beta=true session=" in caplog.text and "(header:x-claude-code-session-id)" in caplog.text
    g = await proxy.request(flow(MESSAGES, path="/v1/messages", headers={"x-claude-code-session-id": "cc-1"}))
    assert sent(g)["id_slot"] == sent(f)["id_slot"]  # the same session, the same slot


@pytest.mark.parametrize("body", [b'{"choices":[{"message":"str"}]}', b'{"choices":["x"]}', b"{not json",
                                  b'{"choices":[]}', b"[" * 100_000, b'{"choices":[{"message":{"tool_calls":[1]}}]}'])
async def test_an_unreadable_answer_to_a_translated_request_is_an_anthropic_error(proxy, caplog, body):
    """The client asked for a message: chat JSON it cannot read, with status 200, is not an answer."""
    f = await proxy.request(flow(MESSAGES, path="/v1/messages"))
    with caplog.at_level(logging.INFO):
        await proxy.answer(f, http.Response.make(200, body, {"content-type": "application/json"}))
    assert f.response.status_code == 502 and f.response.headers["content-type"] == "application/json"
    got = json.loads(f.response.content)
    assert got["type"] == "error" and got["error"]["type"] == "api_error" and "error=unreadable" in caplog.text


async def test_a_translated_stream_is_converted_chunk_by_chunk(proxy):
    f = await proxy.request(flow(MESSAGES | {"stream": True}, path="/v1/messages"))
    assert sent(f)["stream"] is True and sent(f)["stream_options"] == {"include_usage": True}
    f.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
    f.response.content = None
    await proxy.hook("responseheaders", f)
    first = f.response.stream(b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}],'
                              b'"timings":{"cache_n":10,"prompt_n":3}}\n\n')
    assert first.startswith(b"event: message_start")  # the client hears of the message as soon as the server
    text = f.response.stream(b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}],'
                             b'"timings":{"cache_n":10,"prompt_n":3}}\n\n')
    assert b"text_delta" in text and b'"Hi"' in text


async def test_a_translated_stream_drops_the_servers_content_length(proxy):
    """The converted body is not the server's: a server's Content-Length would make the client wait for bytes
    that never come (or cut the answer), so the client's body goes chunked."""
    f = await proxy.request(flow(MESSAGES | {"stream": True}, path="/v1/messages"))
    f.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
    f.response.content = None
    f.response.headers["content-length"] = "12345"
    await proxy.hook("responseheaders", f)
    assert "content-length" not in f.response.headers and f.response.headers["transfer-encoding"] == "chunked"
    g = await proxy.request(flow(chat("plain", stream=True)))
    g.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
    g.response.content = None
    g.response.headers["content-length"] = "12345"
    await proxy.hook("responseheaders", g)
    assert g.response.headers["content-length"] == "12345"  # passed byte for byte: the length holds


async def test_the_messages_route_is_observed_only_when_translation_is_off(proxy, caplog):
    proxy.configure(slots_anthropic="off")
    f = flow({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5}, path="/v1/messages")
    before = f.request.raw_content
    await proxy.request(f)
    assert f.request.raw_content == before and f.request.path == "/v1/messages"
    with caplog.at_level(logging.INFO):
        await proxy.answer(f, http.Response.make(200, b'{"usage":{"cache_read_input_tokens":3,"input_tokens":2}}',
                                                 {"content-type": "application/json"}))
    assert "not pinnable" in caplog.text and "cache_n=3" in caplog.text


async def test_native_mode_adds_id_slot_to_the_anthropic_body(proxy):
    proxy.configure(slots_anthropic="native")
    f = await proxy.request(flow(MESSAGES, path="/v1/messages"))
    assert f.request.path == "/v1/messages" and sent(f)["id_slot"] in range(4) and "system" in sent(f)


async def test_policy_off_observes_only(proxy, fake_llama, caplog):
    proxy.configure(slots_policy="off")
    f = flow(chat())
    before = f.request.raw_content
    await proxy.request(f)
    assert f.request.raw_content == before and fake_llama.calls == []
    with caplog.at_level(logging.INFO):
        await proxy.answer(f, http.Response.make(200, b'{"timings":{"cache_n":0,"prompt_n":50}}', {}))
    assert "why=policy off" in caplog.text and "prompt_n=50" in caplog.text


async def test_an_internal_error_fails_open_and_logs_no_prompt_text(proxy, fake_llama, caplog):
    fake_llama.fail = RuntimeError("boom: TOP SECRET prompt")
    f = flow(chat("TOP SECRET task"))
    before_body, before_headers = f.request.raw_content, f.request.headers.copy()
    with caplog.at_level(logging.WARNING):
        await proxy.request(f)
    assert f.request.raw_content == before_body and f.request.headers == before_headers
    assert "forwarded unchanged: RuntimeError" in caplog.text and "SECRET" not in caplog.text


async def test_an_unreachable_server_sends_unpinned_until_a_slot_count_is_known(proxy, fake_llama, caplog):
    """Unpinned, but its answer asked which slot ran it (`verbose`, stripped from what the client gets): the
    session's next turn goes back there (sim seed 1953: never learned, the session was placed anew once
    `/props` answered, beside its own conversation)."""
    fake_llama.props_data = None
    with caplog.at_level(logging.WARNING):
        f = await proxy.request(flow(chat()))
    assert (sent(f)["id_slot"], sent(f)["verbose"]) == (-1, True) and "passes unpinned" in caplog.text
    answer = {"choices": [{"message": {"content": "ok"}}], "id": "x", "__verbose": {"id_slot": 2, "prompt": "p"},
              "timings": {"cache_n": 0, "prompt_n": 40}}
    await proxy.answer(f, http.Response.make(200, json.dumps(answer), {"content-type": "application/json"}))
    assert "__verbose" not in json.loads(f.response.content)
    g = await proxy.request(flow(chat()))  # the server still unreachable: back to the slot that ran it
    assert sent(g)["id_slot"] == 2 and "verbose" not in sent(g)


async def test_an_unreachable_server_pins_by_hash_over_the_last_known_count(proxy, fake_llama, caplog):
    await proxy.request(flow(chat()))  # the server answered once: 4 slots
    fake_llama.props_data = None  # refused at once: the server is down, the request fails there anyway
    with caplog.at_level(logging.WARNING):
        g = await proxy.request(flow(chat("other")))
    assert sent(g)["id_slot"] in range(4) and "hash fallback" in caplog.text


async def test_an_sse_stream_passes_byte_for_byte_and_is_observed(proxy, caplog):
    f = await proxy.request(flow(chat(stream=True)))
    f.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
    f.response.content = None
    await proxy.hook("responseheaders", f)
    assert callable(f.response.stream)
    assert f.response.headers["x-slot-id"] == str(sent(f)["id_slot"])
    stream = (b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
              b'data: {"choices":[],"timings":{"cache_n":120,"prompt_n":8}}\n\ndata: [DONE]\n\n')
    out = streamed(f, stream)
    assert out == stream
    with caplog.at_level(logging.INFO):
        await proxy.hook("response", f)
    assert "cache_n=120 prompt_n=8 reuse=94%" in caplog.text
    assert f.marked == ":zap:" and "slot=" in f.comment and f.metadata["slotkeeper"]["cache_n"] == 120
    assert f.response.headers["connection"] == "close"  # llama-server closes after a stream: said aloud


@pytest.mark.parametrize(("sent_before_hangup", "error"), [(2, False), (1, True)], ids=["after-end", "mid-answer"])
async def test_a_client_that_hangs_up_after_the_end_lost_nothing(proxy, sent_before_hangup, error):
    """Codex closes its connection as soon as it has `response.completed`: not an error; a cut mid-answer is."""
    f = await proxy.request(flow(chat(stream=True)))
    f.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
    f.response.content = None
    await proxy.hook("responseheaders", f)
    events = [b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n',
              b'data: {"choices":[{"delta":{},"finish_reason":"stop"}],"timings":{"cache_n":120,"prompt_n":8}}\n\n']
    for event in events[:sent_before_hangup]:
        f.response.stream(event)
    f.error = flow_error("Client disconnected.")
    await proxy.hook("error", f)
    meta = f.metadata["slotkeeper"]
    assert meta["outcome"] == ("error" if error else "hit") and meta["cache_n"] == (120 if not error else None)


async def test_a_broken_observer_never_breaks_the_stream(proxy, monkeypatch, caplog):
    f = await proxy.request(flow(chat(stream=True)))
    f.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
    f.response.content = None
    monkeypatch.setattr(StreamObserver, "feed", lambda self, chunk: 1 / 0)
    await proxy.hook("responseheaders", f)
    with caplog.at_level(logging.WARNING):
        assert f.response.stream(b"data: 1\n\n") == b"data: 1\n\n"
        assert f.response.stream(b"more") == b"more"
    assert caplog.text.count("SSE observer failed") == 1 and "ZeroDivisionError" in caplog.text


async def test_a_context_overflow_is_explained(proxy, caplog):
    f = await proxy.request(flow(chat()))
    err = {"error": {"code": 400, "type": "exceed_context_size_error", "message": "x",
                     "n_prompt_tokens": 9000, "n_ctx": 4096}}
    with caplog.at_level(logging.WARNING):
        await proxy.answer(f, http.Response.make(400, json.dumps(err), {"content-type": "application/json"}))
    assert "9000 tokens exceeds the per-slot context n_ctx=4096" in caplog.text and f.marked == ":x:"


async def test_side_calls_go_to_the_reserved_slot(proxy):
    side = chat(first="summarise") | {"messages": [
        {"role": "system", "content": "You are a context summarization assistant."},
        {"role": "user", "content": "..."}]}
    for _ in range(2):  # the second is recognised from its bytes: still a side call
        f = await proxy.request(flow(side))
        await proxy.answer(f, http.Response.make(200, b"{}", {}))
        assert sent(f)["id_slot"] == 3 and f.metadata["slotkeeper"]["reason"] == "side-call"


async def test_the_state_is_flushed_at_shutdown(proxy, tmp_path):
    f = await proxy.request(flow(chat()))
    await proxy.request(flow(chat()))
    for a in proxy.addons:
        if hasattr(a, "done"):
            a.done()
    state = json.loads(next((tmp_path / "state").glob("state-*.json")).read_text())
    ((_key, rec),) = state["sessions"].items()
    assert rec["slot"] == sent(f)["id_slot"] and rec["requests"] >= 2


async def test_a_saved_flow_replays_offline_with_the_same_decision(proxy, fake_llama):
    """A flow saved with -w carries the rewritten body; replaying it (flow.live False) undoes our rewrite,
    reuses the recorded server facts instead of the network and reaches the same decision."""
    live = await proxy.request(flow(chat()))
    await proxy.answer(live, http.Response.make(200, b'{"timings":{"cache_n":0,"prompt_n":40}}', {}))
    meta = live.metadata["slotkeeper"]
    assert meta["client"] == {"id_slot": None, "cache_prompt": None} and meta["facts"]["props"]["total_slots"] == 4
    saved = live.copy()
    saved.live = False
    fake_llama.calls.clear()
    await proxy.request(saved)
    await proxy.answer(saved, live.response)
    assert fake_llama.calls == []  # no network in replay
    replayed = saved.metadata["slotkeeper"]
    assert (replayed["slot"], replayed["reason"]) == (meta["slot"], meta["reason"])
    assert saved.request.raw_content == live.request.raw_content and UP in proxy.rt.replays


async def test_control_bytes_in_the_request_path_never_reach_the_terminal(proxy, caplog):
    f = await proxy.request(flow(chat(), path="/v1/chat/completions?\x1b[1A\x1b[2Kslotkeeper:%20fake"))
    with caplog.at_level(logging.INFO):
        await proxy.answer(f, http.Response.make(200, json.dumps(CHAT_ANSWER), {"content-type": "application/json"}))
        await proxy.request(flow(None, path="/v1/chat/completions?\x1b]0;x\x07", raw=b"not json"))
    lines = [r.getMessage() for r in caplog.records if "slotkeeper" in r.getMessage()]
    assert lines and all("\x1b" not in m and "\x07" not in m for m in lines)
    assert any("?\\x1b[1A\\x1b[2Kslotkeeper:%20fake session=" in m for m in lines)


CHAT_PARTIAL = (b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}],'
                b'"timings":{"cache_n":10,"prompt_n":3}}\n\n'
                b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}],"timings":{"cache_n":10,"prompt_n":3}}\n\n')


@pytest.mark.parametrize("body", [CHAT_PARTIAL, b""], ids=["cut-between-events", "empty"])
@pytest.mark.parametrize("translated", [False, True], ids=["chat", "anthropic"])
async def test_a_stream_that_ends_cleanly_before_its_end_is_marked(proxy, caplog, body, translated):
    """No finish_reason, no [DONE]: the log says error=truncated, and a translated client gets an error event
    instead of a message without message_stop."""
    f = await proxy.request(flow(MESSAGES | {"stream": True}, path="/v1/messages") if translated
                            else flow(chat(stream=True)))
    f.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
    f.response.content = None
    await proxy.hook("responseheaders", f)
    out = streamed(f, body)
    with caplog.at_level(logging.INFO):
        await proxy.hook("response", f)
    assert "error=truncated" in caplog.text
    if translated:
        assert out.endswith(b"\n\n") and b"message_stop" not in out
        assert out.split(b"\n\n")[-2].startswith(b'event: error\ndata: {"type":"error","error":{"type":"api_error"')
    else:
        assert out == body


@pytest.mark.parametrize("translated", [False, True], ids=["chat", "anthropic"])
async def test_an_answer_announcing_more_than_the_body_cap_is_not_buffered(proxy, caplog, translated):
    """mitmproxy buffers every answer it does not stream (a 1 GB answer cost 3.6 GB): past slots_max_body_mb it
    passes through unobserved, and a translated one, which would be converted whole, is Anthropic's error."""
    proxy.configure(slots_max_body_mb=1)
    f = await proxy.request(flow(MESSAGES, path="/v1/messages") if translated else flow(chat()))
    f.response = http.Response.make(200, b"", {"content-type": "application/json"})
    f.response.content = None
    f.response.headers["content-length"] = str((1 << 20) + 1)
    await proxy.hook("responseheaders", f)
    if not translated:
        assert f.response.stream is True and f.response.status_code == 200
    else:
        assert f.response.status_code == 502 and "content-length" not in f.response.headers
        assert f.response.stream(b"x" * 1000) == []
        got = json.loads(f.response.stream(b""))
        assert got["type"] == "error" and "slots_max_body_mb" in got["error"]["message"]
        with caplog.at_level(logging.INFO):
            await proxy.hook("response", f)
        assert "error=too-large" in caplog.text
    g = await proxy.request(flow(chat("small")))
    g.response = http.Response.make(200, b"", {"content-type": "application/json"})
    g.response.content = None
    g.response.headers["content-length"] = str(1 << 20)
    await proxy.hook("responseheaders", g)
    assert not g.response.stream  # within the cap: buffered and read as ever


async def test_without_a_save_dir_one_line_at_start_says_how_to_turn_paging_on(proxy, caplog, tmp_path):
    proxy.configure(mode=["reverse:http://127.0.0.1:8080@127.0.0.1:8081"])
    with caplog.at_level(logging.INFO):
        proxy.addons[1].running()
    line = "no slots_save_dir: a conversation evicted from its slot is prefilled again when its session returns"
    assert caplog.text.count(line) == 1 and "--slot-save-path DIR" in caplog.text
    assert "mitmweb UI" not in caplog.text  # mitmdump: no UI
    caplog.clear()
    (tmp_path / "slots").mkdir()
    proxy.configure(slots_save_dir=str(tmp_path / "slots"))
    with caplog.at_level(logging.INFO):
        proxy.addons[1].running()
    assert "no slots_save_dir" not in caplog.text
    await proxy.settle()
