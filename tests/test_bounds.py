"""Nothing grows without bound: live sessions, per-session counters, remembered shapes and prompts, the state
file (and so the cost of a new session's locked transaction)."""

from __future__ import annotations

import json
import time

from slotkeeper.drivers.upstream import Upstream
from slotlogic import fastpath, intake, outcomes
from slotlogic import shared as st
from slotlogic.answers import Observation
from slotlogic.decisions import RequestFacts
from slotlogic.reasons import Why
from slotlogic.settings import Settings
from slotlogic.table import SessionTable
from tests.conftest import UP, FakeLlama, chat


def test_the_session_table_keeps_the_most_recently_used():
    t = SessionTable(ttl=120.0, max_sessions=64)
    for i in range(1000):
        t.assign(f"s{i}", i % 4, float(i), prefix=None)
        if i % 10 == 0:
            t.use("s0", float(i))  # an old session that keeps working
    assert len(t.sessions) <= 64 and "s0" in t.sessions and "s999" in t.sessions and "s500" not in t.sessions


async def test_one_shot_sessions_leave_bounded_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(outcomes, "MAX_STATS", 100)
    up = Upstream(UP, Settings(probe_interval=0, state_max_sessions=40), tmp_path / "state", [].append,
                  client=FakeLlama())
    k = up.keeper
    k.table.max_sessions = 80
    now = time.time()
    for i in range(400):
        body = json.dumps(chat(f"one-shot {i}", system=f"system {i} " * 8)).encode()
        pin = await up.decide(RequestFacts("POST", "/v1/chat/completions", (), body, now + i * 0.01), f"f{i}")
        up.answered(pin.ticket, Observation(cache_n=0, prompt_n=10), path="/v1/chat/completions", seconds=0.1)
    assert len(k.table.sessions) <= 80 and len(k.outcomes.stats) <= 100 and len(k.recognition.marks) <= intake.MAX_MARKS
    assert len(k.recognition.shapes) <= fastpath.MAX_SHAPES < 400
    status = await up.status()
    assert len(status["sessions"]) <= 100
    state = json.loads(up.store.path.read_text())
    assert len(state["sessions"]) <= 40 + 4


def test_compaction_keeps_the_owners_and_the_most_recent_and_drops_their_pages():
    s = st.ServerState(UP, total_slots=2)
    st.claim(s, "owner-old", 0, 1.0)
    for i in range(100):
        st.claim(s, f"s{i:03d}", 1, 10.0 + i)
    s.pages["s000"] = st.PageRecord("page-00000000000000000000.bin", 900, 1.0)
    s.pages["s099"] = st.PageRecord("page-99999999999999999999.bin", 900, 1.0)
    doomed = st.compact(s, 200.0, 1e6, 16)
    assert "owner-old" in s.sessions and "s099" in s.sessions and "s050" not in s.sessions
    assert len(s.sessions) == 17 and doomed == ["page-00000000000000000000.bin"] and set(s.pages) == {"s099"}


async def test_a_new_sessions_transaction_stays_cheap_with_a_big_state_file(tmp_path):
    """10k sessions in the file: the first transaction compacts it; the next new session's costs what
    `slots_state_max_sessions` allows (bench/reliability.py measures 1k/10k/50k)."""
    up = Upstream(UP, Settings(probe_interval=0), tmp_path / "state", [].append, client=FakeLlama())
    big = st.ServerState(UP, total_slots=4)
    now = time.time()
    for i in range(10_000):
        st.claim(big, f"{i:016x}", i % 4, now - 3600 - i, prefix="p" * 16)
    up.store.write(big)
    times = []
    for i in range(4):
        body = json.dumps(chat(f"new {i}")).encode()
        t0 = time.perf_counter()
        pin = await up.decide(RequestFacts("POST", "/v1/chat/completions", (), body, time.time()), f"f{i}")
        times.append(time.perf_counter() - t0)
        assert pin.ticket.why is not Why.KNOWN
    assert len(json.loads(up.store.path.read_text())["sessions"]) <= Settings().state_max_sessions + 4
    assert min(times[1:]) < 0.1, times  # was ~0.17 s at 10k before compaction (0.9 s at 50k)

