"""The log addon: the line per request (direct or through mitmproxy), the JSONL file and its cap."""

from __future__ import annotations

import asyncio
import json
import logging
import os

from mitmproxy import http

from slotkeeper.drivers.jsonl_log import JsonlLog
from tests.conftest import chat, flow


async def test_direct_lines_go_to_stdout_once_per_request(proxy, capsys):
    proxy.configure(slots_log_requests="direct")
    f = await proxy.request(flow(chat()))
    await proxy.answer(f, http.Response.make(200, b'{"timings":{"cache_n":10,"prompt_n":5}}', {}))
    assert "session=" not in capsys.readouterr().out  # written after the response is on its way
    await asyncio.sleep(0)
    out = capsys.readouterr().out
    assert out.count("slotkeeper: /v1/chat/completions session=") == 1 and "cache_n=10 prompt_n=5" in out


async def test_off_prints_nothing(proxy, capsys, caplog):
    proxy.configure(slots_log_requests="off")
    f = await proxy.request(flow(chat()))
    with caplog.at_level(logging.INFO):
        await proxy.answer(f, http.Response.make(200, b"{}", {}))
    assert "session=" not in capsys.readouterr().out and "session=" not in caplog.text


async def test_the_jsonl_file_gets_every_request_and_no_prompt_text(proxy, tmp_path):
    log_file = tmp_path / "requests.jsonl"
    proxy.configure(slots_log_file=str(log_file))
    f = await proxy.request(flow(chat("TOP SECRET task")))
    await proxy.answer(f, http.Response.make(200, b'{"timings":{"cache_n":10,"prompt_n":5}}', {}))
    for a in proxy.addons:
        if hasattr(a, "done"):
            a.done()
    (record,) = [json.loads(line) for line in log_file.read_text().splitlines()]
    assert record["kind"] == "request" and record["cache_n"] == 10
    assert record["slot"] == f.metadata["slotkeeper"]["slot"]
    assert "SECRET" not in log_file.read_text() and (log_file.stat().st_mode & 0o777) == 0o600


def test_the_jsonl_file_rotates_at_its_cap(tmp_path):
    path = tmp_path / "log.jsonl"
    errors: list[str] = []
    log = JsonlLog(str(path), 2000, errors.append)
    for i in range(100):
        log.write({"kind": "request", "i": i, "pad": "x" * 50})
    log.flush()
    assert path.stat().st_size <= 2000 and (tmp_path / "log.jsonl.1").exists() and errors == []
    bad = JsonlLog(str(tmp_path / "missing-dir" / "x.jsonl"), 2000, errors.append)
    bad.write({"kind": "request"})
    bad.write({"kind": "request"})
    assert errors == ["FileNotFoundError"]  # one line per outage, not one per record


def test_a_symlink_planted_as_the_jsonl_file_gets_nothing_appended_to_its_target(tmp_path):
    """A link planted under the log's name (the file in a directory others can write) must not get the records
    appended to its target; a FIFO there must not hang the writer (reliability round 4: records were appended)."""
    target = tmp_path / "victim"
    target.write_text("KEEP\n")
    (tmp_path / "log.jsonl").symlink_to(target)
    errors: list[str] = []
    log = JsonlLog(str(tmp_path / "log.jsonl"), 1 << 20, errors.append)
    log.write({"kind": "request", "path": "/home/someone/project"})
    log.flush()
    assert target.read_text() == "KEEP\n" and errors == ["OSError"]
    os.mkfifo(tmp_path / "fifo.jsonl")
    fifo = JsonlLog(str(tmp_path / "fifo.jsonl"), 1 << 20, errors.append)
    fifo.write({"kind": "request"})
    fifo.flush()  # returns: opened without blocking, refused as no regular file
    assert errors == ["OSError", "OSError"]
