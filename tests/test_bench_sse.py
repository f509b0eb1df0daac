"""The benchmark client's stream handling: llama-server's chat stream layouts through the addon's SSE parser."""

from __future__ import annotations

import json

from bench.client import RequestRecord, apply_event
from slotlogic.answers import SSEParser

CHUNK = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
FINAL = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
USAGE = {"choices": [], "usage": {"completion_tokens": 4, "prompt_tokens": 35, "total_tokens": 39,
                                  "prompt_tokens_details": {"cached_tokens": 30}},
         "timings": {"cache_n": 30, "prompt_n": 5, "prompt_ms": 1.0}}


def stream(*events: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def parse_all(chunks: list[bytes]) -> tuple[list[dict], SSEParser]:
    p = SSEParser()
    out = [e for c in chunks for e in p.feed(c)]
    out += list(p.close())
    return out, p


def test_several_events_in_one_chunk_and_done_skipped() -> None:
    events, _ = parse_all([stream(CHUNK, FINAL, USAGE)])
    assert events == [CHUNK, FINAL, USAGE]


def test_events_split_at_every_byte() -> None:
    raw = stream(CHUNK, FINAL, USAGE)
    events, _ = parse_all([raw[i:i + 1] for i in range(len(raw))])
    assert events == [CHUNK, FINAL, USAGE]


def test_crlf_split_between_chunks_comments_and_multiline_data() -> None:
    raw = (b": ping\r\n\r\ndata: {\"a\":\r\ndata: 1}\r\n\r\n" + b"data:" + json.dumps(USAGE).encode() + b"\r")
    events, _ = parse_all([raw, b"\n\r\ndata: [DONE]\r\n\r\n"])
    assert events == [{"a": 1}, USAGE]


def test_unterminated_last_event_is_flushed() -> None:
    events, _ = parse_all([b"data: {\"x\": 2}"])
    assert events == [{"x": 2}]


def test_timings_from_usage_chunk_win() -> None:
    rec = RequestRecord("c", "w", "s0", 0, 0.0, None, 0.0, 200)
    for e in (CHUNK, {**FINAL, "timings": {"cache_n": 1, "prompt_n": 99}}, USAGE):
        apply_event(rec, e)
    assert (rec.prompt_n, rec.cache_n, rec.cached_tokens, rec.prompt_tokens) == (5, 30, 30, 35)
    assert rec.error is None


def test_error_event_is_recorded() -> None:
    rec = RequestRecord("c", "w", "s0", 0, 0.0, None, 0.0, 200)
    apply_event(rec, {"error": {"code": 500, "message": "boom"}})
    assert rec.error is not None and "boom" in rec.error


def test_non_object_data_is_an_error_not_a_crash() -> None:
    rec = RequestRecord("c", "w", "s0", 0, 0.0, None, 0.0, 200)
    apply_event(rec, [1, 2])
    assert rec.error is not None and "unexpected" in rec.error
