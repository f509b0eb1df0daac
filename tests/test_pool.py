"""Several servers behind one proxy (`slots_upstreams`), in mitmproxy's test harness with scripted servers:
routing of new and known sessions, side calls, failover and the retry of a request that could not connect."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from mitmproxy import http
from mitmproxy.test import taddons

from slotkeeper import addon as addon_module
from tests.conftest import UP, FakeLlama, Proxy, chat, flow, sent


def closed_port() -> int:
    """A loopback port nothing listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server(FakeLlama):
    """A scripted llama-server that also answers `/health` and, like llama-server, 404s `/running`."""

    def __init__(self, total: int = 2) -> None:
        super().__init__(total=total)
        self.healthy = True

    async def get_json(self, path: str, timeout: float | None = None) -> Any:
        self.calls.append(f"get {path}")
        return None

    async def health(self, timeout: float = 3.0) -> str:
        return "ok" if self.healthy else "refused"


B = f"http://127.0.0.1:{closed_port()}"


@pytest.fixture
def servers() -> dict[str, Server]:
    return {UP: Server(), B: Server()}


@pytest.fixture
def pool(tmp_path, servers) -> Iterator[Proxy]:
    addons = addon_module.make_addons()
    addons[0].rt.make_client = lambda url: servers[url]
    with taddons.context(*addons) as tctx:
        p = Proxy(tctx, addons)
        p.configure(slots_state_dir=str(tmp_path / "state"), slots_probe_interval=0, slots_log_requests="off",
                    mode=[f"reverse:{UP}@127.0.0.1:1"], slots_upstreams=[B])
        yield p


def dest(f: http.HTTPFlow) -> str:
    return f"{f.request.scheme}://{f.request.host}:{f.request.port}"


def turn(body: dict[str, Any], n: int) -> dict[str, Any]:
    return body | {"messages": [*body["messages"], {"role": "assistant", "content": f"step {n}"},
                                {"role": "user", "content": f"output {n}"}]}


async def test_new_sessions_fill_free_slots_on_both_servers_before_sharing_one(pool):
    placed = []
    for i in range(4):
        f = await pool.request(flow(chat(f"task {i}")))
        placed.append((dest(f), sent(f)["id_slot"]))
    assert len(set(placed)) == 4 and {d for d, _ in placed} == {UP, B}


async def test_a_known_session_goes_back_to_its_server_and_slot_from_memory(pool, servers):
    body = chat("task A")
    await pool.request(flow(chat("task 0")))  # the second session goes to the other server
    f1 = await pool.request(flow(body))
    where = dest(f1), sent(f1)["id_slot"]
    before = {u: list(s.calls) for u, s in servers.items()}
    f2 = await pool.request(flow(turn(body, 1)))
    assert (dest(f2), sent(f2)["id_slot"]) == where
    assert {u: s.calls for u, s in servers.items()} == before  # no network for a known session
    assert pool.rt.open[f2.id].ticket.why.value == "known"


async def test_a_down_servers_sessions_are_placed_again_on_the_other(pool, servers):
    body = chat("task A")
    f1 = await pool.request(flow(body))
    first = dest(f1)
    rt = pool.rt
    member = next(m for m in rt.pool.members if m.url == first)
    rt.pool.health.connect_failed(member, "refused")
    f2 = await pool.request(flow(turn(body, 1)))
    assert dest(f2) != first
    assert ("http://" + f2.request.host + f":{f2.request.port}", "failover") in rt.pool.routes
    # its former server forgot it: when that server is back, the session is not on two servers
    assert all(body_key not in rt.upstreams[first].keeper.table.sessions
               for body_key in rt.upstreams[dest(f2)].keeper.table.sessions)


async def test_a_request_that_cannot_connect_is_sent_to_the_other_server_before_it_starts(pool, caplog):
    caplog.set_level(logging.INFO)
    # B refuses connections (nothing listens on its port). Fill UP so a new session goes to B.
    await pool.request(flow(chat("task 0")))
    f = await pool.request(flow(chat("task 1")))
    assert dest(f) == B
    data = SimpleNamespace(client=f.client_conn, server=SimpleNamespace(address=("127.0.0.1", int(B.rsplit(":")[-1]))))
    pinning = pool.addons[1]
    await pinning.server_connect(data)
    assert data.server.address == ("127.0.0.1", 8080) and dest(f) == UP
    assert sent(f)["id_slot"] in range(2) and pool.rt.open[f.id].upstream.url == UP
    assert not pool.rt.pool.members[1].health.up
    assert f"could not reach {B} went to {UP}" in caplog.text and f"{B} is down (refused)" in caplog.text


