"""A mitmproxy addon that does nothing: the baseline for the slotkeeper addon's own per-request cost.

Loaded with `mitmdump -s bench/noop_addon.py`. Its `request` hook is async, like slotkeeper's, so mitmproxy's
async hook dispatch is in the baseline too and the measured delta is the addon's own work.
"""

from __future__ import annotations

from typing import Any


class Noop:
    async def request(self, flow: Any) -> None:
        return None


addons = [Noop()]
