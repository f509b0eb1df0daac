"""The same Anthropic requests, sent natively to llama-server's `/v1/messages` and translated through
`/v1/chat/completions` (slotlogic.anthropic), give the same answer: content blocks, stop reasons, token
counts, and for streams the same bytes (ids aside). On a one-slot server the translated request right after
the native one reuses all of its prompt but the last token: the proof that both render the same tokens.

Tool calls need a template llama-server can parse them from; SmolLM2's own cannot render tools (the server
then answers in plain text whatever `tool_choice` says), so those cases run on a second server with a
Hermes-style template (tests/hermes_server.py), where the model is asked to repeat a tool call verbatim.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bench.real.llama_server import LlamaServer
from slotlogic import anthropic as A
from slotlogic import anthropic_answer as R
from tests.hermes_server import THINK_TEMPLATE, HermesServer
from tests.test_anthropic import assemble, parse_sse

pytestmark = pytest.mark.real

BASE = {"model": "claude-x", "max_tokens": 12, "temperature": 0, "top_k": 1}
BILLING = "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch={};"
TOOLS = [{"name": "get_weather", "description": "Get the weather", "cache_control": {"type": "ephemeral"},
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CALL = '<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{}"}}}}\n</tool_call>'


@pytest.fixture(scope="module")
def smol() -> Iterator[str]:
    with LlamaServer(slots=1, ctx_per_slot=4096, threads=1) as srv:
        yield srv.url


@pytest.fixture(scope="module")
def hermes() -> Iterator[str]:
    with HermesServer(slots=1, ctx_per_slot=4096, threads=1) as srv:
        yield srv.url


@pytest.fixture(scope="module")
def thinker() -> Iterator[str]:
    with HermesServer(THINK_TEMPLATE, slots=1, ctx_per_slot=4096, threads=1) as srv:
        yield srv.url


def _compact(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _norm(raw: bytes) -> bytes:
    """Ids are random per answer (message and tool-call ids)."""
    raw = re.sub(rb"chatcmpl-[A-Za-z0-9]+", b"chatcmpl-ID", raw)
    return re.sub(rb'"id":"[A-Za-z0-9]{32}"', b'"id":"TOOL"', raw)


def native(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    if body.get("stream"):
        with httpx.stream("POST", url + "/v1/messages", json=body, timeout=120) as r:
            return r.status_code, b"".join(r.iter_raw())
    r = httpx.post(url + "/v1/messages", json=body, timeout=120)
    return r.status_code, r.content


def translated(url: str, body: dict[str, Any], chat: dict[str, Any] | None = None) -> tuple[int, bytes]:
    """What the proxy does: to_chat → /v1/chat/completions (pinned) → from_chat / StreamConverter."""
    chat = {**(chat or A.to_chat(body)), "id_slot": 0, "cache_prompt": True}
    headers = {"content-type": "application/json"}
    if chat.get("stream") is True:
        conv = R.StreamConverter()
        with httpx.stream("POST", url + "/v1/chat/completions", content=A.encode(chat), headers=headers,
                          timeout=120) as r:
            if r.status_code != 200:
                return r.status_code, R.error_body(r.status_code, r.read())
            out = [conv.feed(c) for c in r.iter_raw()]
        out.append(conv.close())
        assert conv.prompt is not None and conv.finished
        return 200, b"".join(out)
    r = httpx.post(url + "/v1/chat/completions", content=A.encode(chat), headers=headers, timeout=120)
    if r.status_code != 200:
        return r.status_code, R.error_body(r.status_code, r.content)
    return 200, json.dumps(R.from_chat(r.json()), ensure_ascii=False, separators=(",", ":")).encode()


def same_answers(url: str, body: dict[str, Any], stream_as_message: bool = True) -> dict[str, Any]:
    """Native, translated, native streamed, translated streamed: in this order, on one slot. The message is
    returned with `_streamed`, the content a client assembles from the (identical) streams."""
    s_n, n = native(url, body)
    s_t, t = translated(url, body)
    assert s_n == s_t
    if s_n != 200:
        assert t == n  # the error body the native route sends, byte for byte
        s_ns, ns = native(url, {**body, "stream": True})
        s_ts, ts = translated(url, {**body, "stream": True})
        assert s_ns == s_ts == s_n and ns == ts
        return {}
    mn, mt = json.loads(n), json.loads(t)
    assert _norm(_compact(mn["content"])) == _norm(_compact(mt["content"]))
    for key in ("type", "role", "model", "stop_reason", "stop_sequence"):
        assert mn[key] == mt[key], key
    un, ut = mn["usage"], mt["usage"]
    assert un["output_tokens"] == ut["output_tokens"]
    total = un["input_tokens"] + un["cache_read_input_tokens"]
    assert ut["input_tokens"] + ut["cache_read_input_tokens"] == total
    assert ut["cache_read_input_tokens"] == total - 1, "the translated prompt is not the native prompt's tokens"
    s_ns, ns = native(url, {**body, "stream": True})
    s_ts, ts = translated(url, {**body, "stream": True})
    assert s_ns == s_ts == 200
    assert _norm(ns) == _norm(ts)
    streamed = assemble(parse_sse(ts))
    if stream_as_message:
        assert _norm(_compact(streamed["content"])) == _norm(_compact(mt["content"]))
    assert streamed["stop_reason"] == mt["stop_reason"]
    return {**mn, "_streamed": streamed["content"]}


def test_plain_text(smol: str) -> None:
    msg = same_answers(smol, {**BASE, "messages": [{"role": "user", "content": "Say hi"}]})
    assert msg["content"][0]["type"] == "text"


def test_claude_code_shaped_multi_turn(smol: str) -> None:
    """System as blocks with the billing line and cache_control, a second system message, thinking and
    redacted thinking, tool use and results (one `is_error`) in the history, metadata and thinking params."""
    body = {**BASE, "system": [{"type": "text", "text": BILLING.format("a5145")},
                               {"type": "text", "text": "You are a coding agent.",
                                "cache_control": {"type": "ephemeral"}}],
            "tools": TOOLS, "metadata": {"user_id": "u-1"}, "thinking": {"type": "enabled", "budget_tokens": 64},
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
                {"role": "system", "content": "Second system message."},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "I need the tool.", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "xyz"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                     "input": {"city": "Paris", "n": 1.5}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True, "content": "Grüße: boom"},
                    {"type": "text", "text": "Summarize.", "cache_control": {"type": "ephemeral"}}]}]}
    same_answers(smol, body)


def test_stop_sequence_and_max_tokens_cut(smol: str) -> None:
    msg = same_answers(smol, {**BASE, "max_tokens": 30, "stop_sequences": ["you"],
                              "messages": [{"role": "user", "content": "Say hi"}]})
    assert msg["stop_reason"] == "end_turn" and msg["stop_sequence"] == "you"  # the server's mapping
    cut = same_answers(smol, {**BASE, "max_tokens": 3, "messages": [{"role": "user", "content": "Tell a story"}]})
    assert cut["stop_reason"] == "max_tokens" and cut["usage"]["output_tokens"] == 3


def test_context_overflow_error_passes_through(smol: str) -> None:
    assert same_answers(smol, {**BASE, "messages": [{"role": "user", "content": "hello " * 4200}]}) == {}


def test_string_and_one_block_render_the_same_prompt(smol: str) -> None:
    def prompt(content: Any) -> str:
        chat = A.to_chat({**BASE, "messages": [{"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": "Hello"},
                                              {"role": "user", "content": content}]})
        r = httpx.post(smol + "/apply-template", json=chat, timeout=60)
        r.raise_for_status()
        return r.json()["prompt"]

    assert prompt("Next step") == prompt([{"type": "text", "text": "Next step",
                                           "cache_control": {"type": "ephemeral"}}])


def test_a_wrong_translation_is_caught(smol: str) -> None:
    """Negative control: the cache check fails when the translation drops the server's billing rule."""
    body = {**BASE, "max_tokens": 2, "system": BILLING.format("b7777") + "You are terse.",
            "messages": [{"role": "user", "content": "Say hi"}]}
    native(smol, body)
    wrong = A.to_chat(body)
    wrong["messages"][0]["content"] = body["system"]  # cch not normalised
    _, raw = translated(smol, body, wrong)
    usage = json.loads(raw)["usage"]
    assert usage["cache_read_input_tokens"] < usage["input_tokens"] + usage["cache_read_input_tokens"] - 1


