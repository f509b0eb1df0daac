"""Decision replay of real recordings (recordings/*.mitm, made by `make record`): offline, no server, fast.

Why: the recordings hold what real pi windows, synthetic agents and a restarted llama-server really sent and
answered, and, per flow, the decision the live proxy took (`flow.metadata["slotkeeper"]`). Replaying them
through the addon and through `slotlogic` alone must (1) reproduce the live decisions, (2) match the golden
file `recordings/<name>.golden.json` (a changed decision fails with a unified diff; `make golden` updates it on
purpose), and (3) pass every recorded SSE stream through the tap byte for byte, whatever the chunking.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import difflib
import json
import logging
import os
import random
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mitmproxy import http, io
from mitmproxy.test import taddons

from slotkeeper import addon as addon_module
from slotkeeper.drivers.llama_http import LlamaClient
from slotkeeper.mitm.sse_tap import SSETap
from slotlogic import shared
from slotlogic.answers import Observation, StreamObserver
from slotlogic.decisions import NeedSlot, Pin, Replay, RequestFacts
from slotlogic.keeper import Keeper
from slotlogic.server import ServerInfo
from slotlogic.settings import Settings
from tests.conftest import Proxy

RECORDINGS = Path(__file__).resolve().parent.parent / "recordings"
REQUIRED = ("pi_two_windows", "agents_subagent", "server_restart")
NAMES = sorted(p.stem for p in RECORDINGS.glob("*.mitm"))
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"
SECRET_HEADERS = ("authorization", "proxy-authorization", "x-api-key", "api-key", "cookie", "set-cookie",
                  "x-goog-api-key")
GOLDEN_FIELDS = ("index", "path", "session", "source", "slot", "reason", "cache_n", "prompt_n", "outcome")


def load(name: str) -> list[http.HTTPFlow]:
    with (RECORDINGS / f"{name}.mitm").open("rb") as fp:
        flows = [f for f in io.FlowReader(fp).stream() if isinstance(f, http.HTTPFlow)]
    assert flows, f"{name}.mitm holds no HTTP flows"
    return flows


@contextlib.contextmanager
def addon_context(addons: list[Any]) -> Iterator[Proxy]:
    """`taddons.context`, minus a leak: its Master installs a root log handler bound to the current event loop
    and never removes it, so a warning logged after that loop closed (the next `asyncio.run`) would raise."""
    tctx = taddons.context(*addons)
    try:
        yield Proxy(tctx, addons)
    finally:
        tctx.master._legacy_log_events.uninstall()


@dataclass
class Replayed:
    """One flow after offline replay: the live record, the offline record and what went upstream."""

    flow: http.HTTPFlow
    recorded_body: bytes
    live: dict[str, Any]
    offline: dict[str, Any]


async def replay(name: str, state_dir: Path) -> list[Replayed]:
    """Every flow of a recording through the addons' hooks, in file order, as `mitmdump -nr` does."""
    flows = load(name)
    out = []

    async def no_network(*_: object) -> None:
        raise AssertionError("offline replay must not ask the server")

    with pytest.MonkeyPatch.context() as mp, addon_context(addon_module.make_addons()) as proxy:
        mp.setattr(LlamaClient, "props", no_network)  # the addon fails open: a call would leave the body as
        mp.setattr(LlamaClient, "slots", no_network)  # recorded minus our fields, which the tests catch
        proxy.configure(slots_state_dir=str(state_dir), slots_probe_interval=0, slots_log_requests="mitmproxy")
        for f in flows:
            assert not f.live
            live = copy.deepcopy(f.metadata.get("slotkeeper"))
            recorded_body = f.request.raw_content or b""
            await proxy.request(f)
            await proxy.hook("responseheaders", f)
            await proxy.hook("response", f)
            out.append(Replayed(f, recorded_body, live or {}, f.metadata.get("slotkeeper") or {}))
        assert proxy.rt.replays and not proxy.rt.upstreams
    return out


def ours(f: http.HTTPFlow) -> bool:
    """A completion request the proxy decided (a client's HEAD / or GET is not one)."""
    return isinstance(f.metadata.get("slotkeeper"), dict)


