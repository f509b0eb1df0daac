"""The real pi client against a real llama-server: pi sends genuine requests and its turns extend a prefix.

Why: slotkeeper's session logic is built on what pi puts on the wire; this proves the driver produces real
pi traffic (one request per turn, continuation with `-c`) that llama-server can serve from its KV cache.
"""

from __future__ import annotations

import httpx
import pytest

from bench.real.llama_server import LlamaServer
from bench.real.pi import PiSession, PiUnavailable, ensure_pi_installed, node_available
from tests.real_helpers import THREADS

pytestmark = [
    pytest.mark.real,
    pytest.mark.skipif(not node_available(), reason="pi needs node and npm on PATH (not found)"),
]


@pytest.fixture(scope="module")
def pi_binary():
    try:
        return ensure_pi_installed()
    except PiUnavailable as exc:
        pytest.skip(f"pi could not be installed: {exc}")


def test_pi_two_turns_reuse_the_servers_cache(tmp_path, pi_binary):
    with LlamaServer(threads=THREADS, slots=2, ctx_per_slot=8192, log_path=str(tmp_path / "llama.log")) as srv:
        # max_tokens=16 keeps the turn short on 2 CPUs; pi still sends its full system prompt and tools.
        pi = PiSession(srv.url, tmp_path, "w0", max_tokens=16, binary=pi_binary)
        for prompt in ("Reply with one short sentence: what is a hash map?",
                       "Reply with one short sentence: when is it a bad choice?"):
            done = pi.run_turn(prompt, timeout=120)
            assert done.returncode == 0, f"pi failed: {done.stderr[-500:]}"
        slots = httpx.get(srv.url + "/slots", timeout=10).json()

    assert any(s.get("n_prompt_tokens", 0) > 0 for s in slots), f"server saw no prompt: {slots}"
    usage = pi.assistant_usage()
    assert len(usage) == 2, f"expected one request per turn (no tool loop): {usage}"
    first, second = usage
    first_prompt = first["prompt_n"] + first["cache_n"]
    assert first_prompt > 500, "pi's system prompt + tools should be several hundred tokens"
    # Turn 2 resends turn 1's conversation: everything up to turn 1's reply comes from the cache.
    assert second["cache_n"] >= first_prompt, f"turn 2 did not reuse turn 1's prefix: {usage}"
    assert second["prompt_n"] < first_prompt, f"turn 2 re-evaluated the whole prompt: {usage}"
