"""In-process cost of slotlogic.anthropic on a Claude-Code-sized request (no server).

Shape (see the project's client notes): `system` = 3 blocks, ~6 KB, the first the billing line; 24 tools,
~60 KB of JSON; 20 turns of text, tool_use and tool_result blocks. Prints µs per request conversion
(`to_chat`, `encode`, and `json.loads` of the client body for scale), per non-streamed answer (`from_chat`)
and per streamed event (one chat chunk in, its Anthropic event out).

Run: `python -m bench.anthropic_cost`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from slotlogic import anthropic as A
from slotlogic import anthropic_answer as R


def claude_code_body(turns: int = 20) -> dict[str, Any]:
    prop = {"type": "string", "description": "A parameter of this tool, described at some length. " * 3}
    tools = [{"name": f"Tool{i}", "description": "What this tool does and when to use it. " * 30,
              "input_schema": {"type": "object", "properties": {f"p{j}": prop for j in range(6)},
                               "required": ["p0"], "additionalProperties": False}} for i in range(24)]
    billing = "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;"
    system = [{"type": "text", "text": billing},
              {"type": "text", "text": "You are Claude Code. " * 150},
              {"type": "text", "text": "Environment and git status. " * 80, "cache_control": {"type": "ephemeral"}}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "Fix the failing test."}]}]
    for i in range(turns):
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": f"Step {i}: reading the file."},
            {"type": "tool_use", "id": f"toolu_{i:04d}", "name": "Tool1",
             "input": {"p0": f"/repo/src/module_{i}.py", "p1": 1.5, "p2": [1, 2, 3]}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{i:04d}",
             "content": [{"type": "text", "text": "line of file output\n" * 40}]}]})
    return {"model": "claude-x", "max_tokens": 32000, "stream": True, "system": system, "tools": tools,
            "messages": messages, "metadata": {"user_id": "u"}, "temperature": 1}


def per_call(fn: Callable[[], object], n: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def chunk(delta: dict[str, Any], **extra: Any) -> bytes:
    obj = {"choices": [{"finish_reason": None, "index": 0, "delta": delta}], "created": 1,
           "id": "chatcmpl-0123456789abcdef0123456789abcdef", "model": "/models/model.gguf",
           "system_fingerprint": "b0", "object": "chat.completion.chunk", **extra}
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def main() -> None:
    body = claude_code_body()
    raw = json.dumps(body).encode()
    chat = A.to_chat(body)
    print(f"request: {len(raw) / 1024:.0f} KB client body, tools {len(json.dumps(body['tools'])) / 1024:.0f} KB, "
          f"system {sum(len(b['text']) for b in body['system']) / 1024:.1f} KB, {len(body['messages'])} messages")
    print(f"json.loads(client body)  {per_call(lambda: json.loads(raw), 200):8.1f} µs  (for scale)")
    print(f"to_chat                  {per_call(lambda: A.to_chat(body), 200):8.1f} µs")
    print(f"encode(chat body)        {per_call(lambda: A.encode(chat), 200):8.1f} µs")
    answer = {"choices": [{"finish_reason": "tool_calls", "index": 0, "message": {
        "role": "assistant", "content": "Let me look at the test.", "tool_calls": [
            {"type": "function", "function": {"name": "Tool1", "arguments": '{"p0":"/repo/tests/test_x.py"}'},
             "id": "abc"}]}}], "id": "chatcmpl-1", "model": "m",
        "usage": {"completion_tokens": 30, "prompt_tokens": 30000, "prompt_tokens_details": {"cached_tokens": 29000}}}
    print(f"from_chat                {per_call(lambda: R.from_chat(answer), 2000):8.1f} µs")
    timings = {"cache_n": 29000, "prompt_n": 1000, "prompt_ms": 1.0, "prompt_per_token_ms": 1.0,
               "prompt_per_second": 1.0, "predicted_n": 5, "predicted_ms": 1.0, "predicted_per_token_ms": 1.0,
               "predicted_per_second": 1.0}
    first = chunk({"role": "assistant", "content": None}) + chunk({"content": "Let"}, timings=timings)
    token = chunk({"content": " me"}, timings=timings)
    n = 5000
    conv = R.StreamConverter()
    conv.feed(first)
    t = time.perf_counter()
    for _ in range(n):
        conv.feed(token)
    per_event = (time.perf_counter() - t) / n * 1e6
    print(f"stream: one text chunk   {per_event:8.1f} µs  ({len(token)} B in, "
          f"{len(conv.feed(token))} B out)")


if __name__ == "__main__":
    main()
