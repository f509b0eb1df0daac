"""Streaming chat client for the benchmark: runs session scripts concurrently and records per-request stats.

Why streamed: agent clients stream, and with `stream_options.include_usage` llama-server puts its `timings`
(`cache_n`, `prompt_n`: what the server itself reused and prefilled) on the extra chunk whose `choices`
is `[]`; without it they ride on the `finish_reason` chunk. We keep the last `timings`/`usage` seen, so
both layouts work. One HTTP write can carry several SSE events and one event can be split across writes:
the addon's own incremental parser (`slotlogic.answers.SSEParser`) handles both.

Concurrency model: one asyncio task (and one keep-alive `httpx.AsyncClient`) per session; a session's
requests are sequential with think time in between, sessions run at the same time. A session's forks
(subagents) run as tasks of their own while it waits for all of them.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from bench.workload import RequestSpec, SessionScript, Workload
from slotlogic.answers import SSEParser

REQUEST_TIMEOUT_S = 300.0


@dataclass
class RequestRecord:
    """What one request cost, as the server reported it (`timings`) and as the client saw it."""

    config: str
    workload: str
    session: str
    index: int
    start_s: float  # relative to the workload run's start
    ttft_s: float | None  # request sent -> first SSE data event
    total_s: float
    status: int | None
    prompt_n: int | None = None
    cache_n: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    prompt_tokens: int | None = None  # usage.prompt_tokens
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def apply_event(rec: RequestRecord, event: Any) -> None:
    """Keep the latest `timings` and `usage` of a chat chunk (the final one wins)."""
    if not isinstance(event, dict):
        rec.error = f"unexpected SSE data: {json.dumps(event)[:120]}"
        return
    if event.get("type") == "message_start":  # Anthropic: the prompt counts come first, as usage
        usage = (event.get("message") or {}).get("usage") or {}
        rec.cache_n = usage.get("cache_read_input_tokens", rec.cache_n)
        rec.prompt_n = usage.get("input_tokens", rec.prompt_n)
        return
    if event.get("type") in ("content_block_start", "content_block_delta", "content_block_stop",
                             "message_delta", "message_stop", "ping"):
        return
    timings = event.get("timings")
    if isinstance(timings, dict):
        rec.prompt_n = timings.get("prompt_n", rec.prompt_n)
        rec.cache_n = timings.get("cache_n", rec.cache_n)
    usage = event.get("usage")
    if isinstance(usage, dict):
        rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = details.get("cached_tokens", rec.cached_tokens)
    if "error" in event:
        rec.error = json.dumps(event["error"])[:300]


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any], rec: RequestRecord) -> None:
    """POST a streamed chat request and fill `rec` (timing, status, server timings, errors)."""
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return
            parser = SSEParser()
            async for chunk in resp.aiter_raw():
                for event in parser.feed(chunk):
                    if rec.ttft_s is None:
                        rec.ttft_s = time.perf_counter() - t0
                    apply_event(rec, event)
            for event in parser.close():
                apply_event(rec, event)
            if rec.prompt_n is None and rec.error is None:
                rec.error = "no timings in stream"
    except (httpx.HTTPError, OSError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        rec.total_s = time.perf_counter() - t0


async def run_session(base_url: str, workload: Workload, specs: list[RequestSpec], config: str,
                      t_start: float, out: list[RequestRecord],
                      forks: dict[int, list[SessionScript]] | None = None) -> None:
    """One session's requests in order; `forks[i]` (subagents) all run to their end before `specs[i]` starts."""
    url = base_url.rstrip("/") + workload.path
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout) as client:
        for i, spec in enumerate(specs):
            if children := (forks or {}).get(i):
                await asyncio.gather(*(run_session(base_url, workload, c.requests, config, t_start, out, c.forks)
                                       for c in children))
            await asyncio.sleep(spec.think_s)
            rec = RequestRecord(config, workload.name, spec.session, spec.index,
                                start_s=time.perf_counter() - t_start, ttft_s=None, total_s=0.0, status=None)
            await send(client, url, workload.body(spec), rec)
            out.append(rec)


async def run_workload(base_url: str, workload: Workload, config: str) -> tuple[list[RequestRecord], float]:
    """All sessions of `workload` concurrently against `base_url`; returns records (start order) and wall s."""
    records: list[RequestRecord] = []
    t_start = time.perf_counter()
    await asyncio.gather(*(run_session(base_url, workload, s.requests, config, t_start, records, s.forks)
                           for s in workload.sessions))
    wall = time.perf_counter() - t_start
    return sorted(records, key=lambda r: r.start_s), wall
