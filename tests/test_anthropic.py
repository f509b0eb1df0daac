"""slotlogic.anthropic without a server: request conversion as llama-server's converter does it, answers and
streams converted back, and properties over generated requests, answers and transport chunkings."""

from __future__ import annotations

import itertools
import json
import math
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slotlogic import anthropic as A
from slotlogic import anthropic_answer as R

# --------------------------------------------------------------------------------------------------------
# to_chat: the converter's rules, one by one (server-chat.cpp, server_chat_convert_anthropic_to_oai)
# --------------------------------------------------------------------------------------------------------


def test_minimal_request_gets_default_max_tokens_and_no_model() -> None:
    chat = A.to_chat({"model": "claude-x", "messages": [{"role": "user", "content": "hi"}]})
    assert chat == {"messages": [{"role": "user", "content": "hi"}], "max_tokens": A.DEFAULT_MAX_TOKENS}


def test_missing_messages_is_untranslatable() -> None:
    with pytest.raises(A.TranslationError):
        A.to_chat({"max_tokens": 5})
    with pytest.raises(A.TranslationError):
        A.to_chat([])  # type: ignore[arg-type]


def test_system_blocks_join_without_separator_and_skip_non_text() -> None:
    chat = A.to_chat({"system": [{"type": "text", "text": "A"}, {"type": "image"}, {"type": "text", "text": "B",
                                 "cache_control": {"type": "ephemeral"}}], "messages": []})
    assert chat["messages"] == [{"role": "system", "content": "AB"}]
    assert A.to_chat({"system": 5, "messages": []})["messages"] == [{"role": "system", "content": ""}]
    assert A.to_chat({"system": None, "messages": []})["messages"] == []


def test_billing_header_cch_is_normalised_like_the_server() -> None:
    line = "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;"
    assert A.normalize_billing_header(line) == line.replace("a5145", "fffff")
    assert A.normalize_billing_header(line + "You are Claude.") == line.replace("a5145", "fffff") + "You are Claude."
    assert A.normalize_billing_header("x-anthropic-billing-header: cch=a51;") == "x-anthropic-billing-header: cch=a51;"
    assert A.normalize_billing_header("x-anthropic-billing-header: cch=a5145") == \
        "x-anthropic-billing-header: cch=a5145"  # no ';' after the 5 chars (nor room for one): untouched
    assert A.normalize_billing_header("prefix x-anthropic-billing-header: cch=a5145;") == \
        "prefix x-anthropic-billing-header: cch=a5145;"
    a = A.to_chat({"system": [{"type": "text", "text": line.replace("a5145", "00000")}], "messages": []})
    b = A.to_chat({"system": line.replace("a5145", "12345"), "messages": []})
    assert a == b
    with pytest.raises(A.TranslationError):
        A.normalize_billing_header("x-anthropic-billing-header: cch=ä5145;")


def test_content_blocks_become_chat_messages_in_server_order() -> None:
    chat = A.to_chat({"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Need ", "signature": "s"},
            {"type": "redacted_thinking", "data": "x"},
            {"type": "thinking", "thinking": "a tool."},
            {"type": "text", "text": "Checking.", "cache_control": {"type": "ephemeral"}},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "n": 2}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny"},
                                                                          {"type": "text", "text": " 20C"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True, "content": "boom"},
            {"type": "tool_result", "tool_use_id": "toolu_3"},
            {"type": "text", "text": "Thanks."},
        ]},
    ]})
    assert chat["messages"] == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant",
         "content": [{"type": "text", "text": "Checking.", "cache_control": {"type": "ephemeral"}}],
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city":"Paris","n":2}'}}],
         "reasoning_content": "Need a tool."},
        {"role": "user", "content": [{"type": "text", "text": "Thanks."}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny 20C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "boom"},
        {"role": "tool", "tool_call_id": "toolu_3", "content": ""},
    ]


def test_tool_only_assistant_message_gets_empty_string_content() -> None:
    chat = A.to_chat({"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f"}]}]})
    assert chat["messages"] == [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]


