"""The local API addon: `GET /_slots/` (the live slot page), `/_slots/health`, `/_slots/status` and
`/_slots/metrics` (Prometheus), answered by the proxy itself.

A `/_slots/` path never reaches llama-server. GET only, for the clients `slots_api_allow` admits, errors as
JSON, and only for its own host names (against DNS rebinding): reverse mode rewrites `Host` before any hook,
so the client's own is read from its connection's first request head (`next_layer`). Every answer carries a
strict content security policy. docs/reliability.md ("the local API").
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.resources
import ipaddress
import json
import re
from collections.abc import Sequence
from typing import Any

from mitmproxy import ctx, exceptions, http

from slotkeeper.mitm import metrics, options
from slotkeeper.mitm.options import Option
from slotkeeper.mitm.runtime import Runtime
from slotlogic import numbers

PREFIX = "/_slots/"
LOOPBACK = ("127.0.0.0/8", "::1/128")
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


OPTIONS = (
    Option("slots_api_allow", Sequence[str], list(LOOPBACK),
           "Client networks (CIDR) that may use the /_slots/ API; repeat --set to add. Default: loopback only."),
    Option("slots_api_hosts", Sequence[str], [],
           "Host names the /_slots/ API answers besides IP addresses, localhost and the listen host (e.g. this "
           "machine's DNS name when slots_api_allow admits other machines); repeat --set to add."),
)
HOST_LINE = re.compile(rb"\r\nhost:[ \t]*([^\r\n]{0,300})", re.IGNORECASE)
MAX_CONNECTIONS = 4096  # client connections whose Host is remembered (each forgotten when it closes)


class LocalApi:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.allowed: tuple[Network, ...] = tuple(ipaddress.ip_network(n) for n in LOOPBACK)
        self.names: frozenset[str] = frozenset()
        self.hosts: dict[str, str] = {}  # client connection id -> the Host of its first request (lower case)

    def load(self, loader: Any) -> None:
        options.add_options(loader, OPTIONS)

    def configure(self, updated: set[str]) -> None:
        if "slots_api_allow" in updated:
            try:
                self.allowed = tuple(ipaddress.ip_network(n.strip(), strict=False)
                                     for n in ctx.options.slots_api_allow if n.strip())
            except ValueError as e:
                raise exceptions.OptionsError(f"slots_api_allow: {e}") from None
        if "slots_api_hosts" in updated or "listen_host" in updated:
            self.names = frozenset(n.strip().lower().rstrip(".") for n in
                                   [*ctx.options.slots_api_hosts, ctx.options.listen_host] if n.strip())

    def next_layer(self, nextlayer: Any) -> None:
        """Remember the `Host` the client sent on its connection's first request (before mitmproxy's reverse
        mode rewrites it)."""
        client = nextlayer.context.client
        if client.id in self.hosts or len(self.hosts) >= MAX_CONNECTIONS:
            return
        data = nextlayer.data_client()
        head = data[:data.find(b"\r\n\r\n")] if b"\r\n\r\n" in data else b""
        found = HOST_LINE.search(head) if head else None
        if found:  # no Host at all (HTTP/1.0): not a browser's, the rewritten header stands
            self.hosts[client.id] = found.group(1).decode("latin-1").strip().lower()

    def client_disconnected(self, client: Any) -> None:
        self.hosts.pop(client.id, None)

    async def request(self, flow: http.HTTPFlow) -> None:
        if not flow.request.path.startswith(PREFIX) or flow.response is not None:
            return
        try:
            flow.response = await self._answer(flow)
        except Exception as e:  # never forwarded, never a traceback
            flow.response = reply(500, {"error": f"status unavailable ({type(e).__name__})"})
        flow.response.headers.update(SECURITY_HEADERS)

    async def _answer(self, flow: http.HTTPFlow) -> http.Response:
        if not self._admitted(flow):
            return reply(403, {"error": "the /_slots/ API answers loopback clients only (see slots_api_allow)"})
        if not self._own_host(flow):
            return reply(403, {"error": "the /_slots/ API answers its own host names only (see slots_api_hosts)"})
        if flow.request.method != "GET":
            return reply(405, {"error": "the /_slots/ API answers GET only"})
        path = flow.request.path.split("?", 1)[0]
        if path == PREFIX:
            return http.Response.make(200, page(), {"content-type": "text/html; charset=utf-8",
                                                    "cache-control": "no-store"})
        if path == "/_slots/health":
            return reply(200, {"ok": True})
        if path == "/_slots/metrics":
            return http.Response.make(200, metrics.render(self.rt), {"content-type": metrics.CONTENT_TYPE})
        if path == "/_slots/status":
            servers = [await up.status() for up in self.rt.upstreams.values()]
            return reply(200, self.rt.status(servers))
        return reply(404, {"error": "unknown slotkeeper endpoint"})

    def _own_host(self, flow: http.HTTPFlow) -> bool:
        """The `Host` the client sent names this proxy: an IP address, localhost, or a configured name."""
        host = self.hosts.get(flow.client_conn.id)
        return own_host(flow.request.host_header or "" if host is None else host, self.names)

    def _admitted(self, flow: http.HTTPFlow) -> bool:
        peer = flow.client_conn.peername
        if not peer:
            return False
        try:
            addr = ipaddress.ip_address(peer[0])
        except ValueError:
            return False
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        return any(addr in net for net in self.allowed)


def own_host(header: str, names: frozenset[str]) -> bool:
    """`host[:port]` is an IP address (no name a page could re-point), a loopback name, or one of `names`; no
    `Host` at all is no browser's (a browser always names the host it thinks it talks to)."""
    host = header.strip().lower()
    if not host:
        return True
    if host.startswith("["):
        host = host[1:host.find("]")] if "]" in host else ""
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    host = host.rstrip(".")
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    return host == "localhost" or host.endswith(".localhost") or host in names


@functools.cache
def page() -> bytes:
    """The slot page (`slotkeeper/mitm/page/slots.html`, package data), read once: later loads cost no disk access."""
    return importlib.resources.files("slotkeeper.mitm").joinpath("page/slots.html").read_bytes()


def script_hashes(html: bytes) -> str:
    """The CSP sources of the page's inline scripts: each by its SHA-256 (no other script can run)."""
    found = re.findall(rb"<script>(.*?)</script>", html, re.DOTALL)
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(s).digest()).decode()}'" for s in found)


SECURITY_HEADERS = {
    "content-security-policy": (f"default-src 'none'; script-src {script_hashes(page())}; style-src 'unsafe-inline'; "
                                "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
                                "frame-ancestors 'none'"),
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}


def reply(status: int, body: Any) -> http.Response:
    """`body` as JSON. JSON has no NaN or infinity (Python would write them, and the slot page could not parse
    the status then): one left in a figure is written as null."""
    try:
        text = json.dumps(body, indent=1, allow_nan=False)
    except ValueError:
        text = json.dumps(numbers.finite(body), indent=1, allow_nan=False)
    return http.Response.make(status, text, {"content-type": "application/json"})