def finished_stream(f: http.HTTPFlow) -> bool:
    """A streamed answer that reached its end (the chat, Anthropic or Responses way), not one the client cut."""
    if f.response is None or "text/event-stream" not in f.response.headers.get("content-type", ""):
        return False
    tail = (f.response.get_content(strict=False) or b"")[-400:]
    # a Responses stream ends with a `response.completed` event that repeats the whole response (and timings)
    return (any(end in tail for end in (b"data: [DONE]", b'"type":"message_stop"'))
            or b"event: response.completed" in (f.response.get_content(strict=False) or b"")[-65536:])


def golden_rows(replayed: list[Replayed]) -> list[dict[str, Any]]:
    rows = []
    for i, r in enumerate(replayed):
        m = r.offline
        rows.append({"index": i, "path": r.flow.request.path, "session": (m.get("session") or "-")[:8],
                     "source": m.get("source"), "slot": m.get("slot"), "reason": m.get("reason"),
                     "cache_n": m.get("cache_n"), "prompt_n": m.get("prompt_n"), "outcome": m.get("outcome")})
    return rows


def golden_text(rows: list[dict[str, Any]]) -> str:
    """One JSON object per line (a readable diff), the whole file still valid JSON."""
    return "[\n" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n]\n"


@pytest.fixture(scope="module")
def replays(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Replayed]]:
    """Each recording replayed once per module (the assertions below share the result)."""
    out = {}
    for name in NAMES:
        out[name] = asyncio.run(replay(name, tmp_path_factory.mktemp(f"state-{name}")))
    return out


# ------------------------------------------------------------------------------------------------ the files


def test_required_recordings_exist_and_are_small_and_scrubbed() -> None:
    assert set(REQUIRED) <= set(NAMES), f"missing recordings: {set(REQUIRED) - set(NAMES)}; run `make record`"
    total = sum((RECORDINGS / f"{n}.mitm").stat().st_size for n in NAMES)
    assert total < 8 << 20, f"recordings take {total} bytes; keep them well under 8 MB"
    assert all((RECORDINGS / f"{n}.mitm").stat().st_size < 2 << 20 for n in NAMES), "one recording over 2 MB"
    for name in NAMES:
        for f in load(name):
            for msg in (f.request, f.response):
                for header in SECRET_HEADERS:
                    assert msg is None or msg.headers.get(header, "<scrubbed>") == "<scrubbed>", (name, header)
            assert not f.request.path.startswith("/_slots/"), "the addon's own answers are not recordings"


@pytest.mark.parametrize("name", NAMES)
def test_streamed_bodies_are_in_the_recording_in_request_order(name: str) -> None:
    flows = load(name)
    starts = [f.request.timestamp_start for f in flows]
    assert starts == sorted(starts), "file order must be request order (tools/record.py sorts on scrub)"
    streamed = [f for f in flows if f.response and "text/event-stream" in f.response.headers.get("content-type", "")]
    assert streamed, "every recording is of streaming clients"
    for f in streamed:
        if f.error is None:  # a stream the client itself cut has no end to keep
            assert finished_stream(f), f"stream of {f.request.path} was not kept whole"


# ------------------------------------------------------------------------------------------------ decisions


@pytest.mark.parametrize("name", NAMES)
def test_offline_replay_reproduces_the_live_decisions(name: str, replays: dict[str, list[Replayed]]) -> None:
    """Recorded from a fresh state dir by one proxy, so offline = live: session, slot, reason, counts."""
    decided = [r for r in replays[name] if ours(r.flow) or r.live]
    assert decided, f"{name} has no request the proxy decided"
    for i, r in enumerate(replays[name]):
        if not r.live:
            assert not r.offline, f"{name} flow {i}: decided offline, not live"
            continue
        for key in ("session", "source", "slot", "reason", "cache_n", "prompt_n", "outcome"):
            assert r.offline.get(key) == r.live.get(key), f"{name} flow {i}: {key} live {r.live.get(key)!r} " \
                                                         f"!= offline {r.offline.get(key)!r}"


