"""The local API addon: `GET /_slots/` (the live slot page), `/_slots/health`, `/_slots/status` and
`/_slots/metrics` (Prometheus), answered by the proxy itself.

Any request whose path starts with `/_slots/` is ours and never reaches llama-server. Only GET is served
(anything else: 405), only to the clients `slots_api_allow` admits (loopback by default: the status names
sessions and servers), and every error is answered as JSON here, never forwarded.
"""

from __future__ import annotations

import functools
import importlib.resources
import ipaddress
import json
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
)


class LocalApi:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.allowed: tuple[Network, ...] = tuple(ipaddress.ip_network(n) for n in LOOPBACK)

    def load(self, loader: Any) -> None:
        options.add_options(loader, OPTIONS)

    def configure(self, updated: set[str]) -> None:
        if "slots_api_allow" in updated:
            try:
                self.allowed = tuple(ipaddress.ip_network(n.strip(), strict=False)
                                     for n in ctx.options.slots_api_allow if n.strip())
            except ValueError as e:
                raise exceptions.OptionsError(f"slots_api_allow: {e}") from None

    async def request(self, flow: http.HTTPFlow) -> None:
        if not flow.request.path.startswith(PREFIX) or flow.response is not None:
            return
        try:
            flow.response = await self._answer(flow)
        except Exception as e:  # never forwarded, never a traceback
            flow.response = reply(500, {"error": f"status unavailable ({type(e).__name__})"})

    async def _answer(self, flow: http.HTTPFlow) -> http.Response:
        if not self._admitted(flow):
            return reply(403, {"error": "the /_slots/ API answers loopback clients only (see slots_api_allow)"})
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


@functools.cache
def page() -> bytes:
    """The slot page (`slotkeeper/mitm/page/slots.html`, package data), read once: later loads cost no disk access."""
    return importlib.resources.files("slotkeeper.mitm").joinpath("page/slots.html").read_bytes()


def reply(status: int, body: Any) -> http.Response:
    """`body` as JSON. JSON has no NaN or infinity (Python would write them, and the slot page could not parse
    the status then): one left in a figure is written as null."""
    try:
        text = json.dumps(body, indent=1, allow_nan=False)
    except ValueError:
        text = json.dumps(numbers.finite(body), indent=1, allow_nan=False)
    return http.Response.make(status, text, {"content-type": "application/json"})
