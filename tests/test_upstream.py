"""The driver of one server: what it asks the server, what it writes to the state file, what it reports."""

from __future__ import annotations

import asyncio
import json
import os
import time
from unittest import mock

import pytest

from slotkeeper.drivers import store_file
from slotkeeper.drivers.upstream import Upstream
from slotlogic import events as ev
from slotlogic.answers import Observation
from slotlogic.decisions import Pin, Replay, RequestFacts
from slotlogic.reasons import Why
from slotlogic.settings import Settings
from tests.conftest import UP, FakeLlama, chat

CHAT = "/v1/chat/completions"


def facts(body=None, now=0.0, replay=None):
    return RequestFacts("POST", CHAT, (), json.dumps(body or chat()).encode(), now, replay)


@pytest.fixture
def seen():
    return []


@pytest.fixture
def up(tmp_path, fake_llama, seen):
    return Upstream(UP, Settings(probe_interval=0), tmp_path / "state", seen.append, client=fake_llama)


def state_file(tmp_path):
    return json.loads(next((tmp_path / "state").glob("state-*.json")).read_text())


async def test_a_new_session_asks_the_server_once_and_claims_in_the_file(up, fake_llama, tmp_path, monkeypatch):
    pin = await up.decide(facts(), "f1")
    assert isinstance(pin, Pin) and fake_llama.calls == ["props", "slots"]
    assert state_file(tmp_path)["sessions"][pin.ticket.session.key]["slot"] == pin.ticket.slot
    transactions = []
    real = store_file.StateFile.transaction
    monkeypatch.setattr(store_file.StateFile, "transaction", lambda self: transactions.append(1) or real(self))
    again = await up.decide(facts(now=1.0), "f2")
    assert again.ticket.why is Why.KNOWN and fake_llama.calls == ["props", "slots"] and transactions == []


async def test_an_unreachable_server_falls_back_to_the_slot_count_in_the_file(tmp_path, seen):
    first = Upstream(UP, Settings(), tmp_path / "state", seen.append, client=FakeLlama())
    await first.decide(facts(), "f1")
    dead = FakeLlama()
    dead.props_data = None
    restarted = Upstream(UP, Settings(), tmp_path / "state", seen.append, client=dead)  # a restarted proxy
    pin = await restarted.decide(facts(chat("other")), "f2")
    assert isinstance(pin, Pin) and pin.ticket.why is Why.HASH_FALLBACK
    assert seen[-1] == ev.Unreachable(UP, pin.ticket.session.short, pin.ticket.slot, 4)
    never = Upstream(UP, Settings(), tmp_path / "empty", seen.append, client=dead)
    unpinned = await never.decide(facts(), "f3")  # no count known: the server chooses, its answer says where
    assert unpinned.ticket.slot is None and unpinned.ticket.reason == "unpinned: server unknown"
    assert isinstance(unpinned, Pin) and json.loads(unpinned.body)["id_slot"] == -1


async def test_the_probe_notices_a_restart_and_a_resize(up, fake_llama, seen):
    await up.decide(facts(), "f1")
    fake_llama.props_data = {**fake_llama.props_data, "media_marker": "<__media_b__>"}
    await up.prober.probe()
    assert ev.ServerRestarted(UP) in seen
    fake_llama.props_data = {**fake_llama.props_data, "total_slots": 2}
    fake_llama.slots_data = fake_llama.slots_data[:2]
    await up.prober.probe()
    assert ev.PoolResized(UP, 2) in seen
    again = await up.decide(facts(now=1.0), "f2")
    assert again.ticket.why is not Why.KNOWN and again.ticket.slot in (0, 1)  # placed again, in range


async def test_touches_are_flushed_and_kept_when_the_file_cannot_be_written(up, tmp_path, seen, monkeypatch):
    pin = await up.decide(facts(), "f1")
    for t in (1.0, 2.0):
        await up.decide(facts(now=t), "f")
    await up.sync.flush()
    assert state_file(tmp_path)["sessions"][pin.ticket.session.key]["requests"] >= 2
    await up.decide(facts(now=3.0), "f")

    def broken(self, state):
        raise OSError("disk full")
    monkeypatch.setattr(store_file.StateFile, "write", broken)
    await up.sync.flush()
    assert ev.Failed(UP, ev.Stage.STATE_WRITE, "OSError") in seen and up.keeper.table.dirty


async def test_a_replay_upstream_never_asks_the_server_and_cleans_up(seen):
    replay = Upstream.for_replay(UP, Settings(), seen.append)
    replay.client = None  # any call would fail
    recorded = Replay({"id_slot": None, "cache_prompt": None}, {"props": {"total_slots": 4}, "slots": None})
    pin = await replay.decide(facts(replay=recorded), "f1")
    assert isinstance(pin, Pin) and pin.ticket.slot in range(4)
    directory = replay.state_dir
    replay.close_sync()
    assert not os.path.exists(directory)


