"""A trivial, fast llama-server stand-in for measuring proxy overhead (`python -m bench.fake_upstream`).

Why: against a real model the proxy's ~1 ms disappears in prefill noise. This upstream answers in
microseconds so the measured difference is the proxy. It speaks just enough HTTP/1.1 (keep-alive,
Content-Length bodies) and sets TCP_NODELAY and writes each response in one `write`, which avoids the
40 ms Nagle/delayed-ACK stall that would otherwise dominate (docs/mitmproxy.md).
It runs as a subprocess so its event loop does not compete with the client for the GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket

PROPS = {"total_slots": 4, "media_marker": "<__media_x__>", "build_info": "b0", "model_path": "/m.gguf",
         "default_generation_settings": {"n_ctx": 8192}}
SLOTS = [{"id": i, "n_ctx": 8192, "is_processing": False, "n_prompt_tokens": 0} for i in range(4)]
CHAT = {"id": "chatcmpl-bench", "object": "chat.completion", "created": 0, "model": "smollm2",
        "system_fingerprint": "b0",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],
        "usage": {"completion_tokens": 1, "prompt_tokens": 12, "total_tokens": 13,
                  "prompt_tokens_details": {"cached_tokens": 10}},
        "timings": {"cache_n": 10, "prompt_n": 2, "prompt_ms": 0.1, "predicted_n": 1, "predicted_ms": 0.1}}

ROUTES: dict[tuple[str, str], tuple[int, bytes]] = {
    ("GET", "/props"): (200, json.dumps(PROPS).encode()),
    ("GET", "/slots"): (200, json.dumps(SLOTS).encode()),
    ("GET", "/health"): (200, b'{"status":"ok"}'),
    ("POST", "/v1/chat/completions"): (200, json.dumps(CHAT).encode()),
}
NOT_FOUND = (404, b'{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}')


def response(method: str, target: str) -> bytes:
    status, body = ROUTES.get((method, target.split("?", 1)[0]), NOT_FOUND)
    reason = "OK" if status == 200 else "Not Found"
    head = (f"HTTP/1.1 {status} {reason}\r\nServer: llama.cpp\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nKeep-Alive: timeout=5, max=100000\r\n\r\n")
    return head.encode() + body


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, v in
                       (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
            length = int(headers.get("content-length", "0"))
            if length:
                await reader.readexactly(length)
            writer.write(response(method, target))
            await writer.drain()
            if headers.get("connection", "").lower() == "close":
                break
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def serve(port: int) -> None:
    server = await asyncio.start_server(handle, "127.0.0.1", port)
    print(f"fake upstream listening on 127.0.0.1:{port}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    asyncio.run(serve(ap.parse_args().port))


if __name__ == "__main__":
    main()
