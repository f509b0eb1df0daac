"""`GET /_slots/metrics`: what the proxy did, in the Prometheus text format (`prometheus_client`).

Counting costs a few dict additions per request (`slotlogic.tally.Tally`, fed by the runtime's reports and events); the
metric families are built only when a scraper asks (`render`), so the hot path never touches the library.
Labels are server URLs, slot ids, enum words and client kinds (a fixed vocabulary, `slotlogic.board.client_kind`):
never a session, never prompt text.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from slotlogic.routing import RouteWhy

if TYPE_CHECKING:
    from slotkeeper.mitm.runtime import Runtime

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _Collector(Collector):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def collect(self) -> Iterator[Any]:
        yield from self._counters()
        yield from self._by_client()
        yield from self._gauges()
        yield from self._pool()

    def _counters(self) -> Iterator[Any]:
        """The tallies by server and slot (or cause, or move), every known label at 0 from the start."""
        t = self.rt.tally
        known = {up.url: up.keeper.total_slots or 0 for up in self.rt.upstreams.values()}  # from the start
        slot = ["server", "slot"]
        for name, doc, extra, data in (
                ("requests", "Completion requests answered, by the server and slot that served them.", [],
                 t.requests),
                ("prefill_tokens", "Prompt tokens the server had to compute (timings.prompt_n).", [], t.prefill),
                ("cached_tokens", "Prompt tokens the server reused from the slot (timings.cache_n).", [], t.cached),
                ("paged_in_tokens", "Tokens restored into a slot from a session page file.", [], t.paged_in),
                ("page_operations", "Session page saves (out) and restores (in).", ["direction"],
                 t.page_ops_all(known)),
                ("page_seconds", "Seconds spent paging sessions out and in.", [], t.page_seconds),
                ("checkpoints", "Prefix checkpoint preparations, by outcome.", ["outcome"], t.checkpoints_all(known)),
                ("checkpoint_seconds", "Seconds spent restoring, warming and saving prefix checkpoints.", [],
                 t.checkpoint_seconds),
                ("tokens_lost", "Tokens a session had that its slot no longer held when it came back, by cause "
                 "(expected: a restart, another model, an eviction with no page).", None, t.lost_by_cause(known)),
                ("stale_plans", "Slot moves dropped because the slot moved on since they were planned.", None,
                 t.stale_plans_all(known))):
            labels = [*slot, *extra] if extra is not None else (
                ["server", "cause", "expected"] if name == "tokens_lost" else ["server", "move"])
            fam = CounterMetricFamily(f"slotkeeper_{name}", doc, labels=labels)
            for labels, v in sorted(data.items()):
                fam.add_metric(list(labels), v)
            yield fam

    def _by_client(self) -> Iterator[Any]:
        """The tallies by client kind."""
        t = self.rt.tally
        for name, doc, data in (
                ("client_requests", "Completion requests answered, by server and client kind.", t.client_requests),
                ("reused_tokens", "Prompt tokens the server reused from the slot (timings.cache_n), by client kind.",
                 t.reused),
                ("prefill_seconds_saved", "Prefill seconds the reused tokens would have cost at the server's "
                 "fitted prefill rate for their depth, by client kind.", t.saved_s)):
            fam = CounterMetricFamily(f"slotkeeper_{name}", doc, labels=["server", "client"])
            for labels, v in sorted(data.items()):
                fam.add_metric(list(labels), v)
            yield fam
        fam = CounterMetricFamily("slotkeeper_client_tokens_lost", "Tokens lost (the loss meter), by client kind "
                                  "and cause (expected: as slotkeeper_tokens_lost).",
                                  labels=["server", "client", "cause", "expected"])
        for labels, v in sorted(t.client_lost_by_cause().items()):
            fam.add_metric(list(labels), v)
        yield fam

    def _gauges(self) -> Iterator[Any]:
        """Live sessions and the measured speeds, per server (a speed not measured yet is absent)."""
        now = time.time()
        live = GaugeMetricFamily("slotkeeper_live_sessions", "Sessions used within slots_ttl, per server.",
                                 labels=["server"])
        for up in self.rt.upstreams.values():
            live.add_metric([up.url], up.keeper.table.live_count(now))
        yield live
        speeds = {name: GaugeMetricFamily(f"slotkeeper_{name}", doc, labels=["server"]) for name, doc in (
            ("prefill_tokens_per_second", "Measured prompt tokens a second (moving average; absent: not measured)."),
            ("slot_save_bytes_per_second", "Measured slot save throughput (moving average of save answers)."),
            ("slot_restore_bytes_per_second", "Measured slot restore throughput (moving average of restore answers)."),
            ("kv_bytes_per_token", "KV cache bytes a token, learned from slot save answers (n_written / n_saved)."))}
        for up in self.rt.upstreams.values():
            r = up.keeper.rates()
            for name, v in (("prefill_tokens_per_second", r.prefill_tps), ("slot_save_bytes_per_second", r.save_bps),
                            ("slot_restore_bytes_per_second", r.restore_bps),
                            ("kv_bytes_per_token", r.kv_bytes_per_token)):
                if v is not None:
                    speeds[name].add_metric([up.url], v)
        yield from speeds.values()

    def _pool(self) -> Iterator[Any]:
        """Whether each server and the shared store answer, and the pool's routing choices."""
        pool = self.rt.pool
        up_fam = GaugeMetricFamily("slotkeeper_server_up", "1 while the server answers (slots_upstreams).",
                                   labels=["server"])
        routes = CounterMetricFamily("slotkeeper_routing_decisions", "Server choices, by reason.",
                                     labels=["server", "reason"])
        if pool is not None:
            for m in pool.members:
                up_fam.add_metric([m.url], 1.0 if m.health.up else 0.0)
            counted = {(m.url, why.value): 0 for m in pool.members for why in RouteWhy} | pool.routes
            for (server, why), v in sorted(counted.items()):
                routes.add_metric([server, why], v)
        else:
            for up in self.rt.upstreams.values():
                up_fam.add_metric([up.url], 1.0)
        yield up_fam
        yield routes
        stores = self.rt.stores
        if stores is not None and stores.redis is not None:
            g = GaugeMetricFamily("slotkeeper_state_store_up", "1 while the shared state store is reachable.",
                                  labels=["store"])
            g.add_metric([stores.redis.shown], 1.0 if stores.redis.available else 0.0)
            yield g


def render(rt: Runtime) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(rt))
    return generate_latest(registry)
