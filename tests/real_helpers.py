"""Helpers for tests against a real llama-server (xllamacpp + SmolLM2, or LLAMA_SERVER_BIN)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

# llama.cpp compute threads for the tests' servers. One: with two on a 2-core machine, llama.cpp's spinning thread
# barrier stalls whenever anything else runs (the proxy reading the model's header at start-up, the client,
# another job on a CI runner). Measured beside one other busy process: four 1-token requests 4.3-4.6 s with two
# threads, 0.7-1.0 s with one; 100 decoded tokens 20-24 s against 2.4-3.7 s; a 460-token prefill 4.7-6.7 s
# against 3.2-4.1 s (bench/configs.py has the same finding). Two are faster only on an otherwise idle machine.
# The upstream llama-server (LLAMA_SERVER_BIN, `make llama-server`: b11434) writes no context checkpoints into
# slot files; the embedded xllamacpp build does. Tests of SWA and hybrid models expect what their build does.
UPSTREAM_BINARY = bool(os.environ.get("LLAMA_SERVER_BIN"))
THREADS = 1

# A shared "agent system prompt" (deterministic, no randomness): 210 SmolLM2 tokens with the chat template, a
# conversation with its first user message ~221. (It was 22 rules, ~450 tokens: every cold request of the real
# tests prefilled ~240 tokens more, ~2 s each on one thread, for nothing they check.)
SYSTEM = "You are a careful coding agent working in a repository. " + " ".join(
    f"Rule {i}: read files before editing them, run the tests, and keep changes small." for i in range(10))


@dataclass
class Turn:
    slot: int | None
    cache_n: int
    prompt_n: int


def conversation(first: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first}]


def extend(msgs: list[dict[str, str]], n: int) -> None:
    """Append an assistant turn and a tool-output-like user turn (deterministic content)."""
    msgs.append({"role": "assistant", "content": f"Running step {n} now."})
    msgs.append({"role": "user", "content": f"Output of step {n}: " + " ".join(f"line{n}-{k} ok" for k in range(25))})


def ask(base: str, msgs: list[dict[str, str]], *, stream: bool = False, timeout: float = 120) -> Turn:
    body = {"messages": msgs, "max_tokens": 4, "temperature": 0}
    if not stream:
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=timeout)
        r.raise_for_status()
        t = r.json()["timings"]
        slot = r.headers.get("x-slot-id")
        return Turn(int(slot) if slot is not None else None, t["cache_n"], t["prompt_n"])
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    timings: dict[str, int] = {}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=timeout) as r:
        slot = r.headers.get("x-slot-id")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                timings = json.loads(line[6:]).get("timings") or timings
    return Turn(int(slot) if slot is not None else None, timings["cache_n"], timings["prompt_n"])


def jsonl(path: Path, settle: float = 0.5) -> list[dict]:
    """The proxy's JSONL log once it has stopped growing (records are written a moment after the request)."""
    size, deadline = -1, time.monotonic() + 10
    while time.monotonic() < deadline:
        now = path.stat().st_size if path.exists() else 0
        if now == size:
            break
        size = now
        time.sleep(settle)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
