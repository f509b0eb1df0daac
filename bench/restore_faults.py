"""Stand-ins for llama-server builds whose slot restores answer but do not take, in front of a real llama-server.

Every request goes to the real server unchanged except `POST /slots/N?action=restore`:

- `noop` (llama.cpp #26676, open): the restore is sent, then the slot is erased before the answer comes back,
  so the answer carries the real `n_restored`/`n_read`/timings and the next request on the slot finds nothing.
  Where it differs from the bug: `/slots` shows the slot empty, where the broken builds show the restored
  tokens (the proxy does not read `/slots` after a restore, so it sees the same).
- `no_checkpoints` (PRs #24956/#26004, open): the file is restored without the context checkpoints the test
  build appends to it (the block from the `SCKP` magic on, `docs/model-capability.md`), as upstream builds
  write them: a copy cut there is restored instead and deleted. On a sliding-window or hybrid model the real
  server then prefills a prompt that steps back at all from zero ("forcing full prompt re-processing"),
  which is the bug itself, shown by the real server; the answer names the original file.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx

from slotkeeper.launch.mitmdump import free_port

HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"}
MAGIC = b"SCKP"


class RestoreFault:
    def __init__(self, upstream: str, mode: str, save_dir: Path) -> None:
        assert mode in ("noop", "no_checkpoints", "pass")
        self.upstream, self.mode, self.save_dir = upstream, mode, save_dir
        self.restores: list[tuple[int, int, float]] = []  # (slot, n_restored, when) of each restore answered 200
        self.client = httpx.Client(base_url=upstream, timeout=600)
        self.lock = threading.Lock()
        self.port = free_port()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> RestoreFault:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.client.close()

    def forward(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
        return self.client.request(method, path, content=body or None, headers=headers)

    def restore(self, path: str, slot: int, body: bytes, headers: dict[str, str]) -> httpx.Response:
        """The restore as the broken build does it."""
        if self.mode == "no_checkpoints":
            name = json.loads(body)["filename"]
            data = (self.save_dir / name).read_bytes()
            cut = data.find(MAGIC)
            copy = self.save_dir / f"nockp-{name}"
            copy.write_bytes(data[:cut] if cut > 0 else data)
            try:
                r = self.client.post(path, json={"filename": copy.name})
            finally:
                copy.unlink(missing_ok=True)
            answer = r.json() if r.status_code == 200 else None
            if isinstance(answer, dict):
                answer["filename"] = name
                return httpx.Response(200, json=answer)
            return r
        r = self.forward("POST", path, body, headers)
        if self.mode == "noop" and r.status_code == 200:
            self.client.post(f"/slots/{slot}?action=erase")
        return r

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fault = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def _do(self, method: str) -> None:
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n) if n else b""
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP | {"host"}}
                parts = urlsplit(self.path)
                action = parse_qs(parts.query).get("action", [""])[0]
                if method == "POST" and action == "restore" and fault.mode != "pass":
                    slot = int(parts.path.rstrip("/").rsplit("/", 1)[1])
                    r = fault.restore(self.path, slot, body, headers)
                else:
                    r = fault.forward(method, self.path, body, headers)
                if method == "POST" and action == "restore" and r.status_code == 200:
                    with fault.lock:
                        fault.restores.append((int(parts.path.rsplit("/", 1)[1]), r.json().get("n_restored", 0),
                                               time.time()))
                out = r.content
                self.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() not in HOP:
                        self.send_header(k, v)
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def do_GET(self) -> None:
                self._do("GET")

            def do_POST(self) -> None:
                self._do("POST")

        return Handler
