"""The *pi* workload: 3 concurrent real pi sessions (`pi -p`, then `pi -c -p`), when node is present.

Per-request numbers come from pi's own session log: pi stores llama-server's `cached_tokens` (= `cache_n`)
as `cacheRead` and `prompt_tokens - cached_tokens` (= `prompt_n`) as `input`, so the stock configuration
needs no proxy to be measured. TTFT is not visible from outside pi and is left empty. The physical limit
needs the prompts themselves: the first proxied configuration saves its flows (`mitmdump -w`) and the limit
is computed from their bodies in request order (pi sends the same conversation in every configuration:
its prompts are fixed and SmolLM2 decodes greedily).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from bench.client import RequestRecord
from bench.real.pi import PiSession, node_available, run_sessions_concurrently

TOPICS = ["a hash map", "a linked list", "a binary heap", "a trie", "a bloom filter", "a skip list"]
FOLLOW_UPS = ["Reply with one short sentence: when is it a bad choice?",
              "Reply with one short sentence: name one real program that uses it.",
              "Reply with one short sentence: what is its worst case?"]


def unavailable() -> str | None:
    """Why the pi workload cannot run here, or None."""
    if not node_available():
        return "pi workload: node/npm not found; skipped"
    return None


def prompts(window: int, turns: int) -> list[str]:
    return [f"Reply with one short sentence: what is {TOPICS[window % len(TOPICS)]}?", *FOLLOW_UPS][:turns]


def run(url: str, config: str, workdir: Path, sessions: int, turns: int) -> tuple[list[RequestRecord], float]:
    windows = [PiSession(url, workdir, f"w{i}", max_tokens=16) for i in range(sessions)]
    t0 = time.perf_counter()
    run_sessions_concurrently(windows, [prompts(i, turns) for i in range(sessions)], timeout=600)
    wall = time.perf_counter() - t0
    records = []
    for w in windows:
        elapsed = 0.0
        for i, (usage, turn) in enumerate(zip(w.assistant_usage(), w.history, strict=False)):
            error = usage.get("error") or (None if turn.returncode == 0 else f"pi exited {turn.returncode}")
            records.append(RequestRecord(config, "pi", w.name, i, start_s=elapsed, ttft_s=None,
                                         total_s=turn.seconds, status=200 if error is None else None,
                                         prompt_n=usage.get("prompt_n"), cache_n=usage.get("cache_n"),
                                         error=error))
            elapsed += turn.seconds
    return sorted(records, key=lambda r: (r.start_s, r.session)), wall


def bodies_from_flows(path: Path) -> list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]:
    """(messages, tools) of every chat request saved with `-w`, in request order."""
    from mitmproxy import io

    out = []
    with path.open("rb") as f:
        flows = [fl for fl in io.FlowReader(f).stream() if getattr(fl, "request", None) is not None]
    flows.sort(key=lambda fl: fl.request.timestamp_start)
    for fl in flows:
        if fl.request.path.startswith("/v1/chat/completions") and fl.request.raw_content:
            body = json.loads(fl.request.get_content())
            out.append((body["messages"], body.get("tools")))
    return out