@pytest.mark.parametrize("name", NAMES)
def test_offline_rewrite_sends_the_recorded_body(name: str, replays: dict[str, list[Replayed]]) -> None:
    """The body the addon would send now is byte for byte the body that went upstream when recorded."""
    for i, r in enumerate(replays[name]):
        assert r.flow.request.raw_content == r.recorded_body, f"{name} flow {i}: rewritten body differs"
        if not r.live:
            continue
        sent = json.loads(r.recorded_body)
        assert sent["id_slot"] == r.offline["slot"] and sent["cache_prompt"] is True


@pytest.mark.parametrize("name", NAMES)
def test_decisions_match_the_golden_file(name: str, replays: dict[str, list[Replayed]]) -> None:
    path = RECORDINGS / f"{name}.golden.json"
    actual = golden_text(golden_rows(replays[name]))
    if UPDATE:
        path.write_text(actual)
    assert path.exists(), f"{path.name} is missing: run `make golden`"
    expected = path.read_text()
    if actual != expected:
        diff = "\n".join(difflib.unified_diff(expected.splitlines(), actual.splitlines(),
                                              f"{path.name} (golden)", "offline replay", lineterm=""))
        pytest.fail(f"slot decisions changed for {name}; if intended, run `make golden`\n{diff}", pytrace=False)
    assert [tuple(r) for r in json.loads(expected)] == [GOLDEN_FIELDS] * len(replays[name])