def test_messages_the_server_drops_or_passes() -> None:
    chat = A.to_chat({"messages": [
        {"role": "assistant"},                                   # no content, assistant: dropped
        {"role": "user"},                                        # no content, not assistant: as is
        {"role": "user", "content": [{"type": "document"}]},     # nothing convertible: dropped
        {"role": "system", "content": "Second system."},         # string content: as is
        {"role": "user", "content": 7},                          # not a list: as is
    ]})
    assert chat["messages"] == [{"role": "user"}, {"role": "system", "content": "Second system."},
                                {"role": "user", "content": 7}]
    assert A.to_chat({"messages": "nope"})["messages"] == []


def test_images_become_data_uris() -> None:
    chat = A.to_chat({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAA"}},
        {"type": "image", "source": {"type": "base64", "data": "BBB"}},
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}},
        {"type": "image", "source": {"type": "file", "file_id": "f"}},
    ]}, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "text", "text": "see"}, {"type": "image", "source": {"type": "base64", "data": "CCC"}}]}]}]})
    urls = [p["image_url"]["url"] for p in chat["messages"][0]["content"]]
    assert urls == ["data:image/png;base64,AAA", "data:image/jpeg;base64,BBB", "http://x/y.png"]
    assert chat["messages"][1] == {"role": "tool", "tool_call_id": "t", "content": [
        {"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,CCC"}}]}


def test_tools_tool_choice_and_parameters() -> None:
    chat = A.to_chat({"messages": [], "tools": [
        {"name": "f", "description": "d", "input_schema": {"type": "object"}, "cache_control": {}},
        {"type": "web_search_20250305", "name": "web_search"}],
        "tool_choice": {"type": "tool", "name": "f"}, "stop_sequences": ["X"], "max_tokens": 7,
        "temperature": 0, "top_p": 0.5, "top_k": 3, "chat_template_kwargs": {"a": 1}, "seed": 5,
        "thinking": {"type": "enabled", "budget_tokens": 512}, "metadata": {"user_id": "u"}, "service_tier": "x"})
    assert chat == {
        "messages": [],
        "tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}},
                  {"type": "function", "function": {"name": "web_search", "description": "", "parameters": {}}}],
        "tool_choice": "required", "stop": ["X"], "max_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": 3,
        "chat_template_kwargs": {"a": 1}, "thinking_budget_tokens": 512, "__metadata_user_id": "u",
        "verbose": True,
    }
    assert list(chat) == ["messages", "tools", "tool_choice", "stop", "max_tokens", "temperature", "top_p",
                          "top_k", "chat_template_kwargs", "thinking_budget_tokens", "__metadata_user_id", "verbose"]
    for choice, expect in (({"type": "auto"}, "auto"), ({"type": "any"}, "required")):
        assert A.to_chat({"messages": [], "tool_choice": choice})["tool_choice"] == expect
    for choice in ({"type": "none"}, "auto", None):
        assert "tool_choice" not in A.to_chat({"messages": [], "tool_choice": choice})


def test_thinking_budget_follows_json_value_rules() -> None:
    def budget(thinking: Any) -> Any:
        return A.to_chat({"messages": [], "thinking": thinking}).get("thinking_budget_tokens")

    assert budget({"type": "enabled"}) == 10000
    assert budget({"type": "enabled", "budget_tokens": "x"}) == 10000
    assert budget({"type": "enabled", "budget_tokens": 12.9}) == 12
    assert budget({"type": "enabled", "budget_tokens": True}) == 1
    assert budget({"type": "adaptive"}) is None
    assert budget("enabled") is None
    with pytest.raises(A.TranslationError):
        budget({"type": "enabled", "budget_tokens": 2**40})


def test_stream_adds_what_the_translated_route_needs() -> None:
    chat = A.to_chat({"messages": [], "stream": True})
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert chat["timings_per_token"] is True and "verbose" not in chat
    assert A.to_chat({"messages": [], "stream": False}).get("stream") in (None, False)
    with pytest.raises(A.TranslationError):
        A.to_chat({"messages": [], "stream": "yes"})


def test_string_and_one_text_block_carry_the_same_text() -> None:
    """Claude Code turns the previous user message from a block list into a string each turn; the chat
    parser flattens a one-text-part content to its text, so both render alike (checked live in the real test)."""
    s = A.to_chat({"messages": [{"role": "user", "content": "same text"}]})["messages"][0]
    b = A.to_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "same text"}]}]})["messages"][0]
    assert s["content"] == "".join(p["text"] for p in b["content"])


