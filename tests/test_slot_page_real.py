"""The live slot page in a real browser, and the Grafana dashboard against a live scrape.

One stack for the module: a real llama-server (2 slots, --slot-save-path) behind a real mitmdump with the
addon and paging on; headless Chromium shows `/_slots/` while three sessions take turns on the two slots (so
sessions are paged out and in). What the page shows is read back from its DOM (`data-v` attributes) and
compared with `/_slots/status`.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.real import browser
from bench.real.llama_server import LlamaServer
from bench.real.mitmdump import MitmProxy
from tests.real_helpers import THREADS, ask, conversation, extend

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "slotkeeper.json"

pytestmark = [pytest.mark.real, pytest.mark.skipif(browser.available() is not None,
                                                   reason=str(browser.available()))]


def same(shown: str, value: Any) -> bool:
    if value is None:
        return shown == ""
    if isinstance(value, int | float):
        return shown != "" and float(shown) == float(value)
    return shown == str(value)


def check(page: dict[str, Any], status: dict[str, Any], window: float = 120) -> None:
    """Every number the page shows equals the status's."""
    servers = {s["upstream"]: s for s in status["servers"]}
    assert set(page) == set(servers)
    for url, srv in servers.items():
        got = page[url]
        facts = got["facts"]
        assert same(facts["total_slots"], srv["total_slots"]) and same(facts["n_ctx_per_slot"], srv["n_ctx_per_slot"])
        pps = srv["prefill_tok_s"]  # measured from the answers (the start-up probe is off here)
        assert pps and same(facts["prefill_tok_s"], pps)
        assert same(facts["page_budget_mb"], (srv["page_budget"] or {}).get("mb"))
        assert same(facts["prefill_s_saved"], srv["prefill_s_saved"])
        assert same(facts["claimed"], sum(1 for s in srv["slots"] if s["claimed"]))
        assert got["slots"] == len(srv["slots"])
        assert set(got["sessions"]) == set(srv["sessions"])
        for key, s in srv["sessions"].items():
            row = got["sessions"][key]
            for field in ("slot", "requests", "reuse_pct", "cached_tokens", "saved_s", "lost_tokens"):
                assert same(row[field], s[field]), (key, field, row[field], s[field])
            assert same(row["page_bytes"], (srv["pages"].get(key) or {}).get("bytes")), (key, row, srv["pages"])
            assert row["client"] == srv["recent"]["sessions"][key]["client"]
        recent = srv["recent"]
        assert got["spans"] == sum(1 for s in recent["spans"] if s["end"] >= recent["now"] - window)
        assert sorted(got["marks"]) == sorted(m["kind"] for m in recent["marks"] if m["t"] >= recent["now"] - window)


def _one_render(b: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The DOM and the status it was rendered from, read within one render (a refresh between the two reads
    would pair one render's numbers with the next one's status: seen once in CI)."""
    for _ in range(20):
        before = b.js("return window.slotkeeperStatus()")
        page = browser.shown(b)
        if b.js("return window.slotkeeperStatus()") == before:
            return page, before
    raise AssertionError("the page re-rendered during every read")


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("page")
    save = tmp / "slots"
    save.mkdir()
    opts = {"slots_state_dir": str(tmp / "state"), "slots_save_dir": str(save), "slots_prefix_cache": "off"}
    with LlamaServer(threads=THREADS, slots=2, ctx_per_slot=2048, slot_save_path=str(save),
                     log_path=str(tmp / "s.log")) as srv, \
            MitmProxy(srv.url, opts, log_path=str(tmp / "p.log")) as px, browser.Browser() as b:
        b.open(px.url + "/_slots/")
        during: list[tuple[dict[str, Any], dict[str, Any]]] = []
        convs = {c: conversation(f"Task {c}: slot page test, keep the whole conversation.") for c in "ABC"}
        for c in "AB":
            ask(px.url, convs[c])
        time.sleep(3.0)  # A calls again after a pause of its own: its turn gap is 3 s (`slotlogic.returns`)
        extend(convs["A"], 1)
        ask(px.url, convs["A"])
        time.sleep(3.5)  # A is due back about now, B idle 6.5 s: B is the owner least surely back, C evicts it
        for n, c in enumerate("CBCB", start=2):
            ask(px.url, convs[c])
            extend(convs[c], n)
            # while the workload runs: the DOM against the very status it was rendered from
            during.append(_one_render(b))
        yield {"server": srv, "proxy": px, "browser": b, "during": during, "tmp": tmp}


def test_the_page_shows_what_the_status_says_while_a_real_workload_runs(stack):
    b, px = stack["browser"], stack["proxy"]
    for page, status in stack["during"]:
        check(page, status)
    # quiet now: two more refreshes, then the page and a fresh status agree number for number
    b.wait_renders(b.renders() + 2)
    page, status = browser.shown(b), httpx.get(px.url + "/_slots/status", timeout=10).json()
    check(page, status)
    (srv,) = status["servers"]
    assert len(srv["sessions"]) == 3 and {"page-out", "page-in"} <= {m["kind"] for m in srv["recent"]["marks"]}
    assert srv["pages"] and all(p["bytes"] > 0 for p in srv["pages"].values())
    assert sum(s["cached_tokens"] for s in srv["sessions"].values()) > 0
    text = b.driver.page_source
    assert "Task A" not in text and "slot page test" not in text  # no prompt text on the page
    shot = stack["tmp"] / "slot-page.png"
    b.screenshot(shot)
    assert shot.stat().st_size > 10_000
    if os.environ.get("UPDATE_SCREENSHOT"):
        (ROOT / "docs" / "slot-page.png").write_bytes(shot.read_bytes())


def test_every_metric_the_grafana_dashboard_asks_for_is_exported(stack):
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs.append(dash["templating"]["list"][1]["query"]["query"])
    wanted = {m for e in exprs for m in re.findall(r"\bslotkeeper_[a-z_]+", e)}
    assert len(exprs) >= 12 and len(wanted) >= 10
    text = httpx.get(stack["proxy"].url + "/_slots/metrics", timeout=10).text
    exported: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            exported[s.name] = exported.get(s.name, 0.0) + s.value
    assert not wanted - set(exported), sorted(wanted - set(exported))
    # and the savings the dashboard draws are really counted by the workload
    assert exported["slotkeeper_reused_tokens_total"] > 0 and exported["slotkeeper_prefill_seconds_saved_total"] > 0
    assert exported["slotkeeper_page_operations_total"] >= 2
