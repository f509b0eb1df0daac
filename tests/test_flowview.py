"""What a user sees of a request: the x-slot headers, the mitmweb comment and marker."""

from mitmproxy import http

from slotlogic import wording
from tests.conftest import chat, flow, sent


async def test_headers_comment_and_marker(proxy):
    f = await proxy.request(flow(chat()))
    await proxy.answer(f, http.Response.make(200, b'{"timings":{"cache_n":0,"prompt_n":80}}', {}))
    slot = sent(f)["id_slot"]
    assert f.response.headers["x-slot-id"] == str(slot) and len(f.response.headers["x-slot-session"]) == 8
    assert f.comment == f"s={f.response.headers['x-slot-session']} slot={slot} free-empty | cache 0/80 0%"
    assert f.marked == ":snail:"
    g = await proxy.request(flow(chat()))
    await proxy.answer(g, http.Response.make(200, b'{"timings":{"cache_n":79,"prompt_n":3}}', {}))
    assert g.marked == ":zap:" and " known | cache 79/82 96%" in g.comment


async def test_requests_that_are_not_ours_are_not_annotated(proxy):
    f = await proxy.request(flow(None, path="/v1/embeddings", raw=b"{}"))
    await proxy.answer(f, http.Response.make(200, b"{}", {}))
    assert f.comment == "" and f.marked == "" and "x-slot-id" not in f.response.headers


async def test_a_failing_view_logs_a_type_never_a_message(proxy, monkeypatch, caplog):
    def broken(report):
        raise ValueError("TOP SECRET prompt text")

    monkeypatch.setattr(wording, "comment", broken)
    f = await proxy.request(flow(chat()))
    await proxy.answer(f, http.Response.make(200, b"{}", {}))
    assert "could not read the response of /v1/chat/completions: ValueError" in caplog.text
    assert "SECRET" not in caplog.text and f.metadata["slotkeeper"]["slot"] == sent(f)["id_slot"]