async def test_a_retried_encoded_request_is_decoded_by_the_capped_path_not_mitmproxys(pool, monkeypatch):
    """The retry reads the body as the first attempt did (`slotkeeper/mitm/body_decode`, under `slots_max_body_mb`),
    never through mitmproxy's uncapped decoder on the event loop."""
    await pool.request(flow(chat("task 0")))
    f = await pool.request(flow(chat("task 1"), headers={"content-encoding": "gzip"}))
    assert dest(f) == B
    from slotkeeper.mitm import flows
    monkeypatch.setattr(flows, "content", lambda message: pytest.fail("mitmproxy's decoder on the retry"))
    data = SimpleNamespace(client=f.client_conn, server=SimpleNamespace(address=("127.0.0.1", int(B.rsplit(":")[-1]))))
    await pool.addons[1].server_connect(data)
    assert dest(f) == UP and f.request.headers["content-encoding"] == "gzip" and sent(f)["id_slot"] in range(2)


async def test_side_calls_go_to_the_least_loaded_server(pool):
    await pool.request(flow(chat("task 0")))
    side = chat("the conversation", system="Generate a short title for this conversation.")
    f = await pool.request(flow(side))
    assert pool.rt.open[f.id].ticket.side
    assert dest(f) == B  # the first server has a session in flight, the second none


async def test_status_shows_each_servers_health(pool):
    await pool.request(flow(chat()))
    rt = pool.rt
    status = rt.status([await up.status() for up in rt.upstreams.values()])
    assert [h["url"] for h in status["health"]] == [UP, B] and all(h["up"] for h in status["health"])
    assert json.dumps(status)


async def test_one_server_and_no_list_keeps_todays_path(proxy):
    assert proxy.rt.pool is None
    f = await proxy.request(flow(chat()))
    assert dest(f) == UP


class Swap(Server):
    """A scripted llama-swap root: lists `models` in `/v1/models`, none loaded in `/running`."""

    def __init__(self, models: tuple[str, ...]) -> None:
        super().__init__()
        self.models = models

    async def get_json(self, path: str, timeout: float | None = None) -> Any:
        self.calls.append(f"get {path}")
        if path == "/running":
            return {"running": []}
        if path == "/v1/models":
            return {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]}
        return None


@pytest.fixture
def swap(tmp_path) -> Iterator[tuple[Proxy, Swap]]:
    root = Swap(("m1", "m2", "m3"))
    models: dict[str, Server] = {}
    addons = addon_module.make_addons()
    addons[0].rt.make_client = lambda url: root if url == UP else models.setdefault(url, Server())
    with taddons.context(*addons) as tctx:
        p = Proxy(tctx, addons)
        p.configure(slots_state_dir=str(tmp_path / "state"), slots_probe_interval=0, slots_log_requests="off",
                    mode=[f"reverse:{UP}@127.0.0.1:1"], slots_upstreams=[UP])
        yield p, root


def model_servers(p: Proxy) -> list[str]:
    return sorted(url for url in p.rt.upstreams if "/upstream/" in url)


async def test_only_models_llama_swap_lists_get_a_server(swap, tmp_path):
    """Issue 20: 1,000 `model` values made 1,000 servers, 2,002 state files and an idle quarter core."""
    p, root = swap
    for i in range(200):
        f = await p.request(flow(chat(f"task {i}") | {"model": f"attack-{i}"}))
        assert "id_slot" not in sent(f)  # passed through untouched
    assert model_servers(p) == [] and root.calls.count("get /v1/models") == 1  # one look-up per interval
    assert not [f for f in (tmp_path / "state").glob("state-*.json") if "attack" in f.read_text()]
    f = await p.request(flow(chat("real") | {"model": "m1"}))
    assert isinstance(sent(f)["id_slot"], int) and model_servers(p) == [f"{UP}/upstream/m1"]


async def test_model_servers_are_capped_and_idle_ones_forgotten(swap, monkeypatch):
    p, _ = swap
    p.configure(slots_swap_max_models=2)
    pool = p.rt.pool
    assert pool is not None
    real_props = Server.props

    async def props_while_the_background_sweeps(self: Server) -> Any:
        pool.forget_idle(time.monotonic())  # the background pass runs while a new model's server is asked
        return await real_props(self)

    monkeypatch.setattr(Server, "props", props_while_the_background_sweeps)
    for model in ("m1", "m2"):
        f = await p.request(flow(chat(f"task {model}") | {"model": model}))
        assert isinstance(sent(f)["id_slot"], int)
    busy = await p.request(flow(chat("task m3") | {"model": "m3"}))  # both kept models have a request in flight
    assert "id_slot" not in sent(busy) and len(model_servers(p)) == 2
    for url in list(pool.inflight):
        pool.ended_url(url)
    f = await p.request(flow(chat("task m3") | {"model": "m3"}))  # the least recently used makes room
    assert isinstance(sent(f)["id_slot"], int) and model_servers(p) == [f"{UP}/upstream/m2", f"{UP}/upstream/m3"]
    pool.ended_url(f"{UP}/upstream/m3")
    pool.forget_idle(time.monotonic() + 3600)
    assert model_servers(p) == [] and not pool.where
