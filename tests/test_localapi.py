"""The local API: GET only, loopback only by default, every error answered here as JSON."""

from __future__ import annotations

import json

import pytest

from tests.conftest import chat, flow


def api(path, method="GET", peer=("127.0.0.1", 50000)):
    f = flow(None, path=path, method=method, raw=b"")
    f.client_conn.peername = peer
    return f


async def test_status_and_health(proxy):
    await proxy.request(flow(chat()))
    f = await proxy.request(api("/_slots/status"))
    data = json.loads(f.response.content)
    assert f.response.status_code == 200 and data["policy"] == "auto"
    (server,) = data["servers"]
    assert server["total_slots"] == 4 and sum(1 for s in server["slots"] if s["session"]) == 1
    assert "state_dir" not in data and "state_file" not in server  # no absolute paths
    assert json.loads((await proxy.request(api("/_slots/health"))).response.content) == {"ok": True}


@pytest.mark.parametrize(("path", "method", "peer", "status"), [
    ("/_slots/nope", "GET", ("127.0.0.1", 1), 404),
    ("/_slots/status", "POST", ("127.0.0.1", 1), 405),
    ("/_slots/status", "GET", ("10.1.2.3", 1), 403),
    ("/_slots/status", "GET", ("::ffff:127.0.0.1", 1), 200),
    ("/_slots/status", "GET", ("::1", 1), 200),
])
async def test_methods_and_clients(proxy, fake_llama, path, method, peer, status):
    f = await proxy.request(api(path, method, peer))
    assert f.response.status_code == status
    assert ("error" in json.loads(f.response.content)) == (status != 200)
    assert fake_llama.calls == []  # never forwarded


async def test_the_allowed_networks_can_be_widened(proxy):
    proxy.configure(slots_api_allow=["10.0.0.0/8"])
    assert (await proxy.request(api("/_slots/health", peer=("10.1.2.3", 1)))).response.status_code == 200


async def test_an_unreadable_state_file_is_an_answer_not_a_forwarded_request(proxy, tmp_path, monkeypatch):
    await proxy.request(flow(chat()))
    up = next(iter(proxy.rt.upstreams.values()))

    async def unreadable() -> None:
        raise PermissionError(13, "Permission denied")  # a state dir the proxy can no longer read

    monkeypatch.setattr(up.store, "aread", unreadable)
    f = await proxy.request(api("/_slots/status"))
    assert f.response.status_code == 500 and "status unavailable" in json.loads(f.response.content)["error"]


async def test_status_and_new_sessions_with_a_state_file_nested_too_deep(proxy, tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700, exist_ok=True)
    up = next(iter(proxy.rt.upstreams.values()), None)
    path = up.store.path if up is not None else None
    if path is None:
        await proxy.request(flow(chat("warm")))
        path = next(iter(proxy.rt.upstreams.values())).store.path
    path.write_bytes(b"[" * 200_000 + b"]" * 200_000)
    f = await proxy.request(api("/_slots/status"))
    assert f.response.status_code == 200
    f = await proxy.request(flow(chat("a new session")))
    assert json.loads(f.request.content)["id_slot"] in range(4)
    assert any(".corrupt-" in p.name for p in state.iterdir())


@pytest.mark.parametrize(("host", "status"), [
    ("attacker.example", 403), ("attacker.example:8081", 403), ("127.0.0.1.nip.io:8081", 403),
    ("localhost:8081", 200), ("app.localhost", 200), ("127.0.0.1:8081", 200), ("[::1]:8081", 200),
    ("10.0.0.7", 200), ("slots.lan:8081", 200),  # a name slots_api_hosts lists
])
async def test_the_api_answers_its_own_host_names_only(proxy, host, status):
    """A loopback client naming another host is a page re-pointed at 127.0.0.1 (DNS rebinding): it reads nothing."""
    proxy.configure(slots_api_hosts=["slots.lan"])
    for path in ("/_slots/", "/_slots/status", "/_slots/metrics"):
        f = api(path)
        f.request.headers["host"] = host
        assert (await proxy.request(f)).response.status_code == status, (path, host)


async def test_every_answer_carries_the_security_headers(proxy):
    for path, method in (("/_slots/", "GET"), ("/_slots/status", "GET"), ("/_slots/nope", "GET"),
                         ("/_slots/status", "POST")):
        headers = (await proxy.request(api(path, method))).response.headers
        csp = headers["content-security-policy"]
        assert "frame-ancestors 'none'" in csp and "default-src 'none'" in csp and "'unsafe-inline'" not in \
            csp.split("script-src", 1)[1].split(";", 1)[0]
        assert headers["x-content-type-options"] == "nosniff" and headers["x-frame-options"] == "DENY"
