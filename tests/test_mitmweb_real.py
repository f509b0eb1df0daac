"""mitmweb with the README's flags: its UI port defaults to 8081, the proxy's; the addon moves the UI off the
proxy's port and says where it is, even with `termlog_verbosity=alert` (which hides mitmweb's own line)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time

import httpx
import pytest

from bench.real.mitmdump import ROOT
from slotkeeper.launch.mitmdump import free_port, mitm_binary

pytestmark = pytest.mark.real


def test_mitmweb_with_the_readme_flags_serves_its_ui_and_says_where(tmp_path):
    port, log = free_port(), tmp_path / "web.log"
    # The README's line with mitmweb for mitmdump; the UI's port set to the proxy's, as its default 8081 is
    # (8081 itself may be taken on a shared machine). The next port is held by another process (it was, once, on
    # a machine running tests in parallel, and mitmweb exited): the UI moves past it.
    other = socket.create_server(("127.0.0.1", port + 1))
    argv = [mitm_binary("mitmweb"), "-s", "addon.py", "--mode", f"reverse:http://127.0.0.1:{free_port()}"
            f"@127.0.0.1:{port}", "--set", "connection_strategy=lazy", "--set", "flow_detail=0",
            "--set", "termlog_verbosity=alert", "--set", "web_open_browser=false", "--set", f"web_port={port}",
            "--set", f"slots_state_dir={tmp_path / 'state'}"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=str(ROOT), stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        try:
            deadline, found = time.monotonic() + 30, None
            while found is None:
                assert proc.poll() is None, f"mitmweb exited: {log.read_text()[-1500:]}"
                assert time.monotonic() < deadline, log.read_text()[-1500:]
                found = re.search(r"mitmweb UI: (http://\S+)", log.read_text())
                time.sleep(0.1)
            ui = found.group(1)
            assert f":{port}/" not in ui and f":{port + 1}/" not in ui
            assert "is the proxy's own port: moved" in log.read_text()
            assert httpx.get(ui, timeout=10).status_code == 200
            assert httpx.get(f"http://127.0.0.1:{port}/_slots/health", timeout=10).status_code == 200
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(15)
            other.close()
