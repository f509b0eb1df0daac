"""What one request may cost the proxy is bounded in bytes and time, not only in entries (reliability round 4,
items 2, 9, 11, 12 and 16).

Item 2: `POST /v1/responses` with an `input` of 1.5M `{}` items (4.3 MB) kept ~146 MB per conversation root
(every user digest) and held the event loop 6.2-6.5 s. Item 9: a 20 MB body of 7M `{}` messages cost 582 MB and
a 23.2 s stall; a 60 MB non-streamed answer of small objects 517 MB and 2.9 s. Item 11: 2,000 requests answered
404 left 2,000 conversation marks, never pruned. Item 12: with 512 remembered 1 MB `/completion` prompts, each
new prompt hashed 488 MB (0.37 s of CPU). Item 16: an Anthropic `tool_use.input` nested 900 deep raised
RecursionError (the request went out untranslated). `make reliability` runs them against a real mitmdump
(`bench/memory_bounds.py`)."""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from slotkeeper.drivers.upstream import Upstream
from slotlogic import anthropic, intake, json_scan
from slotlogic import session as sess
from slotlogic.answers import observe_json
from slotlogic.decisions import Forward, RequestFacts
from slotlogic.reasons import Passed
from slotlogic.settings import Settings
from tests.conftest import UP, FakeLlama


def _upstream(tmp_path) -> Upstream:
    return Upstream(UP, Settings(probe_interval=0), tmp_path / "state", [].append, client=FakeLlama())


async def _decide(up: Upstream, path: str, body: bytes, flow: str):
    return await up.decide(RequestFacts("POST", path, (), body, time.time()), flow)


def _held_digests(up: Upstream) -> int:
    return sum(len(users) for root in up.keeper.recognition.threads.roots.values() for users in root.values())


@pytest.mark.timeout(60)
async def test_a_responses_input_of_1_5m_items_is_passed_untouched_and_keeps_nothing(tmp_path):
    up = _upstream(tmp_path)
    body = b'{"model":"m","instructions":"agent","input":[' + b",".join([b"{}"] * 1_500_000) + b"]}"
    t0 = time.process_time()
    got = await _decide(up, "/v1/responses", body, "f1")
    took = time.process_time() - t0
    assert isinstance(got, Forward) and got.reason is Passed.TOO_MANY_ITEMS, got
    assert took < 1.0 and _held_digests(up) == 0, (took, _held_digests(up))