def test_nl_dump_matches_nlohmann_number_format() -> None:
    assert A.nl_dump({"a": 1, "b": [True, None], "c": "é\u0001\"/"}) == '{"a":1,"b":[true,null],"c":"é\\u0001\\"/"}'
    cases = {1.5: "1.5", 1.0: "1.0", -0.0: "-0.0", 1e15: "1e+15", 1.5e15: "1.5e+15", 1e16: "1e+16",
             123456789012345.0: "123456789012345.0", 0.0001: "0.0001", 1e-5: "1e-05", 1e100: "1e+100",
             2.5e-10: "2.5e-10", 100.0: "100.0", 0.1: "0.1"}
    for value, text in cases.items():
        assert A.nl_dump(value) == text, value
    assert A.nl_dump(2**64) == "1.8446744073709552e+19"
    assert A.nl_dump(2**64 - 1) == str(2**64 - 1)
    with pytest.raises(A.TranslationError):
        A.nl_dump(math.nan)


def test_encode_rejects_what_the_server_parser_rejects() -> None:
    assert A.encode({"a": "é"}) == '{"a":"é"}'.encode()
    with pytest.raises(A.TranslationError):
        A.encode({"a": "\ud800"})
    with pytest.raises(A.TranslationError):
        A.encode({"a": math.inf})


# --------------------------------------------------------------------------------------------------------
# from_chat (server-task.cpp, server_task_result_cmpl_final::to_json_anthropic)
# --------------------------------------------------------------------------------------------------------

def _answer(message: dict[str, Any], finish: str, **extra: Any) -> dict[str, Any]:
    return {"choices": [{"finish_reason": finish, "index": 0, "message": message}], "created": 1, "model": "m",
            "object": "chat.completion", "id": "chatcmpl-1",
            "usage": {"completion_tokens": 5, "prompt_tokens": 32, "total_tokens": 37,
                      "prompt_tokens_details": {"cached_tokens": 31}}, **extra}


def test_from_chat_text_answer() -> None:
    msg = R.from_chat(_answer({"role": "assistant", "content": "Hi"}, "stop"))
    assert msg == {"id": "chatcmpl-1", "type": "message", "role": "assistant",
                   "content": [{"type": "text", "text": "Hi"}], "model": "m", "stop_reason": "end_turn",
                   "stop_sequence": None,
                   "usage": {"cache_read_input_tokens": 31, "input_tokens": 1, "output_tokens": 5}}
    assert R.from_chat(_answer({"content": "x"}, "length"), model="claude-x")["model"] == "claude-x"
    assert R.from_chat(_answer({"content": "x"}, "length"))["stop_reason"] == "max_tokens"


def test_from_chat_thinking_tools_and_stop_word() -> None:
    ans = _answer({"role": "assistant", "content": None, "reasoning_content": "hmm",
                   "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}, "id": "c1"},
                                  {"type": "function", "function": {"name": "g", "arguments": "{bad"}, "id": "c2"}]},
                  "tool_calls")
    msg = R.from_chat(ans)
    assert msg["content"] == [{"type": "thinking", "thinking": "hmm", "signature": ""},
                              {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}},
                              {"type": "tool_use", "id": "c2", "name": "g", "input": {}}]
    assert msg["stop_reason"] == "tool_use"
    word = R.from_chat(_answer({"content": "I'm glad "}, "stop", __verbose={"stopping_word": "you"}))
    assert word["stop_reason"] == "end_turn" and word["stop_sequence"] == "you"
    eos = R.from_chat(_answer({"content": "x"}, "stop", __verbose={"stopping_word": ""}))
    assert eos["stop_sequence"] is None


def test_tool_input_parse_is_strict_like_nlohmann() -> None:
    calls = [{"function": {"name": "f", "arguments": a}, "id": "c"} for a in ("NaN", '"\\ud800"', "[1]", "")]
    msg = R.from_chat(_answer({"tool_calls": calls}, "tool_calls"))
    assert [b["input"] for b in msg["content"]] == [{}, {}, [1], {}]


def test_error_body_is_what_the_native_route_sends() -> None:
    body = b'{"error":{"code":400,"message":"request (5031 tokens) exceeds","type":"exceed_context_size_error"}}'
    assert R.error_body(400, body) == body


