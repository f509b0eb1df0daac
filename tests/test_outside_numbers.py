"""Numbers from a server are checked and bounded where they enter (reliability round 4, items 1 and 8).

Item 1: a `/props` that says `total_slots: 100000000` (with `/slots` off) grew the proxy from 101 MB to 3 GB in
47 s and its client's request was never sent: loops over `range(total)` ran on the event loop. Item 8: one answer
with `prompt_per_second: 1e400` (infinity once parsed) left the prefill estimate NaN for good, `/_slots/status`
held `NaN` (not JSON), the slot page said "status unavailable" forever and every page move was judged not
worth it. `make reliability` runs both against a real mitmdump (`bench/memory_bounds.py`: props_slots,
props_infinite_speed)."""

from __future__ import annotations

import json
import math
import time
import tracemalloc

import pytest

from slotkeeper.drivers.upstream import Upstream
from slotkeeper.mitm.localapi import reply
from slotlogic import numbers
from slotlogic.answers import StreamObserver, observe_json
from slotlogic.costs import SlotFileAnswer, Speeds
from slotlogic.decisions import RequestFacts
from slotlogic.server import ServerInfo, parse_slots, work_left
from slotlogic.settings import Settings
from tests.conftest import UP, FakeLlama, chat


def _upstream(tmp_path, fake: FakeLlama) -> Upstream:
    return Upstream(UP, Settings(probe_interval=0), tmp_path / "state", [].append, client=fake)


async def _place(up: Upstream, i: int) -> int | None:
    body = json.dumps(chat(f"task {i}", system=f"agent {i} " * 8)).encode()
    pin = await up.decide(RequestFacts("POST", "/v1/chat/completions", (), body, time.time()), f"f{i}")
    return pin.ticket.slot if pin.ticket is not None else None


@pytest.mark.timeout(60)
async def test_a_props_slot_count_of_a_hundred_million_sizes_nothing_and_the_request_is_served(tmp_path):
    fake = FakeLlama()
    assert fake.props_data is not None
    fake.props_data["total_slots"] = 100_000_000
    fake.slots_data = None   # `/slots` off: nothing else says how many slots there are
    up = _upstream(tmp_path, fake)
    tracemalloc.start()
    try:
        t0 = time.monotonic()
        slots = [await _place(up, i) for i in range(3)]
        status = await up.status()
        took = time.monotonic() - t0
        held, _ = tracemalloc.get_traced_memory()  # the peak counts the state read's 64 MB buffer, never touched
    finally:
        tracemalloc.stop()
    assert all(s is not None and 0 <= s < numbers.MAX_SLOTS for s in slots), slots
    assert len(set(slots)) == 3 and len(status["slots"]) == numbers.MAX_SLOTS, len(status["slots"])
    assert held < 8 << 20 and took < 10, (held >> 20, took)


def test_every_props_and_slots_number_is_checked_where_it_enters():
    props = {"total_slots": 10**8, "default_generation_settings": {"n_ctx": float("inf")}}
    info = ServerInfo.parse(props)
    assert info is not None and info.total_slots == numbers.MAX_SLOTS and info.n_ctx is None
    for bad in (0, -3, 2.0, True, "4", float("nan"), None):
        assert ServerInfo.parse({"total_slots": bad}) is None, bad
    assert ServerInfo.parse({"total_slots": 4, "default_generation_settings": {"n_ctx": -1}}).n_ctx is None
    live = parse_slots([{"id": 10**8}, {"id": -1}, {"id": True}, {"id": 1.0}, {"id": 0, "n_prompt_tokens": 10**400},
                        {"id": 0, "n_prompt_tokens": 5}, {"id": 1, "n_ctx": -5, "n_prompt_tokens": 7}])
    assert live == [{"id": 0}, {"id": 1, "n_prompt_tokens": 7}], live
    assert len(parse_slots([{"id": i} for i in range(5000)]) or []) == numbers.MAX_SLOTS
    busy = {"id": 0, "is_processing": True, "next_token": [{"n_decoded": 3, "n_remain": 10**400}]}
    assert work_left(busy, 2.0) is None   # 10**400 tokens times a float: an OverflowError before


def test_an_infinite_or_absurd_speed_is_not_said():
    inf = observe_json(b'{"timings":{"prompt_per_second":1e400,"predicted_per_second":1e400,"predicted_n":9,'
                       b'"prompt_n":500,"cache_n":-4},"id_slot":100000000}')
    assert inf.prompt_per_second is None and inf.decode_per_second is None
    assert inf.prompt_n == 500 and inf.cache_n is None and inf.id_slot is None
    tiny = observe_json(b'{"timings":{"prompt_per_second":1e-300,"prompt_n":500,"cache_n":0}}')
    assert tiny.prompt_per_second is None
    s = StreamObserver()
    s.feed(b'data: {"timings":{"prompt_per_second":NaN,"prompt_n":100,"cache_n":0}}\n\n')
    assert s.obs.prompt_per_second is None and s.obs.prompt_n == 100
    assert SlotFileAnswer.parse("restore", {"n_restored": 100, "n_read": 10**6,
                                            "timings": {"restore_ms": float("inf")}}) is None
    assert SlotFileAnswer.parse("save", {"n_saved": 10**400, "n_written": 10**6, "timings": {"save_ms": 1}}) is None
    speeds = Speeds()
    speeds.decode(float("inf"))
    speeds.prefill(500, 0, float("inf"))
    assert speeds.decode_tps is None and speeds.fit.n == 0


async def test_one_answer_with_prompt_per_second_1e400_leaves_the_estimates_and_the_status_finite(tmp_path):
    up = _upstream(tmp_path, FakeLlama())
    answers = [b'{"timings":{"prompt_per_second":1e400,"prompt_n":500,"cache_n":0}}'] + [
        b'{"timings":{"prompt_per_second":%d,"prompt_n":%d,"cache_n":0}}' % (900 + i, 300 + 100 * i)
        for i in range(4)]
    for i, raw in enumerate(answers):
        body = json.dumps(chat(f"task {i}", system=f"agent {i} " * 8)).encode()
        pin = await up.decide(RequestFacts("POST", "/v1/chat/completions", (), body, time.time()), f"f{i}")
        up.answered(pin.ticket, observe_json(raw), path="/v1/chat/completions", seconds=0.5)
    estimate = up.keeper.prefill_estimate()
    assert estimate is not None and 900 <= estimate <= 904, estimate
    status = await up.status()
    json.dumps(status, allow_nan=False)   # JSON: no NaN, no Infinity
    assert status["speeds"]["prefill_tok_s"] is not None and math.isfinite(status["speeds"]["prefill_tok_s"])


def test_the_status_answer_is_json_even_with_a_nan_left_in_it():
    body = reply(200, {"speeds": {"prefill_tok_s": float("nan"), "x": [float("inf"), 1.5]}}).content
    assert json.loads(body) == {"speeds": {"prefill_tok_s": None, "x": [None, 1.5]}}
    assert b"NaN" not in body and b"Infinity" not in body
