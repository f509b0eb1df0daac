"""A mitmproxy addon that does nothing: the baseline for the slotkeeper addon's own per-request cost.

Loaded with `mitmdump -s bench/noop_addon.py`. It defines the same hooks as slotkeeper (an async `request`,
sync `responseheaders`/`response`/`error`), so mitmproxy's hook dispatch is in the baseline too and the
measured delta is the addon's own work.
"""

from __future__ import annotations

from typing import Any


class Noop:
    async def request(self, flow: Any) -> None:
        return None

    def responseheaders(self, flow: Any) -> None:
        return None

    def response(self, flow: Any) -> None:
        return None

    def error(self, flow: Any) -> None:
        return None


addons = [Noop()]
