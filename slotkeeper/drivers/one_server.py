"""The router of a request that has one server to go to (one `--mode reverse:` upstream, a regular-mode
upstream, a saved flow): the same interface as `slotkeeper.drivers.pool.Pool`, so the pinning addon has one
path for one server and for several. Nothing to choose: the server's own `Upstream` decides and performs."""

from __future__ import annotations

from slotkeeper.drivers.upstream import Upstream
from slotlogic.decisions import Decision, RequestFacts


class OneServer:
    retries = False  # nowhere else to send a request that could not reach its server

    def __init__(self, upstream: Upstream) -> None:
        self.server: Upstream | None = upstream  # the request's server, known before anything is decided

    async def decide(self, facts: RequestFacts, flow_id: str) -> tuple[Upstream, Decision]:
        assert self.server is not None
        return self.server, await self.server.decide(facts, flow_id)

    def destination(self, up: Upstream) -> str | None:
        """The address the request is sent to when it is not the one the client named: none here."""
        return None