# --------------------------------------------------------------------------------------------------------
# the chat route's SSE, built like server-task.cpp builds it, for the stream tests
# --------------------------------------------------------------------------------------------------------

Diff = dict[str, Any]  # a chat `delta` object


def _chunk(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choices = [] if delta is None else [{"finish_reason": finish, "index": 0, "delta": delta}]
    return {"choices": choices, "created": 1, "id": "chatcmpl-X", "model": "m", "system_fingerprint": "b0",
            "object": "chat.completion.chunk", **extra}


def chat_sse(partials: list[list[Diff]], final: list[Diff], finish: str, n_decoded: int,
             cache_n: int = 30, prompt_n: int = 2, stop_word: str = "", usage: bool = True) -> bytes:
    """The bytes `/v1/chat/completions` streams for these results with timings_per_token and include_usage."""
    timings = {"cache_n": cache_n, "prompt_n": prompt_n, "predicted_n": n_decoded}
    events: list[dict[str, Any]] = []
    for i, diffs in enumerate(partials):
        group = ([_chunk({"role": "assistant", "content": None})] if i == 0 else []) + [_chunk(d) for d in diffs]
        if group:
            group[-1]["timings"] = timings
        events += group
    group = [_chunk(d) for d in final] + [_chunk({}, finish)]
    if stop_word or finish != "length":
        group[0]["__verbose"] = {"stop_type": "word" if stop_word else "eos", "stopping_word": stop_word}
    if usage:
        group.append(_chunk(None, usage={"completion_tokens": n_decoded, "prompt_tokens": cache_n + prompt_n,
                                         "total_tokens": 1, "prompt_tokens_details": {"cached_tokens": cache_n}}))
    group[-1]["timings"] = timings
    events += group
    lines = [b"data: " + json.dumps(e, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n" for e in events]
    return b"".join(lines) + b"data: [DONE]\n\n"


def parse_sse(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.split(b"\n\n"):
        if not block:
            continue
        ev, data = block.split(b"\n")
        assert ev.startswith(b"event: ") and data.startswith(b"data: ")
        payload = json.loads(data[6:])
        assert payload.get("type", "error") == ev[7:].decode() or ev == b"event: error"
        out.append((ev[7:].decode(), payload))
    return out


def assemble(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """What an Anthropic client builds from the events."""
    msg: dict[str, Any] = {}
    blocks: dict[int, dict[str, Any]] = {}
    for name, data in events:
        if name == "message_start":
            msg = dict(data["message"])
        elif name == "content_block_start":
            blocks[data["index"]] = dict(data["content_block"])
        elif name == "content_block_delta":
            b, d = blocks[data["index"]], data["delta"]
            if d["type"] == "text_delta":
                b["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            elif d["type"] == "signature_delta":
                b["signature"] = d["signature"]
            elif d["type"] == "input_json_delta":
                b["_json"] = b.get("_json", "") + d["partial_json"]
        elif name == "message_delta":
            msg.update(data["delta"])
            msg["usage"] = {**msg["usage"], **data["usage"]}
    for b in blocks.values():
        if b["type"] == "tool_use":
            b["input"] = R._parse_input(b.pop("_json", ""))
    msg["content"] = [blocks[i] for i in sorted(blocks)]
    return msg


def convert(raw: bytes, cuts: list[int]) -> bytes:
    conv = R.StreamConverter()
    out, prev = [], 0
    for c in [*sorted(set(cuts)), len(raw)]:
        out.append(conv.feed(raw[prev:c]))
        prev = c
    return b"".join(out) + conv.close()


SAMPLE = chat_sse(
    partials=[[{"content": "I"}], [{"content": "'m"}], [], [{"content": " glad"}, {"content": " é"}]],
    final=[], finish="length", n_decoded=5)

EXPECTED = (
    'event: message_start\ndata: {"type":"message_start","message":{"id":"chatcmpl-X","type":"message",'
    '"role":"assistant","content":[],"model":"m","stop_reason":null,"stop_sequence":null,"usage":'
    '{"cache_read_input_tokens":30,"input_tokens":2,"output_tokens":0}}}\n\n'
    'event: content_block_start\ndata: {"type":"content_block_start","index":0,"content_block":{"type":"text",'
    '"text":""}}\n\n'
    'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
    '"text":"I"}}\n\n'
    'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
    '"text":"\'m"}}\n\n'
    'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
    '"text":" glad"}}\n\n'
    'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
    '"text":" é"}}\n\n'
    'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"max_tokens","stop_sequence":null},'
    '"usage":{"output_tokens":5}}\n\n'
    'event: message_stop\ndata: {"type":"message_stop"}\n\n').encode()


def test_stream_text_bytes_as_the_native_route_sends_them() -> None:
    assert convert(SAMPLE, []) == EXPECTED


def test_stream_every_split_point_and_byte_by_byte_give_the_same_bytes() -> None:
    for i in range(len(SAMPLE) + 1):
        assert convert(SAMPLE, [i]) == EXPECTED, i
    assert convert(SAMPLE, list(range(len(SAMPLE)))) == EXPECTED


def test_first_text_delta_leaves_with_the_first_token_chunk() -> None:
    conv = R.StreamConverter()
    first_result_end = SAMPLE.index(b"\n\n", SAMPLE.index(b'"content":"I"')) + 2
    out = conv.feed(SAMPLE[:first_result_end])
    assert b'"text":"I"' in out and b"message_start" in out
    assert conv.prompt == R.PromptCounts(cache_n=30, prompt_n=2) and conv.cache_n == 30 and conv.prompt_n == 2


def test_stream_tool_calls_stop_word_and_usage_without_include_usage() -> None:
    raw = chat_sse(partials=[[{"content": "ok"}], [{"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                                                    "function": {"name": "f"}}]}],
                             [{"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}],
                             [{"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}]],
                   final=[], finish="tool_calls", n_decoded=9, usage=False)
    events = parse_sse(convert(raw, []))
    assert [(n, d.get("index")) for n, d in events] == [
        ("message_start", None), ("content_block_start", 0), ("content_block_delta", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_delta", 1),
        ("content_block_stop", 0), ("content_block_stop", 1), ("message_delta", None), ("message_stop", None)]
    msg = assemble(events)
    assert msg["content"][1] == {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}}
    assert msg["stop_reason"] == "tool_use" and msg["usage"]["output_tokens"] == 9
    word = parse_sse(convert(chat_sse([[{"content": "a"}]], [], "stop", 2, stop_word="you"), []))
    assert word[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": "you"}


def test_final_result_is_formatted_with_fresh_block_state_like_the_server() -> None:
    """to_json_anthropic_stream() starts its block bookkeeping afresh: text still arriving with the final
    result re-opens the text block (a quirk of the native route, mirrored on purpose)."""
    raw = chat_sse(partials=[[{"content": "a"}]], final=[{"content": "b"}], finish="stop", n_decoded=2)
    names = [(n, d.get("index")) for n, d in parse_sse(convert(raw, []))]
    assert names == [("message_start", None), ("content_block_start", 0), ("content_block_delta", 0),
                     ("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
                     ("message_delta", None), ("message_stop", None)]


@pytest.mark.parametrize("err", ["boom", 7, None, ["a"]])
def test_a_bare_error_value_becomes_anthropics_error_event(err: Any) -> None:
    raw = SAMPLE.split(b"data: {\"choices\":[{\"finish_reason\":\"length\"")[0]
    raw += b"data: " + json.dumps({"error": err}).encode() + b"\n\n"
    name, data = parse_sse(convert(raw, []))[-1]
    assert name == "error" and data["type"] == "error" and data["error"]["type"] == "api_error"
    assert isinstance(data["error"]["message"], str)


def test_stream_error_event_and_done() -> None:
    err = {"code": 500, "message": "boom", "type": "server_error"}
    raw = SAMPLE.split(b"data: {\"choices\":[{\"finish_reason\":\"length\"")[0]
    raw += b"data: " + json.dumps({"error": err}).encode() + b"\n\n"
    events = parse_sse(convert(raw, []))
    assert events[-1] == ("error", err) and all(n != "message_stop" for n, _ in events)


# --------------------------------------------------------------------------------------------------------
# properties
# --------------------------------------------------------------------------------------------------------

text = st.text(max_size=12)
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                      st.floats(allow_nan=False, allow_infinity=False), text)
json_value = st.recursive(json_leaf, lambda c: st.one_of(st.lists(c, max_size=3),
                                                          st.dictionaries(text, c, max_size=3)), max_leaves=8)
source = st.fixed_dictionaries({"type": st.sampled_from(["base64", "url", "file"])},
                               optional={"media_type": text, "data": text, "url": text})
block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text},
                          optional={"cache_control": st.just({"type": "ephemeral"})}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": text, "signature": text}),
    st.fixed_dictionaries({"type": st.just("redacted_thinking"), "data": text}),
    st.fixed_dictionaries({"type": st.just("image"), "source": source}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": text, "name": text}, optional={"input": json_value}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": text},
                          optional={"is_error": st.booleans(), "content": st.one_of(
                              text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                                             max_size=3), json_value)}),
    json_value,
)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"])},
                                optional={"content": st.one_of(text, st.lists(block, max_size=4), json_value)})
request = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(message, max_size=5), json_value)},
    optional={
        "system": st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "x"]),
                                                                  "text": text}), max_size=3), json_value),
        "tools": st.lists(st.fixed_dictionaries({"name": text}, optional={"description": text,
                                                                          "input_schema": json_value}), max_size=3),
        "tool_choice": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none"])}),
                                 json_value),
        "stop_sequences": st.lists(text, max_size=2), "max_tokens": st.integers(-1, 10**6),
        "temperature": st.floats(0, 2), "stream": st.booleans(), "metadata": json_value,
        "thinking": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "adaptive"])},
                                                    optional={"budget_tokens": st.integers(0, 10**6)}), json_value),
        "model": text, "service_tier": text,
    })


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request)
def test_generated_requests_convert_to_valid_chat_bodies(body: dict[str, Any]) -> None:
    try:
        chat = A.to_chat(body)
        raw = A.encode(chat)
    except A.TranslationError:
        return  # only for what the server would reject or this module cannot reproduce exactly
    back = json.loads(raw)
    assert isinstance(back["messages"], list) and "model" not in back
    assert back["max_tokens"] == body.get("max_tokens", A.DEFAULT_MAX_TOKENS)
    assert back.get("stream") == body.get("stream")
    assert ("stream_options" in back) == bool(body.get("stream"))
    for m in back["messages"]:
        if isinstance(m, dict) and m.get("role") == "tool":
            assert isinstance(m["tool_call_id"], str) and isinstance(m["content"], (str, list))
        for call in (m.get("tool_calls") or []) if isinstance(m, dict) else []:
            json.loads(call["function"]["arguments"])  # always valid JSON text
    n_tools = len(body["tools"]) if isinstance(body.get("tools"), list) else 0
    assert len(back.get("tools", [])) == n_tools


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(text, text), max_size=4), text)
def test_string_and_single_block_are_interchangeable(turns: list[tuple[str, str]], last: str) -> None:
    msgs: list[dict[str, Any]] = []
    for u, a in turns:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    as_str = A.to_chat({"messages": [*msgs, {"role": "user", "content": last}]})
    as_block = A.to_chat({"messages": [*msgs, {"role": "user", "content": [{"type": "text", "text": last}]}]})
    assert as_str["messages"][:-1] == as_block["messages"][:-1]
    assert as_block["messages"][-1]["content"] == [{"type": "text", "text": last}]


