"""The simulated server behind httpx: `transport(server)` is an `httpx.MockTransport` that answers the real
drivers' calls (`slotkeeper.drivers.llama_http.LlamaClient(url, transport=...)`) from a `SimServer`, as llama-server's
HTTP routes would: `/health`, `/props`, `/slots`, `POST /slots/{id}?action=save|restore|erase` and the
completion routes (non-streamed: the drivers never stream). A restart while a call waits is a dropped
connection (`httpx.ReadError`); a stall (`Rig.stall`) makes `/props` and `/slots` time out, as a
llama-server's did on a loaded machine (bench mix-4 on 2 cores)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from bench.sim.llama import Down, SimServer, answer_body

META_TIMEOUT = 3.0  # slotkeeper.drivers.llama_http's time-out for `/props` and `/slots`


def _error(status: int, message: str) -> httpx.Response:
    return _json(status, {"error": {"code": status, "message": message, "type": "invalid_request_error"}})


def _json(status: int, data: Any) -> httpx.Response:
    return httpx.Response(status, content=json.dumps(data).encode(), headers={"content-type": "application/json"})


def transport(server: SimServer) -> httpx.MockTransport:
    async def handle(request: httpx.Request) -> httpx.Response:
        path, method = request.url.path, request.method
        if method == "GET":
            if path in ("/props", "/slots") and server.now() < server.meta_stalled_until:
                await asyncio.sleep(META_TIMEOUT)  # the proxy's own time-out for these, then the timeout itself
                raise httpx.ReadTimeout("the server answers past the time-out", request=request)
            if path == "/health":
                return _json(200, {"status": "ok"})
            if path == "/props":
                return _json(200, server.props())
            if path == "/slots":
                return _json(200, server.slots_view())
            return _json(404, {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}})
        try:
            body = json.loads(request.content) if request.content else {}
        except ValueError:
            return _json(500, {"error": {"code": 500, "message": "invalid JSON", "type": "server_error"}})
        try:
            if path.startswith("/slots/"):
                action = request.url.params.get("action", "")
                try:
                    slot = int(path.rsplit("/", 1)[1])
                except ValueError:
                    return _error(400, "Invalid slot")
                if not 0 <= slot < server.n_slots:
                    return _error(400, "Invalid slot ID")
                status, data = await server.action(slot, action, (body or {}).get("filename")).done
                return _json(status, data)
            if not isinstance(body, dict):
                return _error(400, "invalid body")
            result = await server.completion(path, body).done
        except Down as e:
            raise httpx.ReadError("server restarted", request=request) from e
        status, data = answer_body(path, result, body)
        return _json(status, data)

    return httpx.MockTransport(handle)
