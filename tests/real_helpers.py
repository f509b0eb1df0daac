"""Helpers for tests against a real llama-server (xllamacpp + SmolLM2, or LLAMA_SERVER_BIN)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

# ~330 tokens of shared "agent system prompt" (deterministic, no randomness).
SYSTEM = "You are a careful coding agent working in a repository. " + " ".join(
    f"Rule {i}: read files before editing them, run the tests, and keep changes small." for i in range(22))


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
