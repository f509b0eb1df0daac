"""The model checks at start on a real llama-server behind a real mitmdump: the header of the file `/props`
names is read, its lines are logged, the start-up probe measures the server's speeds, and on a
sliding-window model the probe save shows whether this llama-server keeps checkpoints in slot files."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from bench.real.llama_server import LlamaServer
from bench.real.mitmdump import MitmProxy
from tests import tiny_models
from tests.real_helpers import UPSTREAM_BINARY

pytestmark = pytest.mark.real


def wait_for_line(log: Path, text: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = log.read_text() if log.exists() else ""
        if text in content:
            return content
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not logged: {log.read_text()[-2000:]}")


def test_smollm2_is_described_measured_and_its_budget_shown_in_tokens(tmp_path):
    save = tmp_path / "slots"
    save.mkdir()
    log = tmp_path / "p.log"
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_save_dir": str(save), "slots_throughput_probe": True,
            "slots_page_max_mb": 1024}
    with LlamaServer(slots=2, ctx_per_slot=2048, threads=1, slot_save_path=str(save),
                     log_path=str(tmp_path / "s.log")) as srv, MitmProxy(srv.url, opts, log_path=str(log)) as px:
        text = wait_for_line(log, "start-up probe on slot")       # no request needed: the proxy starts it
        status = httpx.get(px.url + "/_slots/status", timeout=10).json()["servers"][0]
        body = {"model": "m", "max_tokens": 2, "system": "You are terse. " * 40,
                "messages": [{"role": "user", "content": "Say ok."}]}
        for _ in range(2):  # Anthropic answers carry no timings: the measured speed prices the cached tokens
            assert httpx.post(px.url + "/v1/messages", json=body, timeout=120).status_code == 200
        time.sleep(0.3)
        sessions = httpx.get(px.url + "/_slots/status", timeout=10).json()["servers"][0]["sessions"]
        probe_files = list(save.iterdir())
    assert "model header: " in text and "keys read with gguf.GGUFReader in" in text
    assert ("model: llama, 30 layers, 3 KV heads × 64+64 dims: ~23.0 KB KV per token (f16); a slot file ~23.1 MB "
            "per 1K tokens; prefixes reusable") in text
    assert "prefill " in text and " tok/s (" in text and "decode " in text
    assert status["model"]["kv_bytes_per_token"] == 23040 and status["model"]["slot_files"] == "on"
    budget = status["page_budget"]
    assert budget["mb"] == 1024 and 40_000 < budget["tokens"] < 50_000, budget   # 1 GiB / ~23.1 KB per token
    assert status["throughput"]["prefill_tok_s"] > 10 and status["throughput"]["decode_tok_s"] > 1
    (saved,) = [s["saved_s"] for s in sessions.values()]
    assert saved > 0
    assert probe_files == []   # the probe file (saved and restored once for the speeds) was deleted
    print("\n".join(line for line in text.splitlines() if "model" in line or "probe" in line))


def test_a_sliding_window_model_learns_that_this_server_keeps_checkpoints_in_slot_files(tmp_path, monkeypatch):
    model = tiny_models.gemma3(tmp_path / "gemma3.gguf")
    monkeypatch.setenv("SLOTKEEPER_MODEL", str(model))
    save = tmp_path / "slots"
    save.mkdir()
    log = tmp_path / "p.log"
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_save_dir": str(save)}
    with LlamaServer(slots=2, ctx_per_slot=1024, threads=1, slot_save_path=str(save),
                     log_path=str(tmp_path / "s.log")) as srv, MitmProxy(srv.url, opts, log_path=str(log)) as px:
        text = wait_for_line(log, "model: gemma3")
        status = httpx.get(px.url + "/_slots/status", timeout=10).json()["servers"][0]
        slots = httpx.get(srv.url + "/slots", timeout=10).json()
        left = list(save.iterdir())
    assert "sliding window 32 on 5 of 6 layers" in text and status["model"]["prefix_reuse"] == "needs-swa-full"
    if UPSTREAM_BINARY:  # b11434: no checkpoints in slot files, so a restored SWA slot could not resume
        assert "stay off: a restore could not resume (start llama-server with --swa-full" in text, text
        assert status["model"]["slot_files"] == "off"
        return
    assert "start-up probe on slot " in text and "; slot files carry context checkpoints" in text
    assert "writes its checkpoints into slot files" in text and "stay off" not in text
    assert status["model"]["slot_files"] == "on" and status["model"]["checkpoints_in_files"] is True
    probed = int(text.split("start-up probe on slot ")[1].split(":")[0])
    assert left == [] and slots[probed].get("n_prompt_tokens", 0) == 0   # probe file deleted, its slot erased
    print("\n".join(line for line in text.splitlines() if "model" in line or "probe" in line or "window" in line))
