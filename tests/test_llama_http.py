"""The llama-server client: every failure is a None or a status 0, never an exception."""

from __future__ import annotations

import asyncio
import json

import pytest

from slotkeeper.drivers.llama_http import LlamaClient


@pytest.fixture
async def server():
    """A stub that answers by path: /props hangs, /slots is not JSON, anything POSTed is echoed back."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        path = head.split(" ")[1]
        length = int(next((ln.split(":")[1] for ln in head.split("\r\n") if ln.lower().startswith("content-length")),
                          "0"))
        body = await reader.readexactly(length) if length else b""
        if path == "/props":
            await asyncio.sleep(5)
        payload = b"not json" if path == "/slots" else body
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload))
        await writer.drain()
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    srv.close()


async def test_failures_are_none_or_status_zero(server):
    client = LlamaClient(server, timeout=0.3)
    assert await client.props() is None  # timed out
    assert await client.slots() is None  # not JSON
    assert await LlamaClient("http://127.0.0.1:9").post_json("/x", {}, 0.5) == (0, None)  # refused
    await client.aclose()


async def test_a_lone_surrogate_in_a_body_is_sent_escaped_not_raised(server):
    client = LlamaClient(server)
    status, echoed = await client.post_json("/v1/chat/completions", {"content": "x \ud800"}, 2.0)
    assert status == 200 and echoed == json.loads('{"content": "x \\ud800"}')
    await client.aclose()
