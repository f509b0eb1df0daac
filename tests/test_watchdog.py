"""The watch addon in the addon chain: waiting requests are logged, shown and, when stalled or overdue, ended.

The slot readings come from a scripted `/slots`; ending a live connection needs mitmproxy's proxy server,
so `abort.end_flow` is recorded here and exercised for real in tests/test_real_watch.py."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from mitmproxy import exceptions, http
from mitmproxy.flow import Error

from slotkeeper.mitm import abort, watchdog
from tests.conftest import FakeLlama, chat, flow


class SlotsLlama(FakeLlama):
    """A FakeLlama whose `/slots` polls are scripted: a list of slot dicts, None (unavailable) or "timeout"."""

    def __init__(self) -> None:
        super().__init__()
        self.polls: list[object] = []
        self.poll = [{"id": i, "is_processing": i == 0, "n_prompt_tokens": 500, "n_prompt_tokens_processed": 100,
                      "next_token": [{"n_decoded": 0}]} for i in range(4)]

    async def poll_slots(self, timeout: float):
        self.polls.append(timeout)
        if self.poll == "timeout":
            return True, None
        return False, self.poll


@pytest.fixture
async def llama(proxy):
    fake = SlotsLlama()
    proxy.rt.make_client = lambda url: fake
    proxy.addons[2].running()   # mitmproxy calls it once the proxy is up: the sweeper starts
    yield fake
    proxy.addons[2].done()


@pytest.fixture
def ended(monkeypatch):
    calls = []

    def end_flow(f, status, message, stream_event=None, body=None):
        calls.append((f.id, status, message, stream_event, body))
        return True
    monkeypatch.setattr(watchdog.abort, "end_flow", end_flow)
    return calls


async def wait_for(predicate, timeout=3.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_waiting_request_is_logged_shown_in_the_status_and_as_its_comment(proxy, llama, caplog):
    proxy.configure(slots_watch_interval_ms=50, slots_watch_timeout_ms=700)
    with caplog.at_level(logging.INFO):
        f = await proxy.request(flow(chat()))
        slot = proxy.rt.open[f.id].ticket.slot
        llama.poll[0]["is_processing"] = False
        llama.poll[slot] |= {"is_processing": True}
        await wait_for(lambda: "for its first byte" in caplog.text)
    assert f"prefilling (100/500) on slot {slot}" in caplog.text and llama.polls[0] == 0.7
    waiting = proxy.rt.status([])["waiting"]
    assert waiting and waiting[0]["state"] == "prefilling" and waiting[0]["slot"] == slot
    assert "waiting" in f.comment and "prefilling" in f.comment and f.marked == ":hourglass_flowing_sand:"
    assert "You are a coding agent" not in caplog.text
    await proxy.answer(f, http.Response.make(200, b'{"timings":{"cache_n":0,"prompt_n":5}}',
                                             {"content-type": "application/json"}))
    assert proxy.rt.status([])["waiting"] == [] and "waiting" not in f.comment
    polls = len(llama.polls)
    await asyncio.sleep(0.2)
    assert len(llama.polls) == polls                       # stopped with the answer


async def test_a_stall_gets_a_504_and_the_report_says_why(proxy, llama, ended, caplog):
    proxy.configure(slots_watch_interval_ms=100, slots_first_token_timeout=1)
    llama.poll = [{"id": i, "is_processing": False, "id_task": 3, "n_prompt_tokens": 0} for i in range(4)]
    with caplog.at_level(logging.INFO):
        f = await proxy.request(flow(chat()))
        await wait_for(lambda: ended, timeout=4)
    (fid, status, message, event, body), = ended
    assert (fid, status, event) == (f.id, 504, None)
    assert message.startswith("slotkeeper: no first byte while every slot stayed idle for 1 s")
    assert json.loads(body) == {"error": {"code": 504, "message": message, "type": "timeout_error"}}
    assert "stalled: every slot idle" in caplog.text and "answered 504 and closed the upstream" in caplog.text
    f.error = Error("slotkeeper: …")
    await proxy.hook("error", f)
    assert proxy.rt.reports[f.id].obs.error_type == "first-token-timeout"


async def test_a_request_whose_own_slot_runs_without_progress_gets_a_504_so_the_server_frees_it(proxy, llama, ended,
                                                                                                   caplog):
    """mix-4 run K: llama-server spun on one slot, its counters frozen, while the requests pinned there waited."""
    proxy.configure(slots_watch_interval_ms=100, slots_wedged_timeout=1)
    with caplog.at_level(logging.INFO):
        f = await proxy.request(flow(chat()))
        slot = proxy.rt.open[f.id].ticket.slot
        proxy.rt.open[f.id].upstream.keeper.outcomes.probed(20_000.0)  # a batch: 0.1 s (unmeasured: 100 s)
        llama.poll = [{"id": i, "is_processing": i == slot, "id_task": 690, "n_prompt_tokens": 989,
                       "n_prompt_tokens_processed": 2046, "next_token": [{"n_decoded": 0}]} for i in range(4)]
        await wait_for(lambda: ended, timeout=4)
    (fid, status, message, event, _body), = ended
    assert (fid, status, event) == (f.id, 504, None)
    assert message.startswith("slotkeeper: its slot's task made no progress for 1 s (slots_wedged_timeout)")
    assert "answered 504 and closed the upstream" in caplog.text
    f.error = Error("slotkeeper: …")
    await proxy.hook("error", f)
    assert proxy.rt.reports[f.id].obs.error_type == "wedged"


async def test_a_slot_that_moves_is_never_wedged(proxy, llama, ended):
    proxy.configure(slots_watch_interval_ms=100, slots_wedged_timeout=1)
    f = await proxy.request(flow(chat()))
    slot = proxy.rt.open[f.id].ticket.slot
    proxy.rt.open[f.id].upstream.keeper.outcomes.probed(20_000.0)  # the limit is 1 s: only the moves keep it alive
    llama.poll = [{"id": i, "is_processing": i == slot, "id_task": 5, "n_prompt_tokens": 90_000,
                   "n_prompt_tokens_processed": 0, "next_token": [{"n_decoded": 0}]} for i in range(4)]
    for _ in range(25):  # 2.5 s: its counters move at every poll
        llama.poll[slot]["n_prompt_tokens_processed"] += 512
        await asyncio.sleep(0.1)
    assert not ended


@pytest.mark.parametrize("mode", ["native", "translate"])
async def test_a_stalled_messages_request_gets_anthropics_error_body(proxy, llama, ended, mode):
    """The 504's body on /v1/messages is Anthropic's error body, translated (sent upstream as a chat completion)
    or not: its client is an Anthropic client either way."""
    proxy.configure(slots_watch_interval_ms=100, slots_first_token_timeout=1, slots_anthropic=mode)
    llama.poll = [{"id": i, "is_processing": False, "id_task": 3, "n_prompt_tokens": 0} for i in range(4)]
    f = await proxy.request(flow({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
                                 path="/v1/messages"))
    await wait_for(lambda: ended, timeout=4)
    (_, status, message, event, body), = ended
    assert (status, event) == (504, None)
    assert json.loads(body) == {"type": "error", "error": {"type": "timeout_error", "message": message}}
    f.error = Error(message)
    await proxy.hook("error", f)


def test_an_error_page_is_answered_as_json_and_mitmproxys_own_errors_stay_html():
    """The wrapped `make_error_response` of mitmproxy's HTTP/1 layer (what its client side calls with the
    injected error's message): an `ErrorPage` becomes its JSON body, anything else mitmproxy's page."""
    from mitmproxy.net.http import http1
    from mitmproxy.proxy.layers.http import _http1

    assert abort.install_json_errors() and abort.install_json_errors()      # idempotent: wrapped once
    assert not hasattr(_http1.make_error_response.slotkeeper_original, "slotkeeper_original")
    body = b'{"error":{"code":504,"message":"slotkeeper: late","type":"timeout_error"}}'
    page = abort.ErrorPage("slotkeeper: late", body)
    assert page == "slotkeeper: late" and isinstance(page, str)
    raw = _http1.make_error_response(504, page)
    head, _, got = raw.partition(b"\r\n\r\n")
    response = http1.read_response_head(head.split(b"\r\n"))
    assert response.status_code == 504 and response.headers["content-type"] == "application/json"
    assert got == body and response.headers["content-length"] == str(len(body))
    for message in ("slotkeeper: late", abort.ErrorPage("no body")):              # mitmproxy's page, unchanged
        html = _http1.make_error_response(502, message)
        assert b"content-type: text/html" in html.lower() and message.encode() in html


async def test_a_busy_server_never_counts_as_stalled(proxy, llama, ended, caplog):
    proxy.configure(slots_watch_interval_ms=100, slots_first_token_timeout=1)
    llama.poll = "timeout"
    with caplog.at_level(logging.INFO):
        f = await proxy.request(flow(chat()))
        await asyncio.sleep(1.6)
    assert not ended and "llama-server busy (/slots did not answer in time" in caplog.text
    f.error = Error("gone")
    await proxy.hook("error", f)


async def test_a_started_stream_is_not_polled_and_its_deadline_ends_it_with_an_error_event(proxy, llama, ended):
    proxy.configure(slots_watch_interval_ms=50, slots_request_deadline=1)
    f = await proxy.request(flow(chat(stream=True)))
    f.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
    f.response.content = None
    await proxy.hook("responseheaders", f)
    f.response.stream(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n')
    await asyncio.sleep(0.3)
    assert llama.polls == []                               # the first byte came before the first poll
    await wait_for(lambda: ended, timeout=3)
    (_, status, _, event, _), = ended
    assert status == 504 and b'"code": 504' in event and b"deadline of 1 s reached" in event
    f.response.stream(event)                               # what mitmproxy does with the injected chunk
    await proxy.hook("response", f)
    assert proxy.rt.reports[f.id].obs.error_type == "timeout_error"


async def test_a_translated_request_is_named_by_the_path_its_client_asked(proxy, llama, caplog):
    proxy.configure(slots_watch_interval_ms=50, slots_anthropic="translate")
    with caplog.at_level(logging.INFO):
        f = await proxy.request(flow({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
                                     path="/v1/messages?beta=true"))
        assert f.request.path == "/v1/chat/completions"
        await wait_for(lambda: "for its first byte" in caplog.text)
    line = next(r.getMessage() for r in caplog.records if "for its first byte" in r.getMessage())
    assert line.startswith("slotkeeper: /v1/messages?beta=true session=")


@pytest.mark.parametrize("mode", ["native", "translate"])
async def test_the_messages_route_gets_anthropics_error_event(proxy, llama, ended, mode):
    proxy.configure(slots_request_deadline=1, slots_anthropic=mode)
    f = await proxy.request(flow({"model": "m", "max_tokens": 5, "stream": True,
                                  "messages": [{"role": "user", "content": "hi"}]}, path="/v1/messages"))
    f.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
    f.response.content = None
    await proxy.hook("responseheaders", f)
    await wait_for(lambda: ended, timeout=3)
    sent = f.response.stream(ended[0][3])          # what mitmproxy does with the injected chunk
    assert sent.startswith(b"event: error\ndata: {") and b"deadline of 1 s reached" in sent


@pytest.mark.parametrize("translated", [False, True], ids=["chat", "anthropic"])
async def test_a_deadline_inside_an_event_sends_the_error_as_an_event_of_its_own(proxy, llama, ended, translated):
    """Cut inside an event, the error line was glued onto the unfinished one (chat), and a translated stream got
    no error event at all (its converter held the chat error as part of the unfinished line)."""
    proxy.configure(slots_request_deadline=1, slots_anthropic="translate")
    f = await proxy.request(flow({"model": "m", "max_tokens": 5, "stream": True,
                                  "messages": [{"role": "user", "content": "hi"}]}, path="/v1/messages")
                            if translated else flow(chat(stream=True)))
    f.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
    f.response.content = None
    await proxy.hook("responseheaders", f)
    got = f.response.stream(b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}],'
                            b'"timings":{"cache_n":1,"prompt_n":2}}\n\ndata: {"choices":[{"index":0,"del')
    await wait_for(lambda: ended, timeout=3)
    sent = f.response.stream(ended[0][3])          # what mitmproxy does with the injected chunk
    if translated:
        assert got.startswith(b"event: message_start") and got.endswith(b"\n\n")
        assert sent.startswith(b'event: error\ndata: {"type":"error","error":{"type":"timeout_error"')
    else:
        assert sent.startswith(b"\n\ndata: {") and b"deadline of 1 s reached" in sent
    assert sent.endswith(b"\n\n") and b"deadline of 1 s reached" in sent
    f.error = Error("slotkeeper: deadline")
    await proxy.hook("error", f)
    assert proxy.rt.reports[f.id].obs.error_type in ("timeout_error", "deadline")


@pytest.mark.parametrize("option", [o.name for o in watchdog.OPTIONS])
def test_negative_values_are_refused(proxy, option):
    with pytest.raises(exceptions.OptionsError):
        proxy.configure(**{option: -1})


async def test_off_means_no_watch_at_all(proxy, llama):
    proxy.configure(slots_watch_interval_ms=0)
    f = await proxy.request(flow(chat()))
    await asyncio.sleep(1.2)
    assert not proxy.addons[2].watches and llama.polls == []
    f.error = Error("gone")
    await proxy.hook("error", f)