@pytest.mark.parametrize("name", NAMES)
def test_replay_meters_losses_with_their_cause(name: str, tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """The loss meter on real traffic: only the restart recording loses tokens, each line says it was the
    restart (expected), and no recording has a loss of unknown cause."""
    with caplog.at_level(logging.INFO, logger="slotkeeper"):
        asyncio.run(replay(name, tmp_path))
    lost = [r.getMessage() for r in caplog.records if re.search(r" session=\S+ lost [\d,]+ tokens ", r.getMessage())]
    if name == "server_restart":
        assert lost and all(ln.endswith("the server restarted (expected)") for ln in lost), lost
    else:
        assert lost == []


@pytest.mark.parametrize("name", NAMES)
def test_replay_logs_the_same_lines_as_live(name: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`mitmdump -nr` prints the live log's per-request lines (order aside: live logs at completion)."""
    live_log = RECORDINGS / f"{name}.live.log"

    def lines(text: str) -> Counter[str]:
        """The per-request lines (the first-token watch's lines come from live timers only; the loss meter's
        lines are newer than the recordings and checked by the next test)."""
        return Counter(re.sub(r" \d+\.\d+s", "", ln) for ln in text.splitlines()
                       if " session=" in ln and not re.search(r" session=\S+ (waiting|ended after|lost) ", ln))

    with caplog.at_level(logging.INFO, logger="slotkeeper"):
        asyncio.run(replay(name, tmp_path))
    offline = "\n".join(r.getMessage() for r in caplog.records)
    assert lines(offline) == lines(live_log.read_text())
    assert sum(lines(offline).values()) == sum(1 for f in load(name) if ours(f))


@pytest.mark.parametrize("name", NAMES)
def test_slotlogic_alone_reaches_the_same_decisions(name: str) -> None:
    """The pure core, fed only the recorded facts (no driver, no files), picks the recorded slots."""
    k = Keeper(Settings(), "recorded")
    state = shared.ServerState(upstream="recorded")
    # The proxy reads /props at start-up, before the first request (a side call that comes first is placed
    # from it): the same server's props, recorded with the first placement.
    props = next(f.metadata["slotkeeper"]["facts"]["props"] for f in load(name)
                 if ours(f) and (f.metadata["slotkeeper"].get("facts") or {}).get("props"))
    k.facts.note_server(state, ServerInfo.parse(props))
    for i, f in enumerate(load(name)):
        if not ours(f):
            continue
        meta = f.metadata["slotkeeper"]
        now = f.request.timestamp_start
        facts = RequestFacts(f.request.method, f.request.path, f.request.headers.fields, f.request.get_content(), now,
                             Replay(meta["client"], meta["facts"]))
        decision = k.request(facts)
        assert not isinstance(decision, Pin) or decision.ticket.session.key == meta["session"]
        if isinstance(decision, NeedSlot):
            assert decision.ticket.session.key == meta["session"], f"flow {i}: session key"
            recorded = meta["facts"]
            assert recorded and recorded.get("props"), f"flow {i}: a new-session decision without recorded facts"
            info = ServerInfo.parse(recorded["props"])
            assert info is not None
            placed = k.assign(decision, state, info, recorded["slots"], now)
            decision = k.pin(placed, now)
        assert isinstance(decision, Pin)
        assert decision.ticket.session.source == meta["source"]
        assert (decision.ticket.slot, decision.ticket.reason) == (meta["slot"], meta["reason"]), f"{name} flow {i}"
        if f.response is not None:  # a session's time to live counts from its last answer
            obs = Observation(cache_n=meta.get("cache_n"), prompt_n=meta.get("prompt_n"), complete=True)
            k.outcomes.answered(decision.ticket, obs, path=f.request.path, seconds=0.0,
                       now=f.response.timestamp_end or f.response.timestamp_start or now)


@pytest.mark.parametrize("name", NAMES)
def test_each_session_keeps_one_slot_and_live_sessions_never_share(name: str) -> None:
    """The point of slotkeeper, checked on real traffic: a session stays on its slot (even across a server
    restart), and, with no more sessions than slots in a recording, no two sessions share one."""
    flows = [f for f in load(name) if ours(f)]
    slots: dict[str, set[int]] = {}
    for f in flows:
        m = f.metadata["slotkeeper"]
        if not m["side"]:
            slots.setdefault(m["session"], set()).add(m["slot"])
    assert all(len(s) == 1 for s in slots.values()), slots
    assert len(slots) <= 4
    owners = [next(iter(s)) for s in slots.values()]
    assert len(owners) == len(set(owners)), f"two sessions shared a slot: {slots}"
    follow_ups = [f.metadata["slotkeeper"] for f in flows if f.metadata["slotkeeper"]["reason"] == "known"]
    assert follow_ups and any(m["cache_n"] for m in follow_ups), "no follow-up request reused its cache"


# ------------------------------------------------------------------------------------------------ the SSE tap


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recorded_streams_pass_the_tap_byte_for_byte(name: str, seed: int) -> None:
    """Any chunking (1 byte up to whole events) gives the client the same bytes and the same numbers."""
    rng = random.Random(f"{name}:{seed}")
    checked = 0
    for f in load(name):
        if not finished_stream(f):
            continue
        body = f.response.get_content(strict=False) or b""
        kept: list[bytes] = []
        tap = SSETap(StreamObserver(), kept.append)
        out, pos = [], 0
        while pos < len(body):
            size = 1 if rng.random() < 0.2 else rng.randint(1, 300)
            out.append(tap(body[pos:pos + size]))
            pos += size
        out.append(tap(b""))
        assert b"".join(out) == body and kept == [body]
        meta = f.metadata["slotkeeper"]
        obs = tap.observer.obs
        assert (obs.cache_n, obs.prompt_n) == (meta["cache_n"], meta["prompt_n"])
        assert obs.prompt_n is not None and obs.events > 1
        checked += 1
    assert checked


# ------------------------------------------------------------------------------------------------ the scenarios


def test_pi_windows_are_two_sessions_with_warm_second_turns() -> None:
    metas = [f.metadata["slotkeeper"] for f in load("pi_two_windows")]
    sessions = Counter(m["session"] for m in metas)
    assert len(sessions) == 2 and set(sessions.values()) == {2}
    assert {m["source"] for m in metas} == {"content:root"}  # pi sends no session header
    second = [m for m in metas if m["reason"] == "known"]
    assert len(second) == 2 and all(m["cache_n"] > 0 and m["outcome"] in ("hit", "partial") for m in second)


# A real client's sessions: how it names them, and how many distinct sessions its recording holds.
CLIENTS = {"client_claude_code": ("header:x-claude-code-session-id", 3),
           "client_opencode": ("header:x-session-affinity", 3), "client_codex": ("header:session-id", 3),
           "client_qwen_code": ("content:root", 3),
           # aider: no session signal and a fixed root; its conversations are told apart by their user messages
           "client_aider": ("content:root", 3)}


@pytest.mark.parametrize("name", sorted(n for n in CLIENTS if n in NAMES))
def test_a_real_clients_sessions_stay_on_their_slots_and_later_turns_are_warm(name: str) -> None:
    """Each session is recognised by the client's own signal, keeps one slot, reuses >= 90% of its prompt on
    every later request, and a new session's first request starts from the shared prefix where one was seen."""
    source, count = CLIENTS[name]
    metas = [f.metadata["slotkeeper"] for f in load(name) if ours(f) and not f.metadata["slotkeeper"]["side"]]
    sessions = Counter(m["session"] for m in metas)
    assert len(sessions) == count and {m["source"] for m in metas} == {source}
    later = [m for m in metas if m["reason"] == "known" and m["outcome"] != "error"]
    assert later and all(m["cache_n"] / (m["cache_n"] + m["prompt_n"]) >= 0.9 for m in later
                         if name != "client_aider"), [(m["cache_n"], m["prompt_n"]) for m in later]
    firsts = [next(m for m in metas if m["session"] == s) for s in sessions][1:]
    assert all(m["cache_n"] for m in firsts), "a new session started cold although the prefix was seen"


def test_agents_run_has_a_subagent_as_its_own_session() -> None:
    flows = load("agents_subagent")
    sessions = {f.metadata["slotkeeper"]["session"] for f in flows}
    subagent = [f for f in flows if "You are a subagent" in json.dumps(json.loads(f.request.get_content()))]
    assert len(sessions) == 4 and subagent
    assert len({f.metadata["slotkeeper"]["session"] for f in subagent}) == 1


def test_restart_empties_slots_but_sessions_keep_them(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """Across the restart the recorded facts change media_marker; known sessions come back cold on their own
    slot, and a session that starts after the restart makes the offline replay notice it too."""
    flows = load("server_restart")
    markers = [f.metadata["slotkeeper"]["facts"]["props"]["media_marker"] for f in flows
               if f.metadata["slotkeeper"]["facts"]]
    assert len(set(markers)) == 2, "new sessions before and after the restart saw two server identities"
    cold = [f.metadata["slotkeeper"] for f in flows
            if f.metadata["slotkeeper"]["reason"] == "known" and f.metadata["slotkeeper"]["cache_n"] == 0]
    assert cold, "a known session's first request after the restart found its slot empty"
    with caplog.at_level(logging.WARNING, logger="slotkeeper"):
        asyncio.run(replay("server_restart", tmp_path))
    assert "restarted (new media_marker)" in caplog.text


async def test_a_recorded_stream_served_by_server_replay_is_observed(tmp_path: Path) -> None:
    """`mitmdump -S` (docs/debugging.md) answers a live request with a recorded SSE body that is already
    complete at `responseheaders`: the addon must read its numbers from that body, not wait for stream chunks
    that never come."""
    recorded = next(f for f in load("pi_two_windows") if f.metadata["slotkeeper"]["reason"] == "known")
    served = recorded.copy()
    served.live = True
    served.metadata.clear()
    answer, served.response = served.response, None
    async def unreachable(*_: object) -> None:
        return None  # the fake server's upstream is dead

    with pytest.MonkeyPatch.context() as mp, addon_context(addon_module.make_addons()) as proxy:
        mp.setattr(LlamaClient, "props", unreachable)
        proxy.configure(slots_probe_interval=0, slots_state_dir=str(tmp_path))
        await proxy.request(served)
        await proxy.answer(served, answer)  # what server playback does after our request hook
    meta = served.metadata["slotkeeper"]
    assert (meta["cache_n"], meta["prompt_n"]) == (recorded.metadata["slotkeeper"]["cache_n"],
                                                   recorded.metadata["slotkeeper"]["prompt_n"])
    assert meta["cache_n"] > 0
