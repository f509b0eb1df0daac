"""The cache-mode probe: whether a server clears idle slots (`slotlogic.server.CacheMode`), which neither
`/props` nor `/slots` says (docs/llama-server.md). Two one-token `/completion` requests pinned to slots
`slotlogic.server.cache_probe_slots` chose, and `/slots` read around the second; what it shows is
`slotlogic.server.cache_mode_seen`'s to judge."""

from __future__ import annotations

from slotkeeper.drivers.llama_http import LlamaClient
from slotlogic.server import CacheMode, cache_mode_seen, cache_probe_slots

TIMEOUT = 30.0  # seconds for one one-token request (a loaded server queues it behind a batch)


async def probe(client: LlamaClient) -> CacheMode | None:
    """The server's cache mode; None when it cannot be told now (no `/slots`, no free pair of slots, other
    traffic on the witness, an error)."""
    live = await client.slots()
    plan = cache_probe_slots(live) if live is not None else None
    if plan is None:
        return None
    witness, trigger, fill = plan
    if fill and not await _one_token(client, witness):
        return None
    before = await client.slots()
    if before is None or not await _one_token(client, trigger):
        return None
    after = await client.slots()
    return cache_mode_seen(witness, before, after) if after is not None else None


async def _one_token(client: LlamaClient, slot: int) -> bool:
    body = {"prompt": "ok", "n_predict": 1, "id_slot": slot, "cache_prompt": True}
    status, _ = await client.post_json("/completion", body, TIMEOUT)
    return status == 200
