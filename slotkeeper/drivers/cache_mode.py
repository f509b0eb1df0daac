"""The cache-mode probe: whether a server clears idle slots (`slotlogic.server.CacheMode`), which neither
`/props` nor `/slots` says (docs/llama-server.md). One or two one-token `/completion` requests pinned to slots
`Turns.mode_probe` chose and claimed (placements rank them busy meanwhile), and `/slots` read around the last;
what it shows is `slotlogic.server.cache_mode_seen`'s to judge. The slots it wrote are erased afterwards when the
server can (`--slot-save-path`: llama-server refuses slot actions without it), so the next request, the model
check's own probe and the `/v1/messages` probe find them empty as before."""

from __future__ import annotations

import asyncio
import contextlib

from slotkeeper.drivers.llama_http import LlamaClient
from slotlogic.ledger import Fence
from slotlogic.server import CacheMode, cache_mode_seen
from slotlogic.turns import Turns

TIMEOUT = 30.0  # seconds for one one-token request (a loaded server queues it behind a batch)
HOLD = 3.0      # seconds at most a request is held for the start-up probe


class Hold:
    """At start, on a server that may clear idle slots, new requests wait for its cache mode (pinned before it
    is known they would go into slots soon emptied: the bench's first request, sent as the proxy started, raced
    the probe and was pinned); at most `HOLD` s, and on any other server not at all (`on` stays False)."""

    def __init__(self) -> None:
        self.on = False
        self._over = asyncio.Event()

    def end(self) -> None:
        self.on = False
        self._over.set()

    async def wait(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._over.wait(), HOLD)


async def probe(client: LlamaClient, turns: Turns, *, erase: bool) -> CacheMode | None:
    """The server's cache mode; None when it cannot be told now (no `/slots`, no free pair of slots, other
    traffic on the witness, an error). `erase`: the server has a slot save path."""
    live = await client.slots()
    plan = turns.mode_probe(live) if live is not None else None
    if plan is None:
        return None
    witness, fences = plan
    written: set[int] = set()
    try:
        return await _look(client, witness, fences, written)
    finally:
        for fence in fences:
            erased = erase and fence.slot in written and turns.probe_may_write(fence) and \
                (await client.post_json(f"/slots/{fence.slot}?action=erase", None, TIMEOUT))[0] == 200
            turns.probe_done(fence, erased)


async def _look(client: LlamaClient, witness: int, fences: list[Fence], written: set[int]) -> CacheMode | None:
    """The witness filled (when it must be), `/slots`, the trigger's one token, `/slots` again."""
    trigger = fences[0].slot
    if len(fences) > 1 and not await _one_token(client, witness, written):
        return None
    before = await client.slots()
    if before is None or not await _one_token(client, trigger, written):
        return None
    after = await client.slots()
    return cache_mode_seen(witness, before, after) if after is not None else None


async def _one_token(client: LlamaClient, slot: int, written: set[int]) -> bool:
    written.add(slot)  # from the moment it is sent: a time-out may still have written it
    body = {"prompt": "ok", "n_predict": 1, "id_slot": slot, "cache_prompt": True}
    status, _ = await client.post_json("/completion", body, TIMEOUT)
    return status == 200
