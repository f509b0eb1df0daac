"""The key the proxy's own calls to a server carry: `slots_api_key`, else the `Authorization` / `X-Api-Key`
header a client sent to that server (kept in memory only, never logged or stored)."""

from __future__ import annotations

from slotkeeper.drivers.llama_http import LlamaClient
from slotlogic.decisions import Fields

AUTH_HEADERS = (b"authorization", b"x-api-key")


class ServerAuth:
    def __init__(self, client: LlamaClient, api_key: str | None) -> None:
        self.client = client
        self.api_key = api_key
        self._from_client: tuple[str, str] | None = None   # a client's own key for this server (memory only)
        self._apply()

    def configure(self, api_key: str | None) -> None:
        self.api_key = api_key
        self._apply()

    def learn(self, fields: Fields) -> None:
        """Remember the API key a client sends to this server, for the proxy's own calls (slow path only)."""
        if self.api_key:
            return
        for k, v in fields:
            name = k.lower()
            if name in AUTH_HEADERS and v:
                found = (name.decode("latin-1"), v.decode("latin-1"))
                if found != self._from_client:
                    self._from_client = found
                    self._apply()
                return

    def _apply(self) -> None:
        key = self.api_key
        self.client.auth = ("authorization", f"Bearer {key}") if key else self._from_client
