"""An IPv6 llama-server (`--mode reverse:http://[::1]:PORT`): a real mitmdump starts in front of it and places
requests on its slots. The server's origin is spelled with brackets everywhere the proxy keys servers by it; a
bare `::1` made the port part of the address and mitmdump refused its own mode at start."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from bench.real.mitmdump import ROOT, MitmProxy
from slotkeeper.drivers import origins
from slotkeeper.launch.mitmdump import free_port
from slotkeeper.mitm import options


def test_ipv6_origins_keep_their_brackets():
    assert options.fronted_upstreams(["reverse:http://[::1]:8080@127.0.0.1:8081"]) == {"http://[::1]:8080"}
    assert options.server_list(["reverse:http://[::1]:8080"], ["http://[fe80::1]:9000/"]) == [
        "http://[::1]:8080", "http://[fe80::1]:9000"]
    assert origins.base_of("https://[::1]") == "https://[::1]:443"
    assert origins.parts("http://[::1]:8080") == ("http", "::1", 8080)
    assert origins.origin("http", "127.0.0.1", 80) == "http://127.0.0.1:80"


@pytest.mark.real
def test_mitmdump_fronts_an_ipv6_server_and_pins_its_requests(tmp_path):
    port = free_port()
    stub = subprocess.Popen([sys.executable, "-m", "bench.stub_llama", "--host", "::1", "--port", str(port)],
                            cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert stub.stdout is not None and "listening" in stub.stdout.readline().decode()
        with MitmProxy(f"http://[::1]:{port}", {"slots_state_dir": str(tmp_path / "state")},
                       log_path=str(tmp_path / "p.log")) as px:
            body = {"messages": [{"role": "system", "content": "You are an agent."},
                                 {"role": "user", "content": "hello"}]}
            r = httpx.post(px.url + "/v1/chat/completions", json=body, timeout=30)
            status = httpx.get(px.url + "/_slots/status", timeout=10).json()
        assert r.status_code == 200 and r.headers.get("x-slot-id") is not None, (r.status_code, r.text[:200])
        assert f"http://[::1]:{port}" in str(status)
    finally:
        stub.kill()
        stub.wait(10)
