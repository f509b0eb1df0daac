"""The benchmark's workload generator: deterministic, sessions distinct, subagents share the system prompt."""

from __future__ import annotations

import json

from bench.workload import (
    SYSTEM_PROMPT_TOKENS,
    TOOL_OUTPUT_TOKENS,
    TOOLS,
    WORKLOADS,
    approx_tokens,
    generate,
)


def agents(seed: int = 0, **kw: int):
    args = {"sessions": 6, "turns": 4, "subagent_turns": 3, "max_tokens": 8, **kw}
    return generate("agents", seed=seed, **args)


def test_deterministic_for_a_seed() -> None:
    a, b = agents(1), agents(1)
    dump = lambda w: json.dumps([[w.body(r), r.think_s] for r in w.requests()], sort_keys=True)  # noqa: E731
    assert dump(a) == dump(b)
    assert dump(a) != dump(agents(2))


def test_shape_and_subagent_position() -> None:
    w = agents()
    assert len(w.sessions) == 6
    for s in w.sessions:
        names = [r.session for r in s.requests]
        assert names == [s.id] * 2 + [f"{s.id}.sub"] * 3 + [s.id] * 2  # parent waits for its subagent
        assert [r.index for r in s.requests] == [0, 1, 0, 1, 2, 2, 3]
    assert len(w.requests()) == 42
    assert len(w.by_key()) == 42


def test_no_subagents_when_disabled() -> None:
    w = generate("fits", seed=0, sessions=3, turns=4, subagent_turns=0, max_tokens=8)
    assert all(r.session == s.id for s in w.sessions for r in s.requests)
    assert WORKLOADS["fits"].subagents is False and WORKLOADS["pi"].not_wired is None  # pi runs real pi


def test_sessions_differ_and_share_system_prompt() -> None:
    w = agents()
    firsts = [s.requests[0].messages for s in w.sessions]
    system = firsts[0][0]
    assert system["role"] == "system"
    assert len({m[1]["content"] for m in firsts}) == len(firsts)  # first user messages all differ
    for s in w.sessions:
        for r in s.requests:
            assert r.messages[0] == system  # subagents too
    subs = [r for r in w.requests() if r.session.endswith(".sub") and r.index == 0]
    assert len({r.messages[1]["content"] for r in subs}) == len(subs)
    assert all(r.messages[1]["content"] not in [f[1]["content"] for f in firsts] for r in subs)


def test_conversations_only_grow() -> None:
    w = agents()
    for s in w.sessions:
        prev: dict[str, list] = {}
        for r in s.requests:
            before = prev.get(r.session)
            if before is not None:
                assert r.messages[: len(before)] == before
                assert len(r.messages) == len(before) + 2
            prev[r.session] = r.messages


def test_token_sizes_roughly_hold() -> None:
    w = agents()
    system = w.sessions[0].requests[0].messages[0]["content"]
    assert 0.8 * SYSTEM_PROMPT_TOKENS <= approx_tokens(system) <= 1.25 * SYSTEM_PROMPT_TOKENS
    lo, hi = TOOL_OUTPUT_TOKENS
    outputs = [m["content"] for r in w.requests() for m in r.messages[2:]
               if m["role"] == "tool" or (m["role"] == "user")]
    assert outputs
    for text in outputs:
        # code/log text runs 1.7-2.9 characters per token; allow one line of overshoot
        assert lo * 1.7 * 0.9 <= len(text) <= (hi + 60) * 2.9, len(text)


def test_request_body_is_a_streaming_agent_request() -> None:
    w = agents()
    body = w.body(w.sessions[0].requests[-1])
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["tools"] == TOOLS and len(TOOLS) == 4
    assert body["max_tokens"] == 8
    roles = {m["role"] for m in body["messages"]}
    assert roles <= {"system", "user", "assistant", "tool"}
    for m in body["messages"]:
        if m["role"] == "assistant" and m.get("tool_calls"):
            call = m["tool_calls"][0]
            json.loads(call["function"]["arguments"])
    assert "stream" not in w.body(w.sessions[0].requests[0], stream=False)


def test_think_times_in_range() -> None:
    w = agents()
    for s in w.sessions:
        assert 0.0 <= s.requests[0].think_s <= 1.0
        assert all(0.5 <= r.think_s <= 2.0 for r in s.requests[1:])
