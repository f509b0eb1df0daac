"""The round-4 attack stub answers each fault as the attack says, and never parses a large body."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from bench.memory_bounds_requests import NPROBS_ITEM, RequestStub


@pytest.mark.parametrize("kind", ["", "infinite-speed", "nprobs", "404"])
async def test_the_stub_answers_its_fault(kind):
    stub = await RequestStub(kind=kind, slots=100_000_000, no_slots=True).start()
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            props = (await client.get(stub.url + "/props")).json()
            slots = await client.get(stub.url + "/slots")
            tag = {"infinite-speed": "attack-speed", "nprobs": "attack-nprobs"}.get(kind, "plain")
            r = await client.post(stub.url + "/v1/chat/completions", json={"messages": [{"content": tag}]})
            big = await client.post(stub.url + "/v1/chat/completions",
                                    content=b'{"messages":[' + b",".join([b"{}"] * 500_000) + b"]}")
        assert props["total_slots"] == 100_000_000 and slots.status_code == 501
        if kind == "404":
            assert r.status_code == big.status_code == 404
            return
        assert r.status_code == big.status_code == 200
        if kind == "infinite-speed":
            assert b'"prompt_per_second":1e400' in r.content and json.loads(r.content)["timings"]["prompt_per_second"] \
                == float("inf")
        if kind == "nprobs":
            assert len(r.content) > (60 << 20) - len(NPROBS_ITEM)
            assert r.content.endswith(b'"prompt_per_second":1000.0}}')
    finally:
        await asyncio.wait_for(stub.close(), 2)
