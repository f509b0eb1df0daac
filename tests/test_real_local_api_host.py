"""The local API behind a real mitmdump in reverse mode, which replaces the client's `Host` with the server's
before any request hook: a loopback client naming another host (a page re-pointed at 127.0.0.1 by DNS
rebinding) is refused; `localhost` and the address itself are answered."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from bench.real.mitmdump import ROOT, MitmProxy
from slotkeeper.launch.mitmdump import free_port

pytestmark = pytest.mark.real


def test_a_rebound_host_name_reads_nothing_through_real_mitmdump(tmp_path):
    port = free_port()
    stub = subprocess.Popen([sys.executable, "-m", "bench.stub_llama", "--port", str(port)], cwd=str(ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert stub.stdout is not None and "listening" in stub.stdout.readline().decode()
        with MitmProxy(f"http://127.0.0.1:{port}", {"slots_state_dir": str(tmp_path / "state")},
                       log_path=str(tmp_path / "p.log")) as px:
            got = {}
            for host in ("attacker.example", f"attacker.example:{px.port}", f"localhost:{px.port}",
                         f"127.0.0.1:{px.port}"):
                for path in ("/_slots/", "/_slots/status"):
                    # a new connection per request, as a browser keeps one per host name
                    with httpx.Client() as c:
                        r = c.get(px.url + path, headers={"host": host}, timeout=10)
                    got[(host.split(":")[0], path)] = r.status_code
                    assert r.headers["x-content-type-options"] == "nosniff"
                    assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
        assert got == {("attacker.example", "/_slots/"): 403, ("attacker.example", "/_slots/status"): 403,
                       ("localhost", "/_slots/"): 200, ("localhost", "/_slots/status"): 200,
                       ("127.0.0.1", "/_slots/"): 200, ("127.0.0.1", "/_slots/status"): 200}, got
    finally:
        stub.kill()
        stub.wait(10)
