"""Hot-path header helpers on raw field tuples agree with mitmproxy's own accessors."""

from __future__ import annotations

import gzip

from mitmproxy import http

from slotkeeper.mitm import flows as raw_headers


def req(content: bytes, **headers: str) -> http.Request:
    return http.Request.make("POST", "http://h/v1/chat/completions", content, headers)


def test_get_is_case_insensitive_and_first_value_wins():
    r = req(b"{}", **{"Content-Type": "application/json"})
    r.headers.fields += ((b"X-A", b"1"), (b"x-a", b"2"))
    assert raw_headers.get(r.headers.fields, b"x-a") == b"1" == r.headers.get_all("x-a")[0].encode()
    assert raw_headers.get(r.headers.fields, b"missing") is None


def test_set_content_replaces_length_in_place_and_drops_chunked_framing():
    r = req(b'{"a":1}')
    r.headers["transfer-encoding"] = "chunked"
    order = [k.lower() for k, _ in r.headers.fields]
    raw_headers.set_content(r, b'{"a":1,"id_slot":2}')
    assert r.raw_content == b'{"a":1,"id_slot":2}'
    assert r.headers["content-length"] == "19"
    assert "transfer-encoding" not in r.headers
    assert [k.lower() for k, _ in r.headers.fields] == [k for k in order if k != b"transfer-encoding"]


def test_set_content_appends_length_when_missing():
    r = req(b"")
    r.headers.fields = tuple(f for f in r.headers.fields if f[0].lower() != b"content-length")
    raw_headers.set_content(r, b"xyz")
    assert r.headers["content-length"] == "3"


def test_encoded_bodies_go_through_mitmproxy():
    r = req(b'{"a":1}', **{"content-encoding": "gzip"})  # make() encodes the body
    assert gzip.decompress(r.raw_content) == b'{"a":1}'
    assert raw_headers.content(r) == b'{"a":1}'
    raw_headers.set_content(r, b'{"a":2}')
    assert gzip.decompress(r.raw_content) == b'{"a":2}'
    assert r.headers["content-length"] == str(len(r.raw_content))
    bad = req(b"", **{"content-encoding": "gzip"})
    bad.raw_content = b"not gzip"
    try:
        raw_headers.content(bad)
    except ValueError:
        pass
    else:
        raise AssertionError("a bad encoding must raise, as get_content(strict=True)")


def test_is_sse():
    assert raw_headers.is_sse(http.Response.make(200, b"", {"Content-Type": "text/event-stream; charset=utf-8"}))
    assert not raw_headers.is_sse(http.Response.make(200, b"", {"content-type": "application/json"}))
    assert not raw_headers.is_sse(http.Response.make(200, b""))
