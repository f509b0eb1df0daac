"""`GET /_slots/metrics`: Prometheus text from the proxy's own counters, under the local API's rules."""

from __future__ import annotations

import json
from pathlib import Path

from mitmproxy import http
from prometheus_client.parser import text_string_to_metric_families

from slotlogic.checkpoint_machine import Outcome
from slotlogic.events import STALE_MOVES, CheckpointDone, Paged
from slotlogic.ledger import Cause
from tests.conftest import UP, chat, flow
from tests.test_localapi import api


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


async def test_requests_tokens_paging_and_servers_are_counted(proxy):
    f = await proxy.request(flow(chat()))
    await proxy.answer(f, http.Response.make(200, b'{"timings":{"cache_n":7,"prompt_n":30}}',
                                             {"content-type": "application/json"}))
    slot = str(f.metadata["slotkeeper"]["slot"])
    proxy.rt.emit(Paged(UP, 1, "aaaaaaaa", 100, "bbbbbbbb", 250, 0.05, 20.0))
    proxy.rt.emit(CheckpointDone(UP, 2, Outcome.RESTORED, 0, None, None, 0.25))
    m = await proxy.request(api("/_slots/metrics"))
    assert m.response.status_code == 200 and m.response.headers["content-type"].startswith("text/plain")
    got = samples(m.response.get_text())
    on = (("server", UP), ("slot", slot))
    assert got[("slotkeeper_requests_total", on)] == 1
    assert got[("slotkeeper_prefill_tokens_total", on)] == 30 and got[("slotkeeper_cached_tokens_total", on)] == 7
    assert got[("slotkeeper_paged_in_tokens_total", (("server", UP), ("slot", "1")))] == 250
    assert got[("slotkeeper_page_operations_total", (("direction", "in"), ("server", UP), ("slot", "1")))] == 1
    assert got[("slotkeeper_page_seconds_total", (("server", UP), ("slot", "1")))] == 0.05
    assert got[("slotkeeper_checkpoints_total", (("outcome", Outcome.RESTORED.value), ("server", UP),
                                                 ("slot", "2")))] == 1
    assert got[("slotkeeper_live_sessions", (("server", UP),))] == 1
    assert got[("slotkeeper_server_up", (("server", UP),))] == 1
    assert chat()["messages"][0]["content"][:20] not in m.response.get_text()  # no prompt text


async def test_the_local_api_rules_apply(proxy):
    assert (await proxy.request(api("/_slots/metrics", method="POST"))).response.status_code == 405
    assert (await proxy.request(api("/_slots/metrics", peer=("10.1.2.3", 1)))).response.status_code == 403


async def test_every_labelled_counter_reads_zero_for_its_known_labels_before_its_first_event(proxy, fake_llama):
    """A fresh proxy's dashboard panels read 0, not "no data": each server it fronts, with its slots once
    `/props` told them, and every value of the enum-like labels (directions, outcomes, moves, causes)."""
    proxy.configure(mode=[f"reverse:{UP}@127.0.0.1:8081"])
    proxy.addons[1].running()
    await proxy.settle()
    got = samples((await proxy.request(api("/_slots/metrics"))).response.get_text())
    slots = [str(s) for s in range(len(fake_llama.slots_data))]
    for s in slots:
        for d in ("in", "out"):
            assert got[("slotkeeper_page_operations_total", (("direction", d), ("server", UP), ("slot", s)))] == 0
        for o in Outcome:
            assert got[("slotkeeper_checkpoints_total", (("outcome", o.value), ("server", UP), ("slot", s)))] == 0
    for move in STALE_MOVES:
        assert got[("slotkeeper_stale_plans_total", (("move", move), ("server", UP)))] == 0
    for c in Cause:
        expected = "true" if c.expected else "false"
        assert got[("slotkeeper_tokens_lost_total", (("cause", c.value), ("expected", expected), ("server", UP)))] == 0


def test_the_dashboards_unexpected_losses_panel_selects_by_the_expected_label():
    """`Cause.expected` decides what is expected (idle-clear is), not a list of cause words in the panel that
    falls behind when a cause is added."""
    dash = json.loads((Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "slotkeeper.json").read_text())
    (expr,) = [t["expr"] for p in dash["panels"] if "unexpected" in p["title"] for t in p["targets"]]
    assert 'expected="false"' in expr and "cause" not in expr, expr