async def test_a_conversation_keeps_a_bounded_number_of_user_digests(tmp_path):
    up = _upstream(tmp_path)
    items = [{"role": "user", "content": f"question {i}"} for i in range(intake.MAX_ITEMS // 4)]
    body = json.dumps({"model": "m", "instructions": "agent", "input": items}).encode()
    got = await _decide(up, "/v1/responses", body, "f1")
    assert not isinstance(got, Forward)
    assert _held_digests(up) <= sess.MAX_USER_HEADS, _held_digests(up)
    # its next turn (all of its earlier user messages) is still its own conversation
    more = json.dumps({"model": "m", "instructions": "agent", "input": [*items, {"role": "user", "content": "next"}]})
    other = json.dumps({"model": "m", "instructions": "agent", "input": [{"role": "user", "content": "other"}]})
    first = sess.resolve({}, json.loads(body), "/v1/responses", threads=up.keeper.recognition.threads)
    assert sess.resolve({}, json.loads(more), "/v1/responses", threads=up.keeper.recognition.threads) == first
    assert sess.resolve({}, json.loads(other), "/v1/responses", threads=up.keeper.recognition.threads) != first


@pytest.mark.timeout(120)
async def test_a_20_mb_body_of_7m_messages_is_passed_untouched_without_a_parse(tmp_path):
    up = _upstream(tmp_path)
    body = b'{"model":"m","messages":[' + b",".join([b"{}"] * 7_000_000) + b"]}"
    t0 = time.process_time()
    got = await _decide(up, "/v1/chat/completions", body, "f1")
    took = time.process_time() - t0
    assert isinstance(got, Forward) and got.reason is Passed.TOO_MANY_ITEMS and took < 1.0, (got, took)


def test_braces_inside_strings_do_not_count_as_items():
    code = json.dumps("def f(x):\n    return {'a': [x, {'b': 1}]}\n" * 50_000)
    body = ('{"messages":[{"role":"user","content":' + code + "}]}").encode()
    assert body.count(b"{") > intake.MAX_ITEMS
    assert not json_scan.containers_over(body, intake.MAX_ITEMS)
    assert json_scan.containers_over(b"[" + b"{}," * 10 + b"{}]", 10)


def test_a_60_mb_answer_of_small_objects_is_read_without_a_parse():
    item = b'{"id":1,"token":"a","logprob":-0.1,"bytes":[97]},'
    raw = (b'{"choices":[{"index":0,"finish_reason":"stop","message":{"content":"x \\"timings\\": {}"},'
           b'"logprobs":{"content":[' + item * ((60 << 20) // len(item)) + b'{}]}}],"usage":{"total_tokens":9},'
           b'"timings":{"cache_n":3,"prompt_n":6,"prompt_per_second":100.5},"id_slot":2}')
    t0 = time.process_time()
    obs = observe_json(raw)
    took = time.process_time() - t0
    assert (obs.cache_n, obs.prompt_n, obs.prompt_per_second, obs.id_slot, obs.tokens_total) == (3, 6, 100.5, 2, 9)
    assert obs.complete and took < 1.0, took


async def test_requests_that_never_get_an_answer_leave_bounded_marks(tmp_path):
    up = _upstream(tmp_path)
    up.keeper.ledger.max_sessions = 50
    for i in range(300):
        body = json.dumps({"model": "m", "instructions": f"agent {i}",
                           "input": [{"role": "user", "content": "go"}]}).encode()
        await _decide(up, "/v1/responses", body, f"f{i}")   # answered 404: no answer is ever settled
    assert len(up.keeper.ledger.marks) <= 50, len(up.keeper.ledger.marks)


def test_a_new_prompt_is_hashed_once_whatever_the_remembered_prompts(monkeypatch):
    """Counted in bytes hashed, not timed: hashing the prompt again from its start for each remembered length
    hashed ~256 MB here; one running hash copied at each length hashes the prompt once."""
    text = "".join(f"line {i} of a long prompt\n" for i in range(45_000))   # ~1 MB
    known = {f"s{i}": sess.prompt_mark({"prompt": text[: len(text) // 2 + i * 1000]}) for i in range(512)}
    hashed = [0]

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def update(self, data):
            hashed[0] += len(data)
            self.inner.update(data)

        def copy(self):
            return Counting(self.inner.copy())

        def hexdigest(self):
            return self.inner.hexdigest()

    real = hashlib.sha256
    monkeypatch.setattr(sess.hashlib, "sha256", lambda data=b"": Counting(real(data)))
    new = sess.continuation({"prompt": "another " + text}, known)   # extends none: every length is looked at
    assert new is None and hashed[0] <= len(text) + 1024, hashed[0]
    monkeypatch.undo()
    assert sess.continuation({"prompt": text + "more"}, known).key == "s511"
    assert sess.continuation({"prompt": text[: len(text) // 2 + 1500]}, known).key == "s1"


def test_a_tool_input_nested_900_deep_is_translated():
    deep: dict = {}
    cur = deep
    for _ in range(900):
        cur["k"] = {}
        cur = cur["k"]
    cur["n"] = 1e15   # written as nlohmann writes it (1e+15): not by json.dumps
    body = {"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": deep}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]}
    chat_body = anthropic.to_chat(body)
    args = chat_body["messages"][1]["tool_calls"][0]["function"]["arguments"]
    assert args == '{"k":' * 900 + '{"n":1e+15}' + "}" * 900
    assert anthropic.encode(chat_body)
    assert anthropic.nl_dump({"a": [1, 2.5, {"b": None}], "f": 1e15}) == '{"a":[1,2.5,{"b":null}],"f":1e+15}'


def test_the_pools_model_lookup_parses_no_costly_body():
    """A llama-swap pool reads the body's `model` before any server's intake: the same bound holds there (a
    20 MB body of 7M `{}` was parsed whole), and a body nested too deep is no model (not a RecursionError)."""
    from slotkeeper.drivers.pool import _model_of

    assert _model_of(b'{"model":"m1","messages":[{}]}') == "m1"
    t0 = time.process_time()
    assert _model_of(b'{"model":"m1","messages":[' + b",".join([b"{}"] * 2_000_000) + b"]}") == ""
    assert time.process_time() - t0 < 1.0
    assert _model_of(b'{"model":"m1","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}") == ""
