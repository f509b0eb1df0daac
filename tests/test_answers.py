"""Reading cache_n / prompt_n / id_slot from JSON bodies and from SSE streams split anywhere."""

import contextlib
import json
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


# -- bounds: no stream can grow the parser (issue 20, item 4) -----------------------------------------------

MAX_LINE, MAX_EVENT, MAX_LINES = 64, 160, 6


def reference(stream: bytes) -> list:
    """What the parser must yield for `stream` whole, written plainly: lines over MAX_LINE (raw, before the
    newline), events whose data lines, joined, are longer than MAX_EVENT and events of more than MAX_LINES
    lines are dropped with their event."""
    out, data, tainted = [], [], False
    lines = stream.split(b"\n")
    if not lines[-1]:
        lines.pop()

    def dispatch():
        payload = b"\n".join(data)
        if not tainted and data and payload.strip() != b"[DONE]":
            with contextlib.suppress(ValueError):
                out.append(json.loads(payload))

    n = 0
    for raw in lines:
        line = raw.rstrip(b"\r")
        n += bool(line)
        if len(raw) > MAX_LINE:
            tainted = True
        elif not line:
            dispatch()
            data, tainted, n = [], False, 0
        elif n > MAX_LINES:
            tainted = True
        elif line.startswith(b"data:") and not tainted:
            payload = line[5:][1:] if line[5:].startswith(b" ") else line[5:]
            data.append(payload)
            tainted = len(b"\n".join(data)) > MAX_EVENT
    dispatch()
    return out


def lines_of_every_length():
    """SSE lines: small JSON events, `data:` lines of every length up to past the caps, blank lines, comments."""
    event = st.fixed_dictionaries({"n": st.integers(0, 99)}).map(lambda e: b"data: " + json.dumps(e).encode())
    padded = st.integers(0, MAX_LINE + 8).map(lambda n: b"data: " + json.dumps({"p": "x" * n}).encode()[:n])
    other = st.sampled_from([b"", b"", b"\r", b": ping", b"event: x", b"data: [DONE]", b"data: {\"a\":", b"data: 1}"])
    return st.lists(st.one_of(event, padded, other), max_size=20)


@settings(max_examples=300, deadline=None)
@given(lines=lines_of_every_length(), crlf=st.booleans(), tail=st.booleans(),
       cuts=st.lists(st.integers(0, 4000), max_size=12))
def test_capped_parser_yields_the_same_however_the_stream_is_cut(lines, crlf, tail, cuts):
    nl = b"\r\n" if crlf else b"\n"
    stream = nl.join(lines) + (nl if tail else b"")
    p = SSEParser(max_line=MAX_LINE, max_event=MAX_EVENT, max_event_lines=MAX_LINES)
    got, prev = [], 0
    for c in [*sorted({min(c, len(stream)) for c in cuts}), len(stream)]:
        got += list(p.feed(stream[prev:c]))
        assert p.held <= MAX_LINE + MAX_EVENT
        prev = c
    got += list(p.close())
    assert got == reference(stream)


def test_capped_parser_at_every_single_split_point():
    stream = (b'data: {"a":1}\n\n' + b"data: " + b"x" * (MAX_LINE + 3) + b"\n\n" + b'data: {"b":2}\n'
              + b'data: {"c":3}\n'.replace(b"3", b"3" * 30) * 5 + b"\n" + b'data: {"d":4}\n\n'
              + b"data: 1\n" + b"data:\n" * MAX_LINES + b"\n" + b"data: 2\n" + b"data:\n" * (MAX_LINES - 1) + b"\n")
    want = [{"a": 1}, {"d": 4}, 2]
    assert reference(stream) == want
    for cut in range(len(stream) + 1):
        p = SSEParser(max_line=MAX_LINE, max_event=MAX_EVENT, max_event_lines=MAX_LINES)
        assert [*p.feed(stream[:cut]), *p.feed(stream[cut:]), *p.close()] == want
        assert p.dropped == 3


def test_a_stream_of_data_lines_without_a_blank_line_stays_bounded():
    """What is held is what is counted (4 MB of tiny `data:` lines kept as a list of bytes objects cost 60 MB)."""
    p = SSEParser(max_event=1 << 18)
    chunk = b"data: {}\n" * (1 << 14)
    tracemalloc.start()
    try:
        for _ in range(20):
            assert list(p.feed(chunk)) == []
            assert p.held <= p.max_event
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < p.max_event + 4 * len(chunk)
    assert list(p.feed(b'\ndata: {"after":1}\n\n')) == [{"after": 1}]


def test_a_line_without_a_newline_stays_bounded_and_the_stream_goes_on():
    p = SSEParser()
    for _ in range(100):
        assert list(p.feed(b"data: " + b"x" * (1 << 17))) == []
        assert p.held <= p.max_line
    assert list(p.feed(b'x\n\ndata: {"after":1}\n\n')) == [{"after": 1}]


def test_observer_is_started_by_a_dropped_line():
    o = StreamObserver()
    o.feed(b"x" * ((4 << 20) + 1))
    assert o.started and o.obs.events == 0


def test_the_decode_speed_is_read_from_timings_only_when_it_is_a_measurement():
    from slotlogic.answers import Observation, absorb

    def speed(timings: dict) -> float | None:
        obs = Observation()
        absorb(obs, {"timings": timings})
        return obs.decode_per_second

    assert speed({"predicted_per_second": 42.5, "predicted_n": 20}) == 42.5
    assert speed({"predicted_per_second": 42.5, "predicted_n": 1}) is None      # one token says little
    assert speed({"predicted_per_second": "fast", "predicted_n": 20}) is None
    assert speed({"predicted_per_second": 42.5, "predicted_n": "20"}) is None
