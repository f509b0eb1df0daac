"""Stripping llama-server's `__verbose` member: byte-exact for everything else, never holding a stream back."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from slotlogic.verbose import KEY, VerboseStripper, strip

VERBOSE = {"index": 0, "id_slot": 1, "prompt": 'a "quoted" prompt, with "__verbose": inside\n', "timings": {"x": 1}}


def dumps(obj):
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def test_a_chat_answer_loses_only_the_member():
    answer = {"choices": [{"message": {"content": "hi"}}], "id": "c1", "__verbose": VERBOSE, "timings": {"a": 1}}
    raw = dumps(answer)
    assert strip(raw) == dumps({k: v for k, v in answer.items() if k != "__verbose"})
    first = dumps({"__verbose": VERBOSE, "id": "c1"})
    assert strip(first) == b'{"id":"c1"}'
    assert strip(b'{"__verbose":{}}') == b"{}"
    plain = b'{"content":"a \\"__verbose\\": string only"}'
    assert strip(plain) == plain                       # a key inside a string is escaped: never cut
    broken = b'{"id":1,"__verbose":{"unterminated'
    assert strip(broken) == broken                     # anything unexpected: unchanged


members = st.dictionaries(st.text(min_size=1, max_size=5).filter(lambda k: k != "__verbose"),
                          st.one_of(st.integers(), st.text(max_size=20), st.lists(st.integers(), max_size=3)),
                          max_size=5)


@settings(max_examples=200, deadline=None)
@given(before=members, after=members, inner=st.text(max_size=40))
def test_any_object_with_the_member_anywhere(before, after, inner):
    after = {k: v for k, v in after.items() if k not in before}
    with_member = {**before, "__verbose": {"prompt": inner, "id_slot": 2}, **after}
    assert strip(dumps(with_member)) == dumps({**before, **after})


def stream(events):
    return b"".join(b"data: " + dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


CHAT_STREAM = [
    {"choices": [{"delta": {"content": "Hel"}}], "id": "c"},
    {"choices": [{"delta": {"content": "lo"}}], "id": "c"},
    {"choices": [{"delta": {}, "finish_reason": "stop"}], "id": "c", "timings": {"cache_n": 3}, "__verbose": VERBOSE},
]
COMPLETIONS_STREAM = [{"choices": [{"text": t}], "id": "c", "__verbose": {"id_slot": -1}, "timings": {"n": 1}}
                      for t in ("a", "b")]


def expected(events):
    return stream([{k: v for k, v in e.items() if k != "__verbose"} for e in events])


@settings(max_examples=300, deadline=None)
@given(which=st.sampled_from([CHAT_STREAM, COMPLETIONS_STREAM]), cuts=st.lists(st.integers(0, 2000), max_size=12))
def test_any_chunking_of_a_stream_gives_the_stripped_stream(which, cuts):
    raw = stream(which)
    bounds = sorted({c % (len(raw) + 1) for c in cuts})
    chunks = [raw[a:b] for a, b in zip([0, *bounds], [*bounds, len(raw)], strict=True) if b > a]
    s = VerboseStripper()
    out = b"".join(s.feed(c) for c in chunks) + s.feed(b"")
    assert out == expected(which)
    assert s.stripped == sum(1 for e in which if "__verbose" in e)


def test_a_stream_is_not_held_back():
    """Whole events go out at once; a split line holds at most the last len(KEY) bytes, and bytes before a key
    go out before the member is complete."""
    s = VerboseStripper()
    first = stream(CHAT_STREAM[:1])[:-len(b"data: [DONE]\n\n")]
    assert s.feed(first) == first and s.held == b""
    partial = b'data: {"choices":[],"id":"c","timings":{"cache_n":3}'
    out = s.feed(partial)
    assert out == partial[:-len(KEY)] and len(s.held) == len(KEY)
    out += s.feed(b',"__verbose":{"id_slot":1,"prompt":"long')
    assert out == partial                               # everything up to the member is out
    out += s.feed(b' text"}}\n\n')
    assert out == partial + b"}\n\n" and s.held == b""
