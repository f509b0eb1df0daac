"""Anthropic clients through a real mitmdump in front of a real llama-server: pinned, warm, and answered as
the native `/v1/messages` route answers."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest

from bench.real.llama_server import LlamaServer
from bench.real.mitmdump import MitmProxy
from tests.real_helpers import SYSTEM, THREADS

pytestmark = pytest.mark.real

BILLING = "x-anthropic-billing-header: cc_version=2.1.197.{}; cc_entrypoint=cli; cch=00000;"


def body(first: str, turns: int, *, stream: bool, session: str) -> dict:
    msgs: list[dict] = [{"role": "user", "content": [{"type": "text", "text": first}]}]
    for i in range(turns - 1):
        msgs += [{"role": "assistant", "content": [{"type": "text", "text": f"Step {i} done."}]},
                 {"role": "user", "content": f"Output of step {i}: " + " ".join(f"ok{i}-{k}" for k in range(20))}]
    return {"model": "claude-sonnet", "max_tokens": 4, "temperature": 0, "top_k": 1, "stream": stream,
            "system": [{"type": "text", "text": BILLING.format(session[-3:])},
                       {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
            "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": session})}, "messages": msgs}


def send(base: str, b: dict, session: str) -> tuple[dict, int | None]:
    """The answer as the client sees it (a message, or the stream's events), and the slot the proxy chose."""
    headers = {"x-claude-code-session-id": session, "anthropic-version": "2023-06-01"}
    r = httpx.post(base + "/v1/messages?beta=true", json=b, headers=headers, timeout=120)
    r.raise_for_status()
    slot = r.headers.get("x-slot-id")
    if not b["stream"]:
        return r.json(), int(slot) if slot else None
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    return {"events": events}, int(slot) if slot else None


def usage(answer: dict) -> tuple[int, int]:
    """(cached, prefilled) prompt tokens, streamed or not."""
    u = answer["usage"] if "usage" in answer else next(
        e["message"]["usage"] for e in answer["events"] if e["type"] == "message_start")
    return u["cache_read_input_tokens"], u["input_tokens"]


def shape(answer: dict) -> object:
    """What must equal between the native and the translated route: everything but the random ids."""
    text = json.dumps(answer, sort_keys=True)
    return re.sub(r'"(msg|chatcmpl|toolu)[-_][A-Za-z0-9_-]+"', '"ID"', text)


def test_two_claude_code_windows_stay_on_their_slots_and_answer_natively(tmp_path: Path):
    """With the billing block kept, the translated prompt is the native one, token for token."""
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_log_file": str(tmp_path / "req.jsonl"),
            "slots_strip_billing": False}
    with LlamaServer(threads=THREADS, slots=3, ctx_per_slot=4096, log_path=str(tmp_path / "s.log")) as srv, \
            MitmProxy(srv.url, opts, log_path=str(tmp_path / "p.log")) as px:
        deadline = time.monotonic() + 20  # at start, while the slots are empty, the proxy probes the route
        while "id_slot on /v1/messages" not in (tmp_path / "p.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        slots: dict[str, set[int | None]] = {"cc-a": set(), "cc-b": set()}
        before: dict[str, int] = {}
        for turns in (1, 2):
            for session, first in (("cc-a", "Task A: fix the tests."), ("cc-b", "Task B: write the docs.")):
                for stream in (False, True):
                    b = body(first, turns, stream=stream, session=session)
                    answer, slot = send(px.url, b, session)
                    slots[session].add(slot)
                    cached, prefilled = usage(answer)
                    if turns == 1 and not stream:
                        before[session] = cached + prefilled
                    if turns == 2 and not stream:  # all of turn 1's prompt came from the slot's cache
                        assert cached >= before[session] - 2, (session, cached, prefilled, before)
                    native, _ = send(srv.url, b, session)  # the same request, native route, same answer
                    assert shape({k: v for k, v in answer.items() if k != "usage"}) == shape(
                        {k: v for k, v in native.items() if k != "usage"})
    assert all(len(s) == 1 for s in slots.values()) and slots["cc-a"] != slots["cc-b"], slots
    log = (tmp_path / "p.log").read_text()
    assert "ignores id_slot on /v1/messages: Anthropic requests are sent as chat completions" in log
    assert "/v1/messages?beta=true session=" in log and "(header:x-claude-code-session-id)" in log
    assert "careful coding agent" not in log  # no prompt text


def test_without_the_billing_block_a_new_window_reuses_the_system_prompt(tmp_path: Path):
    """Claude Code's billing block differs per session from its 47th character; dropped (the default), the
    second window's first request finds the whole system prompt in the slot the first one left."""
    opts = {"slots_state_dir": str(tmp_path / "state")}
    with LlamaServer(threads=THREADS, slots=1, ctx_per_slot=4096, log_path=str(tmp_path / "s.log")) as srv, \
            MitmProxy(srv.url, opts, log_path=str(tmp_path / "p.log")) as px:
        first, _ = send(px.url, body("Task A.", 1, stream=False, session="cc-aaa"), "cc-aaa")
        second, _ = send(px.url, body("Task B.", 1, stream=False, session="cc-bbb"), "cc-bbb")
        kept, _ = send(srv.url, body("Task C.", 1, stream=False, session="cc-ccc"), "cc-ccc")  # native, block kept
    system_tokens = usage(first)[1] - 10  # all but the user message and the template's few tokens
    assert usage(second)[0] >= system_tokens, (usage(first), usage(second))
    assert usage(kept)[0] < 20, usage(kept)  # with the block, almost nothing is shared
