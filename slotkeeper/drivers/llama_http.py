"""The few llama-server calls slotkeeper makes, all off the hot path, over httpx.

Every call has a timeout (3 s for `/props` and `/slots`: `/slots` can hang while a big prompt is prefilled,
docs/llama-server.md) and returns None instead of raising when the server cannot be reached or answers
nonsense: the caller falls back, it never crashes. One `httpx.AsyncClient` per event loop: a client bound to
a loop that has closed cannot be used again (docs/mitmproxy.md). `auth` (set by the driver: `slots_api_key`
or a client's own key) goes with every call as a header; it is never logged (httpx's loggers stay at
WARNING, and nothing here puts a header or an exception's message anywhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any
from urllib.parse import unquote

import httpcore  # noqa: F401  (see below)
import httpx

from slotlogic.server import parse_slots

# httpx imports its transport (httpcore, and with it trio where that is installed) at its first client, and anyio
# its asyncio backend at the first connection: ~0.4 s of module loading. Done then, it ran on the event loop at
# the proxy's start, after it listened, and a client's first request waited for it; imported here, it is loaded
# with the addon, before mitmproxy listens.
with contextlib.suppress(ImportError):
    import anyio._backends._asyncio  # noqa: F401

logging.getLogger("httpx").setLevel(logging.WARNING)
logging.getLogger("httpcore").setLevel(logging.WARNING)

STATS_TIMEOUT = 3.0


class LlamaClient:
    def __init__(self, base_url: str, *, timeout: float = STATS_TIMEOUT,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.transport = transport  # None: the network; the simulator's in-process server (bench/sim) otherwise
        self._clients: dict[int, httpx.AsyncClient] = {}
        self.auth: tuple[str, str] | None = None  # (header name, value) for an --api-key server

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        out = dict(extra or {})
        if self.auth is not None:
            out[self.auth[0]] = self.auth[1]
        return out

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(id(loop))
        if client is None or client.is_closed:
            # No TLS is ever made to an http:// server, yet httpx would load the CA bundle into an SSL context
            # anyway: ~0.3 s of the event loop, at start-up, which a client's first request waited for.
            tls = self.base_url.startswith("https://")
            client = httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout, transport=self.transport,
                                       verify=tls)
            self._clients[id(loop)] = client
        return client

    async def get_json(self, path: str, timeout: float | None = None) -> Any | None:
        try:
            r = await self._client().get(path, timeout=timeout or self.timeout, headers=self._headers())
        except (httpx.HTTPError, OSError):
            return None
        if r.status_code != 200:
            return None
        try:
            return r.json()
        except ValueError:
            return None

    async def health(self, timeout: float = STATS_TIMEOUT) -> str:
        """`GET /health`: "ok", or why not: "refused" (no connection), "timeout", "health" (an answer other
        than 200: loading, or an error)."""
        try:
            r = await self._client().get("/health", timeout=timeout)
        except httpx.TimeoutException:
            return "timeout"
        except (httpx.HTTPError, OSError):
            return "refused"
        return "ok" if r.status_code == 200 else "health"

    async def props(self) -> dict[str, Any] | None:
        data = await self.get_json("/props")
        return data if isinstance(data, dict) else None

    async def slots(self) -> list[dict[str, Any]] | None:
        return parse_slots(await self.get_json("/slots"))

    async def poll_slots(self, timeout: float) -> tuple[bool, list[dict[str, Any]] | None]:
        """`/slots` for the first-token watch: (timed out, the slots). A timeout is its own answer there: the
        server is busy (it hangs `/slots` while it evaluates a big prompt)."""
        try:
            r = await self._client().get("/slots", timeout=timeout)
        except httpx.TimeoutException:
            return True, None
        except (httpx.HTTPError, OSError):
            return False, None
        if r.status_code != 200:
            return False, None
        try:
            return False, parse_slots(r.json())
        except ValueError:
            return False, None

    async def post_json(self, path: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, Any]:
        """POST and return (status, parsed JSON or None); status 0 when the server was unreachable."""
        # Serialised here, ASCII-escaped: a lone surrogate in a prompt must not raise inside httpx.
        raw = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
        try:
            r = await self._client().post(path, content=raw, timeout=timeout,
                                          headers=self._headers({"content-type": "application/json"}))
        except (httpx.HTTPError, OSError):
            return 0, None
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, None

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            with contextlib.suppress(RuntimeError):  # its loop is gone
                await c.aclose()


class ModelClient(LlamaClient):
    """One model of llama-server's router mode (`--models-dir`): the router runs each model in a process of its
    own and routes a GET by its `?model=` and a POST by the body's `model` (upstream tools/server/README.md,
    "Using multiple models"), so every call of the proxy's to that model names it."""

    def __init__(self, base_url: str, model: str, **kw: Any) -> None:
        super().__init__(base_url, **kw)
        self.model = model

    def _client(self) -> httpx.AsyncClient:
        client = super()._client()
        if self._name not in client.event_hooks["request"]:  # the path's own query stays (`?action=save`)
            client.event_hooks["request"].append(self._name)
        return client

    async def _name(self, request: httpx.Request) -> None:
        request.url = request.url.copy_merge_params({"model": self.model})

    async def post_json(self, path: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, Any]:
        return await super().post_json(path, {**(body or {}), "model": self.model}, timeout)


ROUTER_MODEL = "?model="  # a router model's server URL: the router's origin, then this and the quoted name


def client_for(url: str) -> LlamaClient:
    """The client of a server URL: a router model's (`<origin>?model=<name>`) names its model in every call."""
    base, sep, name = url.partition(ROUTER_MODEL)
    return ModelClient(base, unquote(name)) if sep and name else LlamaClient(url)

