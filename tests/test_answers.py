"""Reading cache_n / prompt_n / id_slot from JSON bodies and from SSE streams split anywhere."""

import json

import pytest

from slotlogic.answers import Observation, SSEParser, StreamObserver, observe_json

CHAT_STREAM = (
    b'data: {"choices":[{"delta":{"content":"Hi"}}],"object":"chat.completion.chunk"}\n\n'
    b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":300,"prompt_tokens_details":{"cached_tokens":290}},'
    b'"timings":{"cache_n":290,"prompt_n":10,"prompt_per_second":400.0}}\n\n'
    b"data: [DONE]\n\n"
)
NATIVE_STREAM = (
    b'data: {"content":"a","stop":false,"id_slot":-1}\r\n\r\n'
    b'data: {"content":"","stop":true,"id_slot":2,"timings":{"cache_n":5,"prompt_n":1}}\r\n\r\n'
)


def feed_split(stream: bytes, cut: list[int]) -> Observation:
    obs = StreamObserver()
    prev = 0
    for c in [*cut, len(stream)]:
        obs.feed(stream[prev:c])
        prev = c
    obs.feed(b"")
    return obs.obs


@pytest.mark.parametrize("stream", [CHAT_STREAM, NATIVE_STREAM], ids=["chat", "native"])
def test_every_single_split_point_parses_the_same(stream):
    whole = feed_split(stream, [])
    for cut in range(1, len(stream)):
        got = feed_split(stream, [cut])
        assert (got.cache_n, got.prompt_n, got.id_slot) == (whole.cache_n, whole.prompt_n, whole.id_slot)


def test_byte_by_byte():
    got = feed_split(CHAT_STREAM, list(range(1, len(CHAT_STREAM))))
    assert (got.cache_n, got.prompt_n, got.prompt_per_second, got.events) == (290, 10, 400.0, 3)


def test_native_stream_takes_real_slot_from_final_chunk():
    got = feed_split(NATIVE_STREAM, [])
    assert got.id_slot == 2 and got.cache_n == 5 and got.outcome == "hit"


def test_final_event_without_blank_line_still_counts():
    got = feed_split(b'data: {"timings":{"cache_n":1,"prompt_n":9}}', [])
    assert got.prompt_n == 9 and got.outcome == "partial"


def test_garbage_is_ignored():
    p = SSEParser()
    assert list(p.feed(b"data: not json\n\n: ping\n\nevent: x\ndata: {\"a\":1}\n\n")) == [{"a": 1}]


def test_multiline_data_joins():
    assert list(SSEParser().feed(b'data: {"a":\ndata: 1}\n\n')) == [{"a": 1}]


def test_json_oai_and_native():
    oai = observe_json(json.dumps({"usage": {"prompt_tokens_details": {"cached_tokens": 7}},
                                   "timings": {"cache_n": 7, "prompt_n": 3}}).encode())
    assert (oai.cache_n, oai.prompt_n, oai.reuse) == (7, 3, 0.7)
    native = observe_json(b'{"id_slot":3,"timings":{"cache_n":0,"prompt_n":290}}')
    assert native.id_slot == 3 and native.outcome == "miss"
    verbose = observe_json(b'{"__verbose":{"id_slot":1,"timings":{"cache_n":4,"prompt_n":1}}}')
    assert verbose.id_slot == 1 and verbose.cache_n == 4


def test_usage_only_shapes():
    resp = observe_json(b'{"usage":{"input_tokens_details":{"cached_tokens":12}}}')
    assert resp.cache_n == 12 and resp.prompt_n is None and resp.outcome == "unknown"
    anthropic = observe_json(b'{"usage":{"cache_read_input_tokens":50,"input_tokens":5}}')
    assert (anthropic.cache_n, anthropic.prompt_n) == (50, 5)


def test_context_error_is_read():
    body = {"error": {"code": 400, "type": "exceed_context_size_error", "message": "too long",
                      "n_prompt_tokens": 9000, "n_ctx": 4096}}
    got = observe_json(json.dumps(body).encode())
    assert (got.error_type, got.n_prompt_tokens, got.n_ctx, got.outcome) == (
        "exceed_context_size_error", 9000, 4096, "error")


def test_not_json():
    assert observe_json(b"<html>").outcome == "unknown"


RESPONSES_END = b'event: response.completed\ndata: {"type":"response.completed","response":{"usage":{}}}\n\n'
MESSAGES_END = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


@pytest.mark.parametrize("stream", [CHAT_STREAM, NATIVE_STREAM, RESPONSES_END, MESSAGES_END, b"data: [DONE]\n\n"],
                         ids=["chat", "native", "responses", "messages", "done"])
def test_the_end_of_an_answer_is_seen_on_every_route(stream):
    assert feed_split(stream, []).complete
    assert not feed_split(stream[: stream.index(b"data:") + 8], []).complete  # cut inside the last event


def test_a_stream_cut_before_its_end_is_not_complete():
    cut = CHAT_STREAM.index(b'data: {"choices":[{"delta":{},"finish_reason"')
    assert not feed_split(CHAT_STREAM[:cut], []).complete
    assert observe_json(b'{"choices":[]}').complete and not observe_json(b'{"choi').complete
