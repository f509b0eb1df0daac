"""What every slot save and restore answer teaches: the server's save/restore throughput and KV bytes a token
(`slotlogic.costs.Speeds`), and its KV cache types (`slotlogic.kv_types`), with a line the first time each is
known. Fed by the page runner, the checkpoint runner and the start-up probe (`on_answer`)."""

from __future__ import annotations

from collections.abc import Callable

from slotkeeper.drivers.model_check import ModelCheck
from slotlogic import kv_types
from slotlogic.costs import Direction, SlotFileAnswer
from slotlogic.events import Event, KvCacheLearned, SpeedsMeasured
from slotlogic.keeper import Keeper
from slotlogic.settings import Settings


class SlotSpeeds:
    def __init__(self, url: str, keeper: Keeper, model: ModelCheck, emit: Callable[[Event], None],
                 settings: Callable[[], Settings]) -> None:
        self.url = url
        self.keeper = keeper
        self.model = model
        self.emit = emit
        self.settings = settings

    def __call__(self, answer: SlotFileAnswer) -> None:
        info = self.keeper.server
        if answer.direction is Direction.SAVE and info is not None:
            s = self.settings()
            configured = (s.cache_type_k, s.cache_type_v)
            found = kv_types.infer(self.model.facts, answer.tokens, answer.bytes, info.total_slots, configured)
            if found is not None and self.keeper.facts.kv_seen(found):
                self.emit(KvCacheLearned(self.url, kv_types.label(*found), kv_types.label(*configured)))
        if self.keeper.speeds.note(answer):
            rates = self.keeper.rates()
            bps = rates.save_bps if answer.direction is Direction.SAVE else rates.restore_bps
            self.emit(SpeedsMeasured(self.url, answer.direction.value, bps or 0.0, rates.kv_bytes_per_token,
                                     rates.prefill_tps))
