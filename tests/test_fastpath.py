"""The hot path without a parse: a known session's next request recognised from its bytes (pure)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as s

from slotlogic import fastpath
from slotlogic import session as sess
from slotlogic.fastpath import ShapeIndex, locate

CHAT = "/v1/chat/completions"
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("read", "bash")]


def body(first: str = "fix the upload test", extra: int = 0, system: str = "You are a coding agent. " * 40,
         tools_first: bool = False, **top: object) -> dict:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    for i in range(extra):
        msgs += [{"role": "assistant", "content": f"step {i}"}, {"role": "user", "content": f"output {i} " * 30}]
    out: dict = {"model": "m"}
    if tools_first:
        out["tools"] = TOOLS
    out["messages"] = msgs
    if not tools_first:
        out["tools"] = TOOLS
    out.update({"stream": True, **top})
    return out


def raw(b: dict, **dumps: object) -> bytes:
    return json.dumps(b, **dumps).encode()  # type: ignore[arg-type]


def learned(b: dict, path: str = CHAT, side: bool = False) -> tuple[ShapeIndex, sess.SessionId]:
    idx = ShapeIndex()
    key = sess.resolve({}, b, path)
    assert idx.learn(path, raw(b), key, side) is not None
    return idx, key


def test_the_next_turn_of_a_known_session_is_recognised():
    idx, key = learned(body())
    for extra in (0, 1, 5):
        shape = idx.match(CHAT, raw(body(extra=extra)))
        assert shape is not None and shape.key == key and shape.key == sess.resolve({}, body(extra=extra), CHAT)


def test_tools_before_the_messages_and_pretty_printed_json():
    idx, key = learned(body(tools_first=True))
    assert idx.match(CHAT, raw(body(extra=2, tools_first=True))).key == key  # type: ignore[union-attr]
    idx = ShapeIndex()
    pretty = json.dumps(body(), indent=2).encode()
    assert idx.learn(CHAT, pretty, sess.resolve({}, body(), CHAT), False) is not None
    assert idx.match(CHAT, json.dumps(body(extra=1), indent=2).encode()) is not None


def test_another_root_or_other_top_level_fields_are_not_recognised():
    idx, _ = learned(body())
    assert idx.match(CHAT, raw(body(first="another task", extra=1))) is None
    assert idx.match(CHAT, raw(body(system="You are a reviewer. " * 40, extra=1))) is None
    assert idx.match(CHAT, raw(body(extra=1, temperature=0.2))) is None  # the tail differs
    assert idx.match(CHAT, raw({**body(extra=1), "tools": TOOLS[:1]})) is None
    assert idx.match("/chat/completions", raw(body(extra=1))) is None  # another path: its own shape


def test_only_whole_new_messages_are_taken():
    idx, _ = learned(body())
    b = body(extra=1)
    b["messages"].append({"role": "user", "content": [{"type": "text", "text": "x", "id_slot": 2}]})
    assert idx.match(CHAT, raw(b)) is not None  # inside a message a key is the message's, not the body's
    b["messages"].append({"role": "user", "content": "quoting \"id_slot\" in text is fine"})
    assert idx.match(CHAT, raw(b)) is not None
    idx, _ = learned(body())
    tail = b', "tools"'
    for smuggled in (b'], "cache_prompt": false, "x": [1], "tools"',  # a top-level key between messages and tail
                     b', {"role": "user"}], "tools": [], "stream": true, "x": [', b', {"role": "user", ], "tools"',
                     b', {"role": "user", "content": "x"} {"a": 1}], "tools"', b', "text"], "tools"'):
        assert idx.match(CHAT, raw(body(extra=1)).replace(b"]" + tail, smuggled, 1)) is None, smuggled
    escaped = raw(body(extra=1)).replace(b'"step 0"', b'"step 0", "id\\u005fslot": 3')
    assert idx.match(CHAT, escaped) is None  # any escape in the new bytes: the full parse decides


def test_edited_history_is_not_taken():
    idx, _ = learned(body(extra=2))
    assert idx.match(CHAT, raw(body(extra=3))) is not None
    edited = body(extra=3)
    edited["messages"][2]["content"] = "step 0, rewritten"
    assert idx.match(CHAT, raw(edited)) is None
    assert idx.match(CHAT, raw(body(extra=1))) is None  # shorter than last time: not a continuation


def test_multibyte_text_before_the_first_user_message():
    b = body(system="Tu es un agent. Évite les régressions ✓. " * 20, first="corrige l'écran ✓")
    idx, _ = learned(b)
    assert idx.match(CHAT, raw({**b, "messages": [*b["messages"], {"role": "assistant", "content": "ok"}]})) is not None
    assert idx.match(CHAT, raw(b, ensure_ascii=False)) is None  # other bytes for the same text: no match


def test_only_content_root_sessions_on_chat_routes_are_learned():
    b = body()
    idx = ShapeIndex()
    assert idx.learn(CHAT, raw(b), sess.SessionId("k" * 16, "header:x-session-id"), False) is None
    assert idx.learn("/v1/responses", raw(b), sess.resolve({}, b, CHAT), False) is None
    assert idx.learn(CHAT, b"\xff\xfe", sess.resolve({}, b, CHAT), False) is None
    assert len(idx) == 0


def test_side_flag_is_kept():
    idx, _ = learned(body(), side=True)
    assert idx.match(CHAT, raw(body(extra=1))).side is True  # type: ignore[union-attr]


def test_locate_refuses_what_it_cannot_be_sure_of():
    assert locate('{"messages":[{"role":"user","content":"a"}],"messages":[]}') is None  # repeated key
    assert locate('{"messages":[{"role":"assistant","content":"a"}]}') is None  # no user message
    assert locate('{"messages":[{"role":"user"}]} trailing') is None
    assert locate('{"messages":{"role":"user"}}') is None
    assert locate("[]") is None and locate("") is None and locate('{"a":') is None
    text = '{"messages":[{"role":"user"}]}'
    assert locate(text) == (text.index("]"), text.index("]"))  # after the user message, the closing bracket


def test_bounded_and_stops_learning_bodies_that_never_repeat():
    idx = ShapeIndex(limit=2)
    for i in range(3):
        b = body(first=f"task {i}")
        idx.learn(CHAT, raw(b), sess.resolve({}, b, CHAT), False)
    assert len(idx) == 2 and idx.match(CHAT, raw(body(first="task 0"))) is None
    assert idx.match(CHAT, raw(body(first="task 2"))) is not None
    b = body(first="churn")
    key = sess.resolve({}, b, CHAT)
    results = [idx.learn(CHAT, raw(b), key, False) for _ in range(fastpath.MAX_TRIES + 1)]
    assert results[-1] is None and all(r is not None for r in results[:-1])
    assert idx.match(CHAT, raw(b)) is not None  # a match resets the count
    assert idx.learn(CHAT, raw(b), key, False) is not None


def test_heads_tails_and_keys_count_against_the_byte_cap():
    """60 sessions with big system prompts (issue 20: 8 MB each grew the proxy by 700 MB): what the index keeps,
    heads and tails included, stays under its cap; the newest sessions are the ones kept."""
    cap = 1 << 20
    idx = ShapeIndex(max_bytes=cap)
    for i in range(60):
        b = body(first=f"task {i}", system=f"agent {i} " + "x" * 100_000)
        idx.learn(CHAT, raw(b), sess.resolve({}, b, CHAT), False)
        kept = sum(len(sh.head) + len(sh.tail) + len(sh.middle) + len(sh.key.key) for sh in idx.shapes.values())
        assert idx.bytes <= cap and kept <= idx.bytes
    assert 1 < len(idx) < 11
    newest = body(first="task 59", system="agent 59 " + "x" * 100_000, extra=1)
    assert idx.match(CHAT, raw(newest)) is not None and idx.bytes <= cap


def test_a_body_bigger_than_the_whole_cap_is_not_learned():
    idx = ShapeIndex(max_bytes=64 << 10)
    small = body(first="small")
    idx.learn(CHAT, raw(small), sess.resolve({}, small, CHAT), False)
    big = body(first="big", system="y" * (64 << 10))
    assert idx.learn(CHAT, raw(big), sess.resolve({}, big, CHAT), False) is None
    assert len(idx) == 1 and idx.match(CHAT, raw(body(first="small", extra=1))) is not None


texts = s.text(alphabet=s.characters(blacklist_categories=("Cs",)), min_size=0, max_size=40)


@settings(max_examples=150, deadline=None)
@given(system=texts, first=texts, later=s.lists(texts, max_size=4), tools_first=s.booleans(),
       other_first=texts, indent=s.sampled_from([None, 1]), ascii_=s.booleans())
def test_a_match_always_names_the_session_the_full_parse_would(system, first, later, tools_first, other_first,
                                                               indent, ascii_):
    dump = {"indent": indent, "ensure_ascii": ascii_}
    b1 = body(first=first, system=system or "s", tools_first=tools_first)
    idx = ShapeIndex()
    idx.learn(CHAT, raw(b1, **dump), sess.resolve({}, b1, CHAT), False)  # None when the head is too short
    b2 = json.loads(json.dumps(b1))
    added = [{"role": "assistant", "content": t} for t in later]
    b2["messages"] += added
    b3 = body(first=other_first, system=system or "s", tools_first=tools_first)
    for b in (b2, b3):
        shape = idx.match(CHAT, raw(b, **dump))
        if shape is not None:
            assert shape.key == sess.resolve({}, b, CHAT)
            assert "id_slot" not in b and "cache_prompt" not in b
    if len(idx) and b"\\u" not in json.dumps(added, **dump).encode():  # type: ignore[arg-type]
        assert idx.match(CHAT, raw(b2, **dump)) is not None  # appending messages never loses the session


FRAGMENTS = [b",", b" ", b"{", b"}", b"[", b"]", b":", b"3", b"null", b'"a"', b'"id_slot"', b'"cache_prompt"',
             b'"tools"', b"\\u005f", b'"role"', b'"user"', b'{"role": "user", "content": "x"}', b"\xff"]


@settings(max_examples=400, deadline=None)
@given(junk=s.lists(s.sampled_from(FRAGMENTS), max_size=12).map(b"".join), where=s.sampled_from(["end", "mid"]))
def test_arbitrary_bytes_between_a_known_head_and_tail_are_taken_only_when_the_full_parse_agrees(junk, where):
    """Fast path ≡ full parse: whatever sits between a known session's head and tail, a match means the body
    is valid JSON with the learned top-level fields (no client id_slot/cache_prompt) and the same session."""
    idx, key = learned(body())
    good = raw(body(extra=1))
    cut = good.index(b'], "tools"') if where == "end" else good.index(b', {"role": "assistant"')
    candidate = good[:cut] + junk + good[cut:]
    shape = idx.match(CHAT, candidate)
    if shape is not None:
        parsed = json.loads(candidate)
        assert list(parsed) == list(body()) and sess.resolve({}, parsed, CHAT) == key
