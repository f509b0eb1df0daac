"""A stand-in for llama-swap (which no registry this project installs from ships: not on PyPI, npm or in
Debian), modelled on its routes (llama-swap's internal/server/server.go and api.go):

- `POST /v1/chat/completions` (and the other model routes): the model named in the body, loaded on demand;
- `/upstream/<model>/<path>`: any request passed to that model's own server, loading it first;
- `GET /running`: `{"running": [{"model": ..., "state": "ready"}, ...]}`, the loaded models;
- `GET /v1/models`: `{"object": "list", "data": [{"id": ...}, ...]}`, the configured models;
- `GET /unload`: stops every model; `GET /health`: `OK`.

Each model is a real `LlamaServer` started when first needed, so an unloaded model comes back as a new
llama-server process (a new `media_marker`), as with llama-swap. `exclusive=True` is llama-swap's default
configuration (no `groups`: one model loaded at a time, docs/configuration.md "models will be hot swapped"):
loading one stops the others, once their requests in flight have ended (llama-swap's process stop waits for
them too). `together` lists models that stay loaded beside any other (a group with `swap: false`, or
`persistent`). Where it differs from llama-swap: no `ttl`, no `/api/...` routes, no `/logs`, no model aliases,
no `starting` state shown by `/running` (a load runs under the lock, so `/running` answers after it).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from bench.real.llama_server import LlamaServer
from slotkeeper.launch.mitmdump import free_port

MODEL_ROUTES = ("/v1/chat/completions", "/v1/completions", "/completion", "/v1/messages")


class SwapStub:
    def __init__(self, models: dict[str, dict[str, Any]], *, exclusive: bool = False,
                 together: frozenset[str] = frozenset()) -> None:
        self.specs = models
        self.exclusive = exclusive
        self.together = together
        self.loaded: dict[str, LlamaServer] = {}
        self.inflight: dict[str, int] = {}
        self.paths: list[str] = []
        self.loads = 0
        self.load_log: list[str] = []  # each model load, in order
        self.lock = threading.Lock()
        self.port = free_port()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def model(self, name: str) -> LlamaServer:
        with self.lock:
            srv = self.loaded.get(name)
            if srv is None:
                if self.exclusive and name not in self.together:
                    for other in [m for m in self.loaded if m not in self.together]:
                        self._stop(other)
                srv = self.loaded[name] = LlamaServer(**self.specs[name]).start()
                self.loads += 1
                self.load_log.append(name)
            self.inflight[name] = self.inflight.get(name, 0) + 1
            return srv

    def load(self, name: str) -> LlamaServer:
        """Load `name` as a request for it would (and swap others out), with no request left in flight."""
        srv = self.model(name)
        self.done(name)
        return srv

    def done(self, name: str) -> None:
        with self.lock:
            self.inflight[name] = max(0, self.inflight.get(name, 0) - 1)

    def _stop(self, name: str) -> None:
        deadline = time.monotonic() + 60
        while self.inflight.get(name, 0) and time.monotonic() < deadline:
            self.lock.release()  # the requests in flight end (and say so) while the swap waits
            time.sleep(0.02)
            self.lock.acquire()
        srv = self.loaded.pop(name, None)
        if srv is not None:
            srv.stop()

    def unload(self) -> None:
        with self.lock:
            for name in list(self.loaded):
                self._stop(name)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _forward(self, name: str, path: str, body: bytes | None) -> None:
                srv = stub.model(name)
                try:
                    r = httpx.request(self.command, srv.url + path, content=body, timeout=300,
                                      headers={"content-type": "application/json"} if body else None)
                finally:
                    stub.done(name)
                self._send(r.status_code, r.content, r.headers.get("content-type", "application/json"))

            def _handle(self) -> None:
                stub.paths.append(f"{self.command} {self.path}")
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else None
                path = self.path
                if path == "/health":
                    return self._send(200, b"OK", "text/plain")
                if path == "/running":
                    running = [{"model": m, "state": "ready"} for m in sorted(stub.loaded)]
                    return self._send(200, json.dumps({"running": running}).encode())
                if path == "/v1/models":  # llama-swap lists its configured models (not the loaded ones)
                    listed = [{"id": m, "object": "model", "owned_by": "llama-swap"} for m in sorted(stub.specs)]
                    return self._send(200, json.dumps({"object": "list", "data": listed}).encode())
                if path == "/unload":
                    stub.unload()
                    return self._send(200, b"OK", "text/plain")
                if path.startswith("/upstream/"):
                    name, _, rest = path[len("/upstream/"):].partition("/")
                    if name not in stub.specs:
                        return self._send(404, b"model not found", "text/plain")
                    return self._forward(name, "/" + rest, body)
                if self.command == "POST" and path.split("?")[0] in MODEL_ROUTES:
                    try:
                        name = json.loads(body or b"{}").get("model")
                    except ValueError:
                        name = None
                    if name not in stub.specs:
                        return self._send(400, b'{"error":"could not find model"}')
                    return self._forward(name, path, body)
                return self._send(404, b"not found", "text/plain")

            do_GET = do_POST = _handle

        return Handler

    def __enter__(self) -> SwapStub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.unload()
