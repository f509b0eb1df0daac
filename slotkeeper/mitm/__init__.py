"""slotkeeper's mitmproxy side: the addons `addon.py` lists, one concern each, and the flow adapters.

- `pinning`:    options of the core, the request/response hooks that pin and observe;
- `flowview`:   the answer's `x-slot-*` headers, the mitmweb comment and marker;
- `requestlog`: the line per request, the JSONL file, the summary at shutdown;
- `localapi`:   `GET /_slots/health|status`;
- `commands`:   `slots.status|release|pin|cleanup`;
- `runtime`:    what they share; `flows`: flow ⇄ facts; `sse_tap`: the stream callable.
"""