def test_a_replay_upstreams_throw_away_state_dir_goes_with_it_when_done_never_runs(seen):
    """A replay's state dir is its own: when `done` never comes (a test, an interrupted replay), the dir goes
    when the upstream does, not a directory a run left in /tmp."""
    import gc

    replay = Upstream.for_replay(UP, Settings(), seen.append)
    directory = replay.state_dir
    assert os.path.isdir(directory)
    del replay
    gc.collect()
    assert not os.path.exists(directory)


async def test_commands_act_in_memory_at_once_and_in_the_file_soon(up, tmp_path):
    pin = await up.decide(facts(), "f1")
    short = pin.ticket.session.short
    target = (pin.ticket.slot + 1) % 4
    assert up.sync.move(short, target) == [f"{short} → slot {target} on {UP}"]
    assert (await up.decide(facts(now=1.0), "f2")).ticket.slot == target
    await up.settle()
    assert state_file(tmp_path)["slots"][str(target)]["owner"] == pin.ticket.session.key
    assert up.sync.release(short) == [f"{short} (slot {target}) on {UP}"] and up.sync.release("ffffffff") == []
    await up.settle()
    assert state_file(tmp_path)["sessions"] == {}


async def test_a_known_session_that_comes_back_cold_gets_an_explanation(up, fake_llama, seen):
    a = await up.decide(facts(chat("A"), now=time.time()), "fa")
    b = await up.decide(facts(chat("B"), now=time.time()), "fb")
    for pin in (a, b):
        up.answered(pin.ticket, Observation(cache_n=0, prompt_n=100), path=CHAT, seconds=1.0)
    again = await up.decide(facts(chat("A"), now=time.time()), "fa2")
    fake_llama.slots_data[b.ticket.slot]["n_prompt_tokens"] = 0  # B's slot was emptied while idle
    reads = mock.patch.object(up.prober.store, "fresh", wraps=up.prober.store.fresh)
    with reads as fresh:
        up.answered(again.ticket, Observation(cache_n=0, prompt_n=120), path=CHAT, seconds=1.0)
        await up.settle()
    assert ev.IdleSlotsCleared(UP, b.ticket.slot) in seen
    assert fresh.call_count == 0  # this process's own slots showed it: the shared state was not read


async def test_new_settings_replace_the_old_and_keep_the_sessions(up, tmp_path):
    pin = await up.decide(facts(), "f1")
    up.reconfigure(Settings(ttl=5.0, probe_interval=0), tmp_path / "state")
    assert up.keeper.settings.ttl == 5.0
    assert (await up.decide(facts(now=1.0), "f2")).ticket.slot == pin.ticket.slot
    assert (await up.decide(facts(now=100.0), "f3")).ticket.why is not Why.KNOWN  # expired under the new TTL


class MessagesServer(FakeLlama):
    """/v1/messages that honours id_slot, or picks the least recently used idle slot like stock llama-server."""

    def __init__(self, honours: bool) -> None:
        super().__init__(total=3)
        self.honours, self.task, self.used = honours, 0, {0: 0, 1: 0, 2: 0}
        for s in self.slots_data:
            s["id_task"] = None

    async def slots(self):
        return [dict(s) for s in self.slots_data]  # a fresh answer each time, as over HTTP

    async def post_json(self, path, body, timeout):
        self.calls.append(f"post {path}")
        self.task += 1
        lru = min(self.used, key=lambda i: (self.used[i], -i))  # ties: the highest id, as the server does
        slot = body["id_slot"] if self.honours else lru
        self.used[slot] = self.task
        self.slots_data[slot] = {**self.slots_data[slot], "id_task": self.task, "n_prompt_tokens": 3}
        return 200, {}


@pytest.mark.parametrize("honours", [True, False])
async def test_the_messages_probe_finds_out_whether_the_server_honours_id_slot(tmp_path, seen, honours):
    server = MessagesServer(honours)
    up = Upstream(UP, Settings(), tmp_path, seen.append, client=server)
    assert await up.prober.probe_messages() is honours and up.keeper.messages_native is honours
    assert ev.MessagesProbed(UP, honours) in seen
    used = MessagesServer(True)
    used.slots_data[2]["n_prompt_tokens"] = 700  # a session's cache: a probe could hit it, so none is sent
    assert await Upstream(UP, Settings(), tmp_path, seen.append, client=used).prober.probe_messages() is None
    assert used.calls == []


