"""The memory-bounds attack stub streams what each attack says, at the length it announces."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from bench.memory_bounds_streams import AttackStub, attack_body


@pytest.mark.parametrize("kind", ["sse-no-blank", "sse-long-line", "anthropic-long-line", "json-large"])
async def test_the_stub_streams_the_attack_whole(kind):
    stub = await AttackStub(kind=kind, mb=2).start()
    try:
        head, _, tail, n = attack_body(kind, 2)
        async with httpx.AsyncClient() as client:
            r = await client.post(stub.url + "/v1/chat/completions",
                                  json={"stream": True, "messages": [{"content": "attack-x"}]})
            props = await client.get(stub.url + "/props")
        assert r.status_code == 200 and len(r.content) == len(head) + n + len(tail) and n >= (2 << 20) - 64
        assert r.content.startswith(head) and r.content.endswith(tail)
        assert (b"\n\n" not in r.content[len(head):-len(tail)]) and props.json()["total_slots"] == 4
    finally:
        await asyncio.wait_for(stub.close(), 2)