def _pieces(s: str, cuts: list[int]) -> list[str]:
    idx = sorted({c % (len(s) + 1) for c in cuts} | {0, len(s)})
    return [s[a:b] for a, b in itertools.pairwise(idx) if s[a:b]]


@st.composite
def generated_answer(draw: st.DrawFn) -> tuple[dict[str, Any], bytes]:
    """A message, its non-streamed chat answer, and the chat SSE that streams the same message."""
    reasoning, content = draw(text), draw(text)
    calls = draw(st.lists(st.tuples(st.sampled_from(["f", "g"]),
                                    st.dictionaries(st.sampled_from("abc"), json_leaf, max_size=2)), max_size=2))
    finish = "tool_calls" if calls and draw(st.booleans()) else draw(st.sampled_from(["stop", "length"]))
    cuts = draw(st.lists(st.integers(0, 40), max_size=4))
    diffs: list[Diff] = [{"reasoning_content": p} for p in _pieces(reasoning, cuts)]
    diffs += [{"content": p} for p in _pieces(content, cuts)]
    tool_calls = []
    for i, (name, args) in enumerate(calls):
        arguments = json.dumps(args, separators=(",", ":"))
        tool_calls.append({"type": "function", "function": {"name": name, "arguments": arguments}, "id": f"id{i}"})
        diffs.append({"tool_calls": [{"index": i, "id": f"id{i}", "type": "function", "function": {"name": name}}]})
        diffs += [{"tool_calls": [{"index": i, "function": {"arguments": p}}]} for p in _pieces(arguments, cuts)]
    per_result = draw(st.integers(1, 3))
    partials = [diffs[i:i + per_result] for i in range(0, len(diffs), per_result)] or [[]]
    n = len(diffs) + 1
    stop_word = draw(st.sampled_from(["", "STOP"])) if finish == "stop" else ""
    message = {"role": "assistant", "content": content or None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    answer = _answer(message, finish if not tool_calls or finish == "length" else "tool_calls",
                     __verbose={"stopping_word": stop_word})
    answer["usage"] = {"completion_tokens": n, "prompt_tokens": 32, "prompt_tokens_details": {"cached_tokens": 30}}
    answer["id"] = "chatcmpl-X"
    raw = chat_sse(partials, [], answer["choices"][0]["finish_reason"], n, stop_word=stop_word)
    return answer, raw


@settings(max_examples=200, deadline=None)
@given(generated_answer(), st.lists(st.integers(0, 4000), max_size=8))
def test_stream_matches_non_stream_whatever_the_chunking(case: tuple[dict[str, Any], bytes], cuts: list[int]) -> None:
    answer, raw = case
    whole = convert(raw, [])
    assert convert(raw, [c % (len(raw) + 1) for c in cuts]) == whole
    msg = R.from_chat(answer)
    assert msg["type"] == "message" and msg["role"] == "assistant"
    assert all(b["type"] in ("thinking", "text", "tool_use") for b in msg["content"])
    streamed = assemble(parse_sse(whole))
    for key in ("id", "model", "content", "stop_reason", "stop_sequence", "usage"):
        assert streamed[key] == msg[key], key


def test_the_billing_block_can_be_dropped():
    blocks = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.e51; cch=00000;"},
              {"type": "text", "text": "You are Claude Code."}]
    assert A.strip_billing({"system": blocks}) == {"system": blocks[1:]}
    assert A.strip_billing({"system": "x-anthropic-billing-header: v=1;\nYou are Claude Code."}) == {
        "system": "You are Claude Code."}
    assert A.strip_billing({"system": "You are Claude Code."}) is None and A.strip_billing({}) is None


