"""Scale-out on real parts: two real llama-servers on free ports, a real redis-server, real mitmdump
processes. Two proxies sharing the store never give two new sessions one slot while a slot is free
anywhere; a killed server's sessions continue on the other (its paged-out ones restored there from the
shared save dir); the store going away mid-run loses no request."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.real.llama_server import LlamaServer
from bench.real.mitmdump import MitmProxy
from tests.real_helpers import ask, conversation, extend, jsonl
from tests.redis_fixtures import new_redis

pytestmark = pytest.mark.real


def server(tmp: Path, name: str, slots: int, save: Path | None = None) -> LlamaServer:
    return LlamaServer(slots=slots, ctx_per_slot=2048, threads=1, slot_save_path=str(save) if save else None,
                       log_path=str(tmp / f"{name}.llama.log"))


def placements(log: Path) -> list[tuple[str, str, int]]:
    """(session, server, slot) of every request a proxy logged, in order."""
    return [(r["session"][:8], r["upstream"], r["slot"]) for r in jsonl(log) if r["kind"] == "request"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Iterator[tuple[LlamaServer, LlamaServer, Path]]:
    tmp = tmp_path_factory.mktemp("pair")
    with server(tmp, "one", 2) as a, server(tmp, "two", 2) as b:
        yield a, b, tmp


def test_two_proxies_on_one_store_never_share_a_slot_while_one_is_free(pair, tmp_path):
    a, b, _ = pair
    with new_redis() as store:
        opts = {"slots_state_url": store.url, "slots_upstreams": [b.url], "slots_prefix_cache": "off"}
        logs = [tmp_path / "p1.jsonl", tmp_path / "p2.jsonl"]
        with MitmProxy(a.url, {**opts, "slots_state_dir": str(tmp_path / "s1"), "slots_log_file": str(logs[0])},
                       log_path=str(tmp_path / "p1.log")) as p1, \
                MitmProxy(a.url, {**opts, "slots_state_dir": str(tmp_path / "s2"),
                                  "slots_log_file": str(logs[1])}, log_path=str(tmp_path / "p2.log")) as p2:
            convs = [conversation(f"Task {i}: two proxies, one store.") for i in range(4)]
            # Sessions split between the proxies, started two at a time (the claims race in the store).
            for pair_start in (0, 2):
                threads = [threading.Thread(target=ask, args=((p1, p2)[i % 2].url, convs[i]))
                           for i in range(pair_start, pair_start + 2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
        placed = placements(logs[0]) + placements(logs[1])
    assert len(placed) == 4
    assert len({(srv, slot) for _, srv, slot in placed}) == 4, placed  # 4 sessions, 4 slots, none shared
    assert {srv for _, srv, _ in placed} == {a.url, b.url}


def test_the_store_going_away_mid_run_loses_no_request(pair, tmp_path):
    a, b, _ = pair
    with new_redis() as store:
        log = tmp_path / "p.jsonl"
        opts = {"slots_state_url": store.url, "slots_upstreams": [b.url], "slots_prefix_cache": "off",
                "slots_state_dir": str(tmp_path / "s"), "slots_log_file": str(log)}
        with MitmProxy(a.url, opts, log_path=str(tmp_path / "p.log")) as px:
            convs = [conversation(f"Task {i}: the store goes away.") for i in range(3)]
            turns = [ask(px.url, c) for c in convs[:2]]
            store.stop()  # mid-run
            for n, c in enumerate(convs[:2]):
                extend(c, n)
                turns.append(ask(px.url, c))  # known sessions: from memory
            turns.append(ask(px.url, convs[2]))  # a new session: placed on local knowledge
            store.start()
            extend(convs[2], 9)
            turns.append(ask(px.url, convs[2]))
            deadline = time.monotonic() + 15  # the background flush reaches the store again
            while "reachable again" not in (tmp_path / "p.log").read_text() and time.monotonic() < deadline:
                time.sleep(0.2)
    assert len(turns) == 6 and all(t.slot is not None for t in turns)
    assert len(placements(log)) == 6
    text = (tmp_path / "p.log").read_text()
    assert text.count("unreachable") == 1 and "reachable again" in text, text[-2000:]


def test_a_killed_servers_sessions_continue_on_the_other_with_their_pages(tmp_path):
    """One slot per server, a shared --slot-save-path. A on the first server, B on the second; C evicts A
    (A is paged out to the shared dir). The first server is killed: A's and C's next requests go to the
    second server before they start (none lost), and A's page is restored there instead of prefilled."""
    save = tmp_path / "slots"
    save.mkdir()
    log = tmp_path / "p.jsonl"
    with server(tmp_path, "one", 1, save) as one, server(tmp_path, "two", 1, save) as two:
        opts = {"slots_upstreams": [two.url], "slots_save_dir": str(save), "slots_prefix_cache": "off",
                "slots_state_dir": str(tmp_path / "state"), "slots_log_file": str(log),
                "slots_health_interval": 60}  # the kill must be found by the request itself
        with MitmProxy(one.url, opts, log_path=str(tmp_path / "p.log")) as px:
            convs = {c: conversation(f"Task {c}: failover, keep the conversation.") for c in "ABC"}
            first = {c: ask(px.url, convs[c]) for c in "ABC"}
            one.stop()
            extend(convs["A"], 1)
            back_a = ask(px.url, convs["A"])
            extend(convs["C"], 2)
            back_c = ask(px.url, convs["C"])
            extend(convs["B"], 3)
            back_b = ask(px.url, convs["B"])
    recs = [r for r in jsonl(log) if r["kind"] == "request"]
    assert [r["upstream"] for r in recs[:3]] == [one.url, two.url, one.url], recs
    assert [r["upstream"] for r in recs[3:]] == [two.url] * 3, recs
    assert all(r["error"] is None for r in recs), recs
    a_before = first["A"].cache_n + first["A"].prompt_n
    assert "paged-in" in recs[3]["reason"] and back_a.cache_n >= a_before - 2, (recs[3], back_a, a_before)
    assert back_c.prompt_n > 0 and back_b.slot == 0
    text = (tmp_path / "p.log").read_text()
    assert f"{one.url} is down" in text and text.count("is down") == 1
