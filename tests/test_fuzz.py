"""Bad input, fuzzed: the rewriter, the fast path (≡ the full parse), the session resolver and the SSE parser on
arbitrary input never raise, never lose a byte that is not theirs, and never disagree with each other.

`make test` runs a few dozen examples each; `make reliability` sets SLOTKEEPER_FUZZ_EXAMPLES to run thousands.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as s

from slotlogic import session as sess
from slotlogic.answers import SSEParser, StreamObserver
from slotlogic.decisions import Forward, NeedSlot, Observe, Pin, RequestFacts
from slotlogic.keeper import Keeper
from slotlogic.server import ServerInfo
from slotlogic.settings import Settings
from slotlogic.shared import ServerState

EXAMPLES = int(os.environ.get("SLOTKEEPER_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
CHAT = "/v1/chat/completions"

scalars = (s.none() | s.booleans() | s.integers() | s.floats(allow_nan=False, allow_infinity=False)
           | s.text(max_size=20))
values = s.recursive(scalars, lambda c: s.lists(c, max_size=4) | s.dictionaries(s.text(max_size=8), c, max_size=4),
                     max_leaves=15)
# Raw JSON tokens that json.dumps never produces but clients may send.
ODD_TOKENS = [b"1e400", b"-1e400", b"1" * 500, b'"\\ud800"', b'"\\udc00x"', b'"id\\u005fslot"', b'"cache\\u005fprompt"',
              b'"\\"id_slot\\""', b"[" * 50 + b"]" * 50, b'"\xc3\x28"', b"0.0000000000000000000001", b'"\\u0000"']


def keeper() -> Keeper:
    k = Keeper(Settings(), "http://u:1")
    k.facts.note_server(ServerState("http://u:1"), ServerInfo(total_slots=4, media_marker="m", raw={"total_slots": 4}))
    return k


def facts(raw: bytes, headers: tuple[tuple[bytes, bytes], ...] = ()) -> RequestFacts:
    return RequestFacts("POST", CHAT, headers, raw, 100.0)


def place(k: Keeper, decision: Any) -> Pin | Observe | Forward:
    """A NeedSlot resolved as the driver would (slot 0, no I/O), so every route ends in bytes."""
    if isinstance(decision, NeedSlot):
        info = ServerInfo(total_slots=4, media_marker="m", raw={"total_slots": 4})
        return k.pin(k.assign(decision, ServerState("http://u:1"), info, None, 100.0), 100.0)
    return decision


def outgoing(raw: bytes, decision: Pin | Observe | Forward) -> bytes:
    return decision.body if isinstance(decision, Pin | Observe) and decision.body is not None else raw


def strip_ours(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k not in ("id_slot", "cache_prompt")}


@FUZZ
@given(doc=s.dictionaries(s.text(max_size=10), values, max_size=6), odd=s.lists(s.sampled_from(ODD_TOKENS), max_size=3),
       dup=s.booleans())
def test_the_rewrite_changes_two_fields_and_nothing_else(doc, odd, dup):
    """Whatever object a client sends (odd numbers, lone surrogates, escaped or repeated keys), what goes out is
    either its own bytes or the same document with id_slot/cache_prompt set."""
    raw = json.dumps(doc).encode()
    extra = b"".join(b',"odd%d":%s' % (i, t) for i, t in enumerate(odd))
    if dup:
        extra += b',"id_slot":"x","id\\u005fslot":9'
    raw = raw[:-1] + (extra if raw != b"{}" else extra.lstrip(b",")) + b"}"
    k = keeper()
    out = outgoing(raw, place(k, k.request(facts(raw))))
    try:
        sent = json.loads(raw)
    except ValueError:
        assert out == raw  # not JSON (e.g. invalid UTF-8): untouched
        return
    got = json.loads(out)
    assert strip_ours(got) == strip_ours(sent)
    if out != raw:
        assert isinstance(got.get("id_slot"), int) and 0 <= got["id_slot"] < 4
        assert out.count(b"1e400") == raw.count(b"1e400")  # never re-serialised


def body(first: str, later: list[str], system: str) -> dict[str, Any]:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    msgs += [{"role": "assistant" if i % 2 == 0 else "user", "content": t} for i, t in enumerate(later)]
    return {"model": "m", "messages": msgs, "stream": True, "tools": [{"type": "function",
                                                                       "function": {"name": "read"}}]}


JUNK = [b",", b" ", b"{", b"}", b"[", b"]", b":", b"1e400", b"null", b'"id_slot"', b'"cache_prompt"', b"\\u005f",
        b'"role"', b'"user"', b'{"role": "user", "content": "x"}', b'{"role": "tool", "content": 1}', b"\xff",
        b'"tools": []', b'"id_slot": 1', b'{"id_slot": 2}', b"\n", b'"\\ud800"',
        b', {"role": "user", "content": "more"}', b', {"role": "assistant", "content": "ok", "id_slot": 1}']


@FUZZ
@given(first=s.text(max_size=30), later=s.lists(s.text(max_size=30), max_size=3),
       system=s.text(min_size=40, max_size=80),
       junk=s.just(b"") | s.lists(s.sampled_from(JUNK), max_size=10).map(b"".join),
       where=s.sampled_from(["end", "mid", "tail"]))
def test_the_fast_path_agrees_with_the_full_parse(first, later, system, junk, where):
    """Bodies built around a real one (a known session's next turn with arbitrary bytes spliced in): the
    keeper that knows the session (fast path) sends exactly what a keeper parsing every body sends."""
    b1 = body(first, [], system)
    fast, slow = keeper(), keeper()
    for k in (fast, slow):
        place(k, k.request(facts(json.dumps(b1).encode())))
    good = json.dumps(body(first, later, system)).encode()
    cut = {"end": good.rindex(b"]"), "mid": good.index(b"}, {") + 1 if b"}, {" in good else len(good) - 1,
           "tail": len(good) - 1}[where]
    candidate = good[:cut] + junk + good[cut:]
    slow.recognition.shapes.shapes.clear()
    slow.recognition.shapes.by_sig.clear()
    slow.recognition.shapes.ends.clear()
    event("fast path taken" if fast.recognition.shapes.match(CHAT, candidate) is not None else "full parse")
    d_fast, d_slow = fast.request(facts(candidate)), slow.request(facts(candidate))
    out_fast, out_slow = outgoing(candidate, place(fast, d_fast)), outgoing(candidate, place(slow, d_slow))
    if isinstance(d_fast, Pin) and d_fast.ticket.session.source == "content:root" and isinstance(d_slow, Pin):
        assert d_fast.ticket.session.key == d_slow.ticket.session.key
    assert out_fast == out_slow


header_names = s.sampled_from([b"x-session-id", b"session_id", b"x-claude-code-session-id", b"authorization", b"x"])


@FUZZ
@given(doc=s.dictionaries(s.sampled_from(["messages", "prompt", "metadata", "user", "prompt_cache_key", "input",
                                          "instructions", "tools", "input_prefix"]), values, max_size=5),
       hdrs=s.lists(s.tuples(header_names, s.binary(max_size=12)), max_size=3),
       path=s.sampled_from([CHAT, "/completion", "/v1/responses", "/infill", "/v1/completions"]))
def test_the_session_resolver_always_answers_with_a_digest(doc, hdrs, path):
    key = sess.resolve({k.decode(): v.decode("latin-1") for k, v in hdrs}, doc, path)
    assert re.fullmatch(r"[0-9a-f]{16}", key.key)
    k = keeper()
    decision = k.request(RequestFacts("POST", path, tuple(hdrs), json.dumps(doc).encode(), 1.0))
    assert isinstance(decision, Forward | Observe | Pin | NeedSlot)


events = s.lists(s.dictionaries(s.sampled_from(["timings", "usage", "id_slot", "error", "choices", "x"]), values,
                                max_size=3), max_size=5)


@FUZZ
@given(evs=events, noise=s.lists(s.binary(max_size=30), max_size=4), cuts=s.lists(s.integers(0, 4000), max_size=8),
       crlf=s.booleans())
def test_the_sse_parser_never_raises_and_ignores_how_the_stream_is_cut(evs, noise, cuts, crlf):
    nl = b"\r\n" if crlf else b"\n"
    stream = b"".join(b"data: " + json.dumps(e).encode() + nl + nl for e in evs) + b"".join(noise)
    stream += b"data: [DONE]" + nl
    whole = StreamObserver()
    whole.feed(stream)
    whole.feed(b"")
    split = StreamObserver()
    prev = 0
    for c in sorted(set(min(c, len(stream)) for c in cuts)):
        split.feed(stream[prev:c])
        prev = c
    split.feed(stream[prev:])
    split.feed(b"")
    assert (whole.obs.cache_n, whole.obs.prompt_n, whole.obs.id_slot, whole.obs.error_type) == (
        split.obs.cache_n, split.obs.prompt_n, split.obs.id_slot, split.obs.error_type)
    list(SSEParser().feed(bytes(noise[0]) if noise else b""))
