"""A stand-in for llama-swap (which no registry this project installs from ships: not on PyPI, npm or in
Debian), modelled on its routes (llama-swap's internal/server/server.go and api.go):

- `POST /v1/chat/completions` (and the other model routes): the model named in the body, loaded on demand;
- `/upstream/<model>/<path>`: any request passed to that model's own server, loading it first;
- `GET /running`: `{"running": [{"model": ..., "state": "ready"}, ...]}`, the loaded models;
- `GET /v1/models`: `{"object": "list", "data": [{"id": ...}, ...]}`, the configured models;
- `GET /unload`: stops every model; `GET /health`: `OK`.

Each model is a real `LlamaServer` started when first needed, so an unloaded model comes back as a new
llama-server process (a new `media_marker`), as with llama-swap.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from bench.real.llama_server import LlamaServer
from slotkeeper.launch.mitmdump import free_port

MODEL_ROUTES = ("/v1/chat/completions", "/v1/completions", "/completion", "/v1/messages")


class SwapStub:
    def __init__(self, models: dict[str, dict[str, Any]]) -> None:
        self.specs = models
        self.loaded: dict[str, LlamaServer] = {}
        self.paths: list[str] = []
        self.loads = 0
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
                srv = self.loaded[name] = LlamaServer(**self.specs[name]).start()
                self.loads += 1
            return srv

    def unload(self) -> None:
        with self.lock:
            for srv in self.loaded.values():
                srv.stop()
            self.loaded.clear()

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

            def _forward(self, srv: LlamaServer, path: str, body: bytes | None) -> None:
                r = httpx.request(self.command, srv.url + path, content=body, timeout=300,
                                  headers={"content-type": "application/json"} if body else None)
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
                    return self._forward(stub.model(name), "/" + rest, body)
                if self.command == "POST" and path.split("?")[0] in MODEL_ROUTES:
                    try:
                        name = json.loads(body or b"{}").get("model")
                    except ValueError:
                        name = None
                    if name not in stub.specs:
                        return self._send(400, b'{"error":"could not find model"}')
                    return self._forward(stub.model(name), path, body)
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
