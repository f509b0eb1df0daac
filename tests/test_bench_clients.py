"""The real-client workloads' plumbing that needs no client: Codex's Responses bodies as chat messages, the
check of every rendered count against what the server reported, turns, the turn-2+ and new-session numbers,
and the per-request metadata read back from saved flows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mitmproxy import http, io
from mitmproxy.test import tflow

from bench import client_workloads as cw
from bench import responses


def dev(text: str) -> dict:
    return {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": text}], "id": "msg_1"}


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}], "id": "msg_2"}


CODEX_TURN_2 = {
    "model": "smollm2", "stream": True, "store": False, "prompt_cache_key": "thread-1",
    "reasoning": {"summary": "auto"}, "tool_choice": "auto", "parallel_tool_calls": False,
    "input": [dev("base instructions"), dev("skills"), user("<environment_context>\n  <cwd>/p</cwd>"),
              user("What is a hash map?"),
              {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A map."}]},
              {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": "{\"cmd\":\"ls\"}"},
              {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"},
              user("When is it a bad choice?")],
    "tools": [{"type": "function", "name": "shell", "description": "run", "parameters": {"type": "object"}},
              {"type": "web_search"},
              {"type": "function", "name": "plan", "strict": False, "parameters": {}}],
}


def test_codex_items_become_the_chat_messages_llama_server_renders():
    chat = responses.to_chat(CODEX_TURN_2)
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["developer", "developer", "user", "user", "assistant", "tool", "user"]
    assert chat["messages"][0]["content"] == [{"type": "text", "text": "base instructions"}]
    # the function call merges into the assistant message before it, its output is a tool message
    assistant = chat["messages"][4]
    assert assistant["content"] == [{"type": "text", "text": "A map."}]
    assert assistant["tool_calls"] == [{"function": {"arguments": "{\"cmd\":\"ls\"}", "name": "shell"},
                                        "id": "call_1", "type": "function"}]
    assert chat["messages"][5] == {"content": "a.txt", "role": "tool", "tool_call_id": "call_1"}
    # only function tools, `strict` defaulted to true (kept when given); `input` and `reasoning` are gone
    assert [t["function"]["name"] for t in chat["tools"]] == ["shell", "plan"]
    assert chat["tools"][0]["function"]["strict"] is True and chat["tools"][1]["function"]["strict"] is False
    assert "input" not in chat and "reasoning" not in chat and chat["prompt_cache_key"] == "thread-1"
    assert CODEX_TURN_2["input"][0]["content"][0]["type"] == "input_text"  # the caller's body is untouched


def test_instructions_string_input_caps_and_reasoning():
    chat = responses.to_chat({"instructions": "be brief", "input": "hi", "max_output_tokens": 7,
                              "reasoning": {"effort": "low"}})
    assert chat["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert chat["max_tokens"] == 7 and chat["reasoning_effort"] == "low" and "max_output_tokens" not in chat


def test_reasoning_items_and_a_function_call_without_a_preceding_assistant():
    chat = responses.to_chat({"input": [
        "plain string item",
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "think"}], "summary": []},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": {"x": 1}},
        {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "out"}]},
        {"type": "reasoning", "content": "again"},
        {"role": "assistant", "content": "text after reasoning"}]})
    m = chat["messages"]
    assert m[0] == {"role": "user", "content": "plain string item"}
    assert m[1]["reasoning_content"] == "think" and m[1]["tool_calls"][0]["function"]["arguments"] == '{"x":1}'
    assert m[2] == {"content": [{"type": "text", "text": "out"}], "role": "tool", "tool_call_id": "c"}
    assert m[3] == {"role": "assistant", "content": [{"type": "text", "text": "text after reasoning"}],
                    "reasoning_content": "again"}


@pytest.mark.parametrize("bad", [{}, {"input": 3}, {"input": "x", "tools": {}}, []])
def test_bodies_the_server_refuses(bad):
    with pytest.raises(responses.ResponsesError):
        responses.to_chat(bad)


def req(start: float, cache_n: int | None, prompt_n: int | None, rendered: int | None, *, side: bool = False,
        session: int | None = None, turn: int | None = None) -> cw.Request:
    r = cw.Request(start, start + 1, "/v1/chat/completions", {}, 200, cache_n, prompt_n, side, "k",
                   session=session, turn=turn)
    r.rendered = rendered
    return r


def test_every_count_that_differs_from_the_server_is_reported():
    ok = req(0, 99, 1, 100)            # a full hit: N-1 cached + 1 re-evaluated = N
    cold = req(1, 0, 50, 50)
    off = req(2, 10, 41, 50, session=1, turn=0)
    unrendered = req(3, 0, 20, None)
    unrendered.render_error = "ValueError: no JSON body"
    failed = req(4, None, None, None)  # nothing reported, nothing rendered: an error row, not a mismatch
    bad = cw.mismatches([ok, cold, off, unrendered, failed])
    assert [(m["request"], m["rendered"], m["cache_n"], m["prompt_n"]) for m in bad] == [(2, 50, 10, 41),
                                                                                          (3, None, 0, 20)]
    assert bad[0]["session"] == "s2t1" and bad[1]["render_error"] == "ValueError: no JSON body"


def test_turns_later_reuse_and_new_sessions():
    turns = [cw.Turn(0, 0, 0, 10, 0, ""), cw.Turn(1, 0, 10, 20, 0, ""), cw.Turn(0, 1, 20, 30, 0, "")]
    rs = [req(1, 0, 100, 100), req(2, 90, 10, 100, side=True), req(11, 80, 25, 105), req(12, 0, 30, 30, side=True),
          req(21, 120, 5, 125), req(22, 100, 20, 120), req(40, 1, 1, 2)]
    cw.assign_turns(rs, turns)
    assert [(r.session, r.turn) for r in rs] == [(0, 0), (0, 0), (1, 0), (1, 0), (0, 1), (0, 1), (None, None)]
    later = cw.later_turns(rs)
    assert later["later_requests"] == 2 and later["later_reuse_pct"] == pytest.approx(100 * 220 / 245)
    assert later["later_worst_pct"] == pytest.approx(100 * 100 / 120)
    first = cw.new_session_first(rs)  # session 2's first main request; side calls and session 1 do not count
    assert (first["new_turn1_cached"], first["new_turn1_new"], first["new_turn1_each"]) == (80, 25, ["80/25"])


def test_limit_numbers_come_from_the_rendered_prompts():
    turns = [cw.Turn(0, 0, 0, 10, 0, ""), cw.Turn(1, 0, 10, 20, 0, ""), cw.Turn(0, 1, 20, 30, 0, "")]
    rs = [req(1, 0, 4, 4), req(11, 2, 3, 5), req(21, 3, 3, 6)]
    cw.assign_turns(rs, turns)
    run = cw.ClientRun("client-x", "auto", 30.0, turns, rs, tokens=[[1, 2, 3, 4], [1, 2, 9, 9, 9], [1, 2, 3, 4, 5, 6]])
    lim = cw.limit_of(run)
    assert lim["per_request"] == [4, 3, 2] and lim["limit_tokens"] == 9 and lim["prompt_tokens"] == 15
    extra = cw.limit_extras(run, lim)
    assert extra["new_turn1_each"] == ["2/3"] and extra["later_reuse_pct"] == pytest.approx(100 * 4 / 6)


def test_chat_rendering_per_route():
    anthropic_body = {"system": [{"type": "text", "text": "sys"}], "messages": [{"role": "user", "content": "hi"}]}
    assert cw.chat_body("/v1/messages?beta=true", anthropic_body)["messages"][0] == {"role": "system",
                                                                                    "content": "sys"}
    assert cw.chat_body("/v1/responses", {"input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]
    body = {"messages": [{"role": "user", "content": "x"}]}
    assert cw.chat_body("/v1/chat/completions", body) is body
    with pytest.raises(ValueError):
        cw.chat_body("/completion", body)


def test_requests_and_their_metadata_read_back_from_saved_flows(tmp_path: Path):
    path = tmp_path / "f.mitm"
    with path.open("wb") as fp:
        w = io.FlowWriter(fp)
        for i, t, side in ((2, 20.0, True), (1, 10.0, False)):
            body = {"messages": [{"role": "user", "content": f"m{i}"}], "id_slot": 0}
            fl = tflow.tflow(req=http.Request.make("POST", "http://127.0.0.1:8080/v1/chat/completions",
                                                   json.dumps(body)), resp=True)
            fl.request.timestamp_start = t
            fl.metadata["slotkeeper"] = {"session": f"s{i}", "side": side, "cache_n": 5 * i, "prompt_n": i}
            w.add(fl)
        w.add(tflow.tflow(req=http.Request.make("GET", "http://127.0.0.1:8080/_slots/health")))
        w.add(tflow.tflow(req=http.Request.make("POST", "http://127.0.0.1:8080/tokenize", b"{}")))  # no metadata
    got = cw.read_flows(path)
    assert [(r.session_key, r.side, r.cache_n, r.prompt_n, r.served) for r in got] == [
        ("s1", False, 5, 1, 6), ("s2", True, 10, 2, 12)]
    assert got[0].body == {"messages": [{"role": "user", "content": "m1"}], "id_slot": 0}


def test_stock_is_the_observing_proxy_and_pinning_configs_give_the_limit():
    from bench.configs import CONFIGS

    stock = cw.config_for("stock", CONFIGS)
    assert stock.proxy and stock.options == {"slots_policy": "off", "slots_anthropic": "off"}
    assert not cw.pins(stock) and not cw.pins(CONFIGS["stock"])
    assert cw.pins(CONFIGS["auto"]) and cw.pins(CONFIGS["auto+ckpt"])
    assert cw.config_for("auto+ckpt", CONFIGS) is CONFIGS["auto+ckpt"]


def test_first_prompts_differ_where_claude_code_hashes_them():
    picks = {(p[4], p[7], p[20]) for p in (cw.prompts(i)[0] for i in range(3))}
    assert len(picks) == 3 and cw.prompts(0)[1] == cw.prompts(2)[1]


def test_a_run_without_the_billing_block_is_rendered_as_a_perfect_cache_would_see_it():
    body = {"system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.a1b; cc_entrypoint=x;"},
                       {"type": "text", "text": "You are an agent."}],
            "messages": [{"role": "user", "content": "hi"}]}
    kept = cw.chat_body("/v1/messages", body)["messages"][0]["content"]
    stripped = cw.chat_body("/v1/messages", body, strip_billing=True)["messages"][0]["content"]
    assert kept.startswith("x-anthropic-billing-header") and stripped == "You are an agent."
    plain = {"messages": [{"role": "user", "content": "x"}]}
    assert cw.chat_body("/v1/chat/completions", plain, strip_billing=True) is plain


def test_checkpoint_steps_and_warm_up_come_from_the_proxy_log(tmp_path: Path):
    from bench.configs import Stack

    log = tmp_path / "p.jsonl"
    log.write_text("\n".join(json.dumps(r) for r in [
        {"kind": "checkpoint", "outcome": "warmed-saved", "prompt_n": 3822},
        {"kind": "request", "prompt_n": 9}, {"kind": "checkpoint", "outcome": "hit", "prompt_n": None},
        {"kind": "checkpoint", "outcome": "warmed-saved", "prompt_n": 6}]) + "\n")
    stack = Stack("http://p", "http://s", log)
    assert stack.checkpoint_steps() == {"warmed-saved": 2, "hit": 1} and stack.proxy_prefill() == 3828
    assert Stack("http://p", "http://s").checkpoint_steps() == {}


def test_a_request_whose_client_gave_up_lasted_until_its_error(tmp_path: Path):
    """A side call the client gave up on after 92 s (bench mix-4, stock) counted 0 s in the side-call p95."""
    from mitmproxy.flow import Error

    path = tmp_path / "f.mitm"
    with path.open("wb") as fp:
        fl = tflow.tflow(req=http.Request.make("POST", "http://127.0.0.1:8080/v1/chat/completions", b"{}"))
        fl.request.timestamp_start = 100.0
        fl.error = Error("Client disconnected.", timestamp=191.8)
        fl.metadata["slotkeeper"] = {"session": "s", "side": True, "cache_n": None, "prompt_n": None}
        io.FlowWriter(fp).add(fl)
    (got,) = cw.read_flows(path)
    assert got.error == "transport" and got.end - got.start == pytest.approx(91.8)
