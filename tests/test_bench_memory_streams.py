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


def test_a_lock_taken_again_is_no_leak_and_a_lock_that_stays_is():
    """The redis-deep attack's check: a lock seen once (a background flush's) is not left behind; one whose
    holder token stays is."""
    import threading
    import time

    import redis

    from bench.memory_bounds_streams import stuck_locks
    from tests.redis_fixtures import new_redis

    with new_redis() as server:
        r = redis.Redis(port=server.port)
        r.set("a:lock", b"token-1")                     # held briefly, then taken again by another holder
        r.set("b:lock", b"token-2")                     # never let go
        threading.Timer(0.3, lambda: r.set("a:lock", b"token-3")).start()
        threading.Timer(0.6, lambda: r.delete("a:lock")).start()
        t0 = time.monotonic()
        assert stuck_locks(r, wait=1.0) == [b"b:lock"] and time.monotonic() - t0 >= 1.0
        r.delete("b:lock")
        assert stuck_locks(r, wait=1.0) == []