def test_forced_tool_calls(hermes: str) -> None:
    def ask(text: str, **kw: Any) -> dict[str, Any]:
        return {**BASE, "max_tokens": 72, "tools": TOOLS,
                "messages": [{"role": "user", "content": "Repeat exactly:\n" + text}], **kw}

    one = same_answers(hermes, ask(CALL.format("Paris"), tool_choice={"type": "any"}))
    assert one["stop_reason"] == "tool_use"
    assert [(b["type"], b.get("input")) for b in one["content"]] == [("tool_use", {"city": "Paris"})]
    two = same_answers(hermes, ask(CALL.format("Paris") + "\n" + CALL.format("Rome"),
                                   tool_choice={"type": "tool", "name": "get_weather"}))
    assert [b["input"]["city"] for b in two["content"]] == ["Paris", "Rome"]
    # Cut inside the call: the native route answers the partial call as text when not streamed, but streams
    # no block at all (its streaming parser holds the unfinished call back). Both routes alike.
    cut = same_answers(hermes, ask(CALL.format("Oslo"), max_tokens=10), stream_as_message=False)
    assert cut["stop_reason"] == "max_tokens" and cut["content"][0]["type"] == "text" and cut["_streamed"] == []


def test_thinking_output(thinker: str) -> None:
    """The template opens `<think>`, so the server parses the output as reasoning: thinking blocks and
    signature deltas, with and without tools offered. (The model does not leave the reasoning for a tool
    call here, so thinking followed by tool_use is covered by the unit tests only.)"""
    def ask(text: str, **kw: Any) -> dict[str, Any]:
        return {**BASE, "max_tokens": 60,
                "messages": [{"role": "user", "content": "Repeat exactly:\n" + text}], **kw}

    cut = same_answers(thinker, ask("Hello there.", max_tokens=6))
    assert [b["type"] for b in cut["content"]] == ["thinking"] and cut["stop_reason"] == "max_tokens"
    done = same_answers(thinker, ask("I think. </think>\nHello"))
    assert done["content"][0]["type"] == "thinking" and done["stop_reason"] == "end_turn"
    tool = same_answers(thinker, ask("Weather. </think>\n" + CALL.format("Paris"), tools=TOOLS,
                                    tool_choice={"type": "any"}))
    assert tool["content"][0]["type"] == "thinking"
