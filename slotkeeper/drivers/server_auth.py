"""The key the proxy's own calls to a server carry: `slots_api_key`, and nothing else.

Whose credentials pay for what: a client's `Authorization` / `X-Api-Key` goes with that client's own request
and nowhere else. The proxy's own calls (`/props`, `/slots`, slot save and restore, warm-ups, probes) serve every
client of the server (a page-out made for one session saves another's conversation; a probe serves all), so
they carry only the operator's key. A client's key is never borrowed for them: one client's wrong key would
fail every client's slot work, and a right one would make every client's work run under that client's
credentials. A server that wants a key and has none configured is answered unpinned or by the hash fallback;
the first client key seen for it says so in one line (`slots_api_key`)."""

from __future__ import annotations

from collections.abc import Callable

from slotkeeper.drivers.llama_http import LlamaClient
from slotlogic.decisions import Fields
from slotlogic.events import ApiKeyNotBorrowed, Event

AUTH_HEADERS = (b"authorization", b"x-api-key")


class ServerAuth:
    def __init__(self, client: LlamaClient, api_key: str | None, upstream: str = "",
                 emit: Callable[[Event], None] | None = None) -> None:
        self.client = client
        self.api_key = api_key
        self.upstream = upstream
        self.emit = emit
        self._told = False  # the one line about a client's key (once per server)
        self._apply()

    def configure(self, api_key: str | None) -> None:
        self.api_key = api_key
        self._apply()

    def learn(self, fields: Fields) -> None:
        """A client sent a key to this server with no `slots_api_key` set: say once that the proxy's own calls
        go without it (slow path only; the key itself is neither kept nor shown)."""
        if self.api_key or self._told or self.emit is None:
            return
        if any(k.lower() in AUTH_HEADERS and v for k, v in fields):
            self._told = True
            self.emit(ApiKeyNotBorrowed(self.upstream))

    def _apply(self) -> None:
        key = self.api_key
        self.client.auth = ("authorization", f"Bearer {key}") if key else None
