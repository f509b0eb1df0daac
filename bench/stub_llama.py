"""A llama-server stand-in for fault injection (`python -m bench.stub_llama --port N [faults]`, or in process).

Why: some faults cannot be produced on a real server on demand: `/slots` hanging while the main loop is
wedged (llama.cpp issue #27388), a server that answers slowly, one that records exactly what the proxy sent
(the API key on its own calls, the warm-up bodies). It speaks just enough HTTP/1.1 (keep-alive,
Content-Length or chunked request bodies) and answers like llama-server: `/props`, `/slots` (or 501),
`/health`, slot actions (or 501 without a save path), chat completions as JSON or SSE, and 401 for a
missing key when `api_key` is set (`/health` stays public, as upstream).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class StubLlama:
    slots: int = 4
    n_ctx: int = 8192
    api_key: str | None = None
    slots_delay: float = 0.0       # seconds before /slots answers (a hang when longer than the proxy's timeout)
    props_delay: float = 0.0
    no_slots: bool = False         # --no-slots: /slots answers 501
    no_save_path: bool = False     # no --slot-save-path: slot actions answer 501
    save_dir: str | None = None    # write slot files here (never through a symlink: a refused save answers 500)
    chat_delay: float = 0.0        # seconds a completion "prefills"
    tokens: dict[int, int] = field(default_factory=dict)  # per slot: what a save would write
    marker: str = "<__media_stub__>"
    model_path: str = "/stub.gguf"  # what /props names (a FIFO there: the proxy's model check must not hang on it)
    new_marker: bool = False        # a new media_marker on every /props: the server "restarted" each probe
    seen: list[Seen] = field(default_factory=list)
    port: int = 0
    host: str = "127.0.0.1"        # "::1": an IPv6 server (its URL in brackets)
    _server: asyncio.AbstractServer | None = None

    @property
    def url(self) -> str:
        return f"http://[{self.host}]:{self.port}" if ":" in self.host else f"http://{self.host}:{self.port}"

    def props(self) -> dict[str, Any]:
        if self.new_marker:
            self.marker = f"<__media_{os.urandom(4).hex()}__>"
        return {"total_slots": self.slots, "media_marker": self.marker, "build_info": "b0-stub",
                "model_path": self.model_path, "default_generation_settings": {"n_ctx": self.n_ctx}}

    async def start(self) -> StubLlama:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1)

    def _authorised(self, headers: dict[str, str]) -> bool:
        if self.api_key is None:
            return True
        return headers.get("authorization") == f"Bearer {self.api_key}" or headers.get("x-api-key") == self.api_key

    async def _answer(self, method: str, target: str, headers: dict[str, str], body: bytes
                      ) -> tuple[int, str, bytes]:
        path = target.split("?", 1)[0]
        if path == "/health":
            return 200, "application/json", b'{"status":"ok"}'
        if not self._authorised(headers):
            return 401, "application/json", json.dumps({"error": {"code": 401, "message": "Invalid API Key",
                                                                  "type": "authentication_error"}}).encode()
        if method == "GET" and path == "/props":
            await asyncio.sleep(self.props_delay)
            return 200, "application/json", json.dumps(self.props()).encode()
        if method == "GET" and path == "/slots":
            if self.no_slots:
                return 501, "application/json", b'{"error":{"code":501,"type":"not_supported_error"}}'
            await asyncio.sleep(self.slots_delay)
            return 200, "application/json", json.dumps(
                [{"id": i, "n_ctx": self.n_ctx, "is_processing": False, "n_prompt_tokens": self.tokens.get(i, 0)}
                 for i in range(self.slots)]).encode()
        if method == "POST" and path.startswith("/slots/"):
            if self.no_save_path:
                return 501, "application/json", b'{"error":{"code":501,"type":"not_supported_error"}}'
            action = target.split("action=", 1)[-1]
            slot = int(path.split("/")[2])
            name = str(json.loads(body or b"{}").get("filename", ""))
            return self._slot_action(slot, action, name)
        if method == "POST" and path in ("/v1/chat/completions", "/chat/completions", "/completion"):
            try:
                req = json.loads(body)
            except (ValueError, RecursionError):
                return 400, "application/json", b'{"error":{"code":400,"type":"invalid_request_error"}}'
            slot = req.get("id_slot") if isinstance(req, dict) else None
            await asyncio.sleep(self.chat_delay)
            n = len(body) // 4
            had = self.tokens.get(slot if isinstance(slot, int) else 0, 0)
            self.tokens[slot if isinstance(slot, int) else 0] = n
            timings = {"cache_n": min(had, n), "prompt_n": max(n - had, 1), "prompt_per_second": 1000.0}
            if isinstance(req, dict) and req.get("stream"):
                events = [{"choices": [{"delta": {"content": "ok"}}]},
                          {"choices": [], "timings": timings, "id_slot": slot}]
                sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
                return 200, "text/event-stream", sse.encode()
            return 200, "application/json", json.dumps(
                {"choices": [{"message": {"role": "assistant", "content": "ok"}}], "timings": timings,
                 "id_slot": slot}).encode()
        return 404, "application/json", b'{"error":{"code":404,"type":"not_found_error"}}'

    def _slot_action(self, slot: int, action: str, name: str) -> tuple[int, str, bytes]:
        ok = "application/json"
        if action == "erase":
            self.tokens[slot] = 0
            return 200, ok, json.dumps({"id_slot": slot, "n_erased": 0}).encode()
        if self.save_dir is None or not name or "/" in name or ".." in name:
            return 400, ok, b'{"error":{"code":400,"type":"invalid_request_error"}}'
        path = os.path.join(self.save_dir, name)
        try:
            if action == "save":
                n = self.tokens.get(slot, 0)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
                with os.fdopen(fd, "wb") as f:
                    f.write(n.to_bytes(8, "little") + bytes(4088))
                return 200, ok, json.dumps({"id_slot": slot, "n_saved": n, "n_written": 4096}).encode()
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
            self.tokens[slot] = n
            return 200, ok, json.dumps({"id_slot": slot, "n_restored": n, "n_read": 4096}).encode()
        except OSError:
            return (500 if action == "save" else 400), ok, b'{"error":{"code":400,"type":"invalid_request_error"}}'

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
                body = b""
                if headers.get("transfer-encoding", "").lower() == "chunked":
                    while True:
                        size = int((await reader.readuntil(b"\r\n")).strip().split(b";")[0], 16)
                        chunk = await reader.readexactly(size + 2)
                        if size == 0:
                            break
                        body += chunk[:-2]
                elif headers.get("content-length"):
                    body = await reader.readexactly(int(headers["content-length"]))
                self.seen.append(Seen(method, target, headers, body))
                status, ctype, payload = await self._answer(method, target, headers, body)
                writer.write((f"HTTP/1.1 {status} X\r\nServer: llama.cpp\r\nContent-Type: {ctype}\r\n"
                              f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, asyncio.LimitOverrunError,
                asyncio.CancelledError):  # a client gone, or the stub shutting down
            pass
        finally:
            writer.close()


async def serve(stub: StubLlama) -> None:
    await stub.start()
    print(f"stub llama-server listening on {stub.url}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--api-key")
    ap.add_argument("--slots-delay", type=float, default=0.0)
    ap.add_argument("--no-slots", action="store_true")
    ap.add_argument("--no-save-path", action="store_true")
    ap.add_argument("--save-dir")
    ap.add_argument("--chat-delay", type=float, default=0.0)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--model-path", default="/stub.gguf")
    ap.add_argument("--new-marker", action="store_true")
    a = ap.parse_args()
    asyncio.run(serve(StubLlama(slots=a.slots, api_key=a.api_key, slots_delay=a.slots_delay, no_slots=a.no_slots,
                                no_save_path=a.no_save_path, save_dir=a.save_dir, chat_delay=a.chat_delay,
                                port=a.port, host=a.host, model_path=a.model_path, new_marker=a.new_marker)))


if __name__ == "__main__":
    main()
