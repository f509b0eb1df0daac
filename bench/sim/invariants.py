"""What must hold between the proxy's belief and the simulated slots whenever no request is in flight.

Two beliefs are checked. The session table (`SessionTable.holders`: the session whose answer completed on a slot
last, and `live`/`displaced`): a live, undisplaced holder's slot must still hold all that session left there.
The slot ledger (`Ledger.view()`: per slot an entry with `epoch`, `owner`, `tokens`): an entry's owner
must find at least `tokens` of its conversation in the slot, and epochs never go back. And the loss meter
(`Report.loss`): every unlabelled loss of the ground truth must have been metered. Expected changes the proxy
cannot know yet (a restart, unified-KV idle clearing) are not violations.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from bench.sim.harness import Rig
from bench.sim.llama import common_prefix
from bench.sim.losses import find_losses

TOLERANCE = 1  # the server evaluates the last prompt token again: a full hit reuses n-1


@dataclass
class Checker:
    rig: Rig
    epochs: dict[tuple[int, str, int], int] = field(default_factory=dict)

    def tags(self) -> dict[str, str]:
        return {o.meta["session"]: o.tag for o in self.rig.outcomes if o.meta.get("session")}

    def tag_on(self, key: str, url: str, slot: int, tags: dict[str, str]) -> str | None:
        """The tag of `key`'s last request that ran on `slot` of `url`, else its last anywhere. A session's tags
        are one; a side call's home has one per call, and its calls share a prompt, not a conversation (the pool
        sends each to the least loaded server): a slot holding an earlier call holds that call, not the newest."""
        for o in reversed(self.rig.outcomes):
            if o.meta.get("session") == key and o.server == url and o.done is not None and o.done.slot == slot:
                return o.tag
        return tags.get(key)

    def last_end(self, tag: str) -> float:
        return max((o.done.ended for o in self.rig.outcomes if o.tag == tag and o.done is not None), default=0.0)

    def violations(self) -> list[str]:
        """Everything that disagrees now (call between steps, with no request in flight)."""
        out: list[str] = []
        tags = self.tags()
        now = time.time()
        for pi, proxy in enumerate(self.rig.proxies):
            for url, up in proxy.rt.upstreams.items():
                sim = self.rig.servers.get(url)
                if sim is None:
                    continue
                out += self._table(pi, url, up, sim, tags, now)
                out += self._ledger(pi, url, up, sim, tags)
        out += self._meter()
        return out

    def _excused(self, sim: Any, tag: str) -> bool:
        end = self.last_end(tag)
        return self.rig.setup.unified or any(t >= end for t in sim.restarts)

    def _table(self, pi: int, url: str, up: Any, sim: Any, tags: dict[str, str], now: float) -> list[str]:
        out = []
        table = up.keeper.table
        for slot, key in table.holders.items():
            a = table.live(key, now)
            tag = tags.get(key)
            if a is None or a.slot != slot or table.displaced(key, slot) or tag is None or slot >= len(sim.slots):
                continue
            left = sim.left.get(tag)
            if not left or self._excused(sim, tag):
                continue
            held = common_prefix(sim.slots[slot].tokens, left)
            if held + TOLERANCE < len(left):
                out.append(f"proxy {pi} believes {tag} holds slot {slot} of {url}, which holds {held} of its "
                           f"{len(left)} tokens (last written by {sim.slots[slot].writer or 'the proxy'})")
        return out

    def _ledger(self, pi: int, url: str, up: Any, sim: Any, tags: dict[str, str]) -> list[str]:
        out = []
        view = up.keeper.turns.ledger.view()
        items = view.items() if isinstance(view, dict) else enumerate(view)
        for slot, entry in items:
            epoch = getattr(entry, "epoch", None)
            if isinstance(epoch, int):
                before = self.epochs.get((pi, url, slot), epoch)
                if epoch < before:
                    out.append(f"proxy {pi} slot {slot} of {url}: epoch went back {before} -> {epoch}")
                self.epochs[(pi, url, slot)] = epoch
            owner, tokens = getattr(entry, "owner", None), getattr(entry, "tokens", None) or 0
            tag = self.tag_on(owner, url, slot, tags) if owner and isinstance(slot, int) else None
            if tag is None or not isinstance(slot, int) or slot >= len(sim.slots) or self._excused(sim, tag):
                continue
            held = common_prefix(sim.slots[slot].tokens, sim.left.get(tag, []))
            if held + TOLERANCE < tokens:
                out.append(f"proxy {pi}'s ledger: slot {slot} of {url} holds {tokens} tokens of {tag}; "
                           f"the slot holds {held}")
        return out

    def _meter(self) -> list[str]:
        """Every unlabelled loss of the ground truth was metered (`Report.loss`), once the meter exists."""
        by_tag_slot = {(o.tag, o.done.task): o for o in self.rig.outcomes if o.done is not None}
        out = []
        for loss in find_losses(self.rig):
            if loss.labelled:
                continue
            o = next((x for (tag, _), x in by_tag_slot.items() if tag == loss.tag and x.done is not None
                      and x.done.slot == loss.slot and x.done.cache_n == loss.cache_n), None)
            if o is None or o.report is None:
                continue
            metered = getattr(o.report.loss, "tokens", 0) if o.report.loss is not None else 0
            if metered + TOLERANCE < loss.tokens:
                out.append(f"{loss.line()}: metered {metered}")
        return out