# --------------------------------------------------------------------------------------------------------
# bounds: no upstream line can grow the converter (issue 20, item 5)
# --------------------------------------------------------------------------------------------------------

CAP = 1000


def convert_capped(raw: bytes, cuts: list[int]) -> tuple[bytes, int]:
    conv = R.StreamConverter(max_line=CAP)
    out, prev, held = [], 0, 0
    for c in [*sorted(set(cuts)), len(raw)]:
        out.append(conv.feed(raw[prev:c]))
        held = max(held, conv.held)
        prev = c
    return b"".join(out) + conv.close(), held


@settings(max_examples=200, deadline=None)
@given(generated_answer(), st.integers(0, 60), st.integers(0, CAP + 40), st.booleans(),
       st.lists(st.integers(0, 4000), max_size=8))
def test_a_line_of_any_length_converts_the_same_however_cut(case: tuple[dict[str, Any], bytes], where: int,
                                                             length: int, as_text: bool, cuts: list[int]) -> None:
    _, raw = case
    lines = raw.split(b"\n\n")
    assert max(map(len, lines)) < CAP - 40
    at = where % (len(lines) - 2)  # before the usage chunk that ends the message
    line = (b"data: " + json.dumps(_chunk({"content": "x" * length}), separators=(",", ":")).encode()
            if as_text else b": " + b"x" * length)
    raw = b"\n\n".join([*lines[:at], line, *lines[at:]])
    whole, _ = convert_capped(raw, [])
    split, held = convert_capped(raw, [c % (len(raw) + 1) for c in cuts])
    assert split == whole and held <= CAP
    events = parse_sse(whole)
    names = [n for n, _ in events]
    if len(line) > CAP:
        assert names[-1] == "error" and "message_stop" not in names
        assert events[-1][1] == {"type": "error", "error": {"type": "api_error", "message": R.TOO_LARGE}}
    else:
        assert names[-1] == "message_stop" and "error" not in names