async def test_the_start_up_messages_probe_steps_aside_for_a_client_that_starts_with_the_proxy(tmp_path, seen):
    """A client's first request sent as the proxy starts goes first: the probe's two completions batched with it
    made it ~5 times slower on a small server. The probe is left for the first translated request."""
    server = MessagesServer(True)
    up = Upstream(UP, Settings(probe_interval=0), tmp_path, seen.append, client=server)
    started = asyncio.create_task(up.prober.start())
    await asyncio.sleep(0.05)
    up.request(facts(now=0.0))                      # a client's request, during the start-up's quiet moment
    await started
    assert [c for c in server.calls if c.startswith("post")] == [] and up.keeper.messages_native is None
    assert await up.prober.probe_messages() is True  # asked again later (a translated request), it runs


async def test_a_new_session_waits_for_the_slot_it_would_copy_while_that_slot_is_being_placed(tmp_path, fake_llama,
                                                                                                 seen):
    """Two sessions that share their leading messages start together: the first one's placement still holds its
    slot's lock (its request is on its way there), so the second waits for it before it copies that slot."""
    save = tmp_path / "slots"
    save.mkdir()
    up = Upstream(UP, Settings(probe_interval=0, save_dir=str(save), paging=True, seed_wait=5.0),
                  tmp_path / "state", seen.append, client=fake_llama)
    shared_part = [{"role": "system", "content": "You are a coding agent. " * 40},
                   {"role": "user", "content": "<environment>/home/u/project</environment>\n" * 20}]

    def session(sid: str, task: str, now: float) -> RequestFacts:
        body = {"model": "m", "messages": [*shared_part, {"role": "user", "content": task}]}
        return RequestFacts("POST", CHAT, ((b"session-id", sid.encode()),), json.dumps(body).encode(), now)

    first = await up.decide(session("s1", "fix the parser", 0.0), "f1")

    def first_answered() -> None:  # its response headers came (the lock goes), then its answer completed
        up.unlock("f1")
        up.answered(first.ticket, Observation(cache_n=0, prompt_n=900), path=CHAT, seconds=0.5)

    asyncio.get_running_loop().call_later(0.5, first_answered)
    started = time.monotonic()
    await up.decide(session("s2", "write the docs", 1.0), "f2")
    waited = [e for e in seen if isinstance(e, ev.SourceAwaited)]
    assert len(waited) == 1 and waited[0].idle and waited[0].source == first.ticket.slot, seen
    assert time.monotonic() - started >= 0.45


async def test_a_huge_slot_count_in_the_state_sizes_nothing_while_the_server_is_down(tmp_path, seen):
    """A state file (any local process can write it) says 100,000,000 slots and the server is down: the status
    lists only what is claimed, and a new session is not pinned to a slot no `/props` ever named."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    path = state / store_file.state_file_name(UP)
    path.write_text(json.dumps({"version": 1, "upstream": UP, "total_slots": 100_000_000,
                                "slots": {"3": {"last_used": 1.0, "owner": "k" * 64}}, "sessions": {}}))
    os.chmod(path, 0o600)
    dead = FakeLlama()
    dead.props_data = None
    up = Upstream(UP, Settings(probe_interval=0), state, seen.append, client=dead)
    t0 = time.monotonic()
    status = await up.status()
    assert [s["id"] for s in status["slots"]] == [3] and time.monotonic() - t0 < 1
    decision = await up.decide(facts(), "f1")
    assert decision.ticket.slot is None and up.keeper.total_slots is None  # unpinned: the server chooses
    assert isinstance(decision, Pin) and json.loads(decision.body)["id_slot"] == -1
    await up.sync.reconcile()  # the background look for shared slots ranges over nothing the state says


async def test_two_requests_of_one_session_at_once_are_placed_once_and_both_pinned(tmp_path, seen):
    """Two identical requests that arrive together (a retry, two windows sending the same first prompt) are one
    session: the second waits for the first's placement and goes to the same slot, instead of replacing the
    first's placement (whose pin then broke both: `internal error ... ProtocolError`, both sent unpinned)."""

    class SlowLlama(FakeLlama):
        async def slots(self):
            await asyncio.sleep(0.05)  # the first placement is under way when the second request asks
            return await super().slots()

    up = Upstream(UP, Settings(probe_interval=0), tmp_path / "state", seen.append, client=SlowLlama())
    first, second = await asyncio.gather(up.decide(facts(), "f1"), up.decide(facts(), "f2"))
    assert isinstance(first, Pin) and isinstance(second, Pin)
    assert first.ticket.session.key == second.ticket.session.key and first.ticket.slot == second.ticket.slot
    assert {first.ticket.why, second.ticket.why} == {Why.FREE_EMPTY, Why.KNOWN}, (first.ticket.why, second.ticket.why)