def test_a_50_mb_line_ends_the_stream_with_an_error_event_quickly_and_holds_at_most_the_cap() -> None:
    conv = R.StreamConverter()
    first = SAMPLE[:SAMPLE.index(b"\n\n", SAMPLE.index(b'"content":"I"')) + 2]
    out = [conv.feed(first), conv.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"")]
    chunk = b"x" * (64 << 10)
    t0 = time.monotonic()
    for _ in range((50 << 20) // len(chunk)):
        out.append(conv.feed(chunk))
        assert conv.held <= conv.max_line + len(chunk)
    out.append(conv.feed(b'"}}]}\n\n' + SAMPLE[len(first):]))
    out.append(conv.close())
    assert time.monotonic() - t0 < 5
    names = [n for n, _ in parse_sse(b"".join(out))]
    assert names[0] == "message_start" and names[-1] == "error" and "message_stop" not in names
    assert conv.finished and conv.held == 0


@settings(max_examples=100, deadline=None)
@given(generated_answer(), st.integers(0, 200))
def test_a_stream_cut_cleanly_before_its_end_ends_with_an_error_event(case: tuple[dict[str, Any], bytes],
                                                                        where: int) -> None:
    """Cut at an event boundary before the finish chunk (an empty body included):
    every event converted so far, then Anthropic's error event, never message_stop."""
    _, raw = case
    events = raw.split(b"\n\n")[:-1]
    cut = b"".join(e + b"\n\n" for e in events[: where % (len(events) - 2)])  # before the finish chunk
    names = [n for n, _ in parse_sse(convert(cut, []))]
    assert names[-1] == "error" and "message_stop" not in names
    assert names[:-1] == [n for n, _ in parse_sse(convert(raw, []))][: len(names) - 1]
    assert parse_sse(convert(b"", [])) == [("error", {"type": "error", "error": {"type": "api_error",
                                                                                  "message": R.TRUNCATED}})]


def untimed(raw: bytes) -> bytes:
    """The same stream from a server that ignores timings_per_token: only the final chunks carry timings."""
    out = []
    for block in raw.split(b"\n\n")[:-1]:
        obj = json.loads(block[6:]) if block != b"data: [DONE]" else None
        if obj and obj["choices"] and obj["choices"][0].get("finish_reason") is None:
            obj.pop("timings", None)
            block = b"data: " + json.dumps(obj, separators=(",", ":")).encode()
        out.append(block + b"\n\n")
    return b"".join(out)


def test_without_timings_per_token_events_leave_after_a_few_chunks_not_at_the_end() -> None:
    """First event at 5.1 s instead of 0.1 s: every event was held until the final chunk."""
    raw = untimed(chat_sse(partials=[[{"content": f"w{i}"}] for i in range(10)], final=[], finish="stop",
                           n_decoded=10))
    chunks = [b + b"\n\n" for b in raw.split(b"\n\n")[:-1]]
    conv = R.StreamConverter()
    first = next(i for i, c in enumerate(chunks) if conv.feed(c))
    assert first == R.UNTIMED_AFTER  # the role chunk and four tokens: not the final chunk (index 11)
    events = parse_sse(convert(raw, []))
    assert assemble(events)["content"] == [{"type": "text", "text": "".join(f"w{i}" for i in range(10))}]
    assert events[-1][0] == "message_stop"
    for cut in range(0, len(raw), 7):
        assert convert(raw, [cut]) == convert(raw, [])


def test_chunks_held_for_one_result_are_bounded_when_timings_stop_coming() -> None:
    conv = R.StreamConverter()
    first = SAMPLE[:SAMPLE.index(b"\n\n", SAMPLE.index(b'"content":"I"')) + 2]  # a result with timings
    conv.feed(first)
    chunk = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
    out = b"".join(conv.feed(chunk) for _ in range(10_000))
    assert out.count(b"text_delta") == 10_000 - 10_000 % (R.MAX_PENDING + 1)  # out in groups, none held long
