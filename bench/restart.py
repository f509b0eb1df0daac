"""Server-restart scenario: how much of the shared prefix does the first request after a restart prefill?

One agent session talks through the proxy; after its first turn llama-server is restarted (a new process:
every slot and the RAM cache are empty, only `--slot-save-path` files survive). The proxy notices (its
`/props` probe sees a new `media_marker`), and the session's next request is measured, as is a new
session's first request. With prefix checkpoints the prefix is restored from disk before either goes out;
without them both prefill it again. Target (issue "Prefix checkpoints"): ≤ 10% of the prefix prefilled.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx

from bench import configs
from bench.client import RequestRecord, send
from bench.workload import Workload, generate


def _prefix_tokens(server_url: str, wl: Workload) -> int:
    """Tokens of the stable prefix as the server renders it (system text up to the `<cwd>` marker)."""
    system = wl.sessions[0].requests[0].messages[0]["content"]
    stable = system[: system.index("\n<cwd>")].rstrip()
    prompt = httpx.post(server_url + "/apply-template", json={"messages": [{"role": "system", "content": stable}]},
                        timeout=60).json()["prompt"]
    return len(httpx.post(server_url + "/tokenize", json={"content": prompt}, timeout=60).json()["tokens"])


async def _ask(url: str, wl: Workload, session: int, index: int, tag: str) -> RequestRecord:
    spec = wl.sessions[session].requests[index]
    rec = RequestRecord(tag, "restart", spec.session, spec.index, 0.0, None, 0.0, None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
        await send(client, url.rstrip("/") + "/v1/chat/completions", wl.body(spec), rec)
    return rec


def _wait_for(path: Path, text: str, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return True
        time.sleep(0.2)
    return False


def measure(log_dir: Path, threads: int, seed: int, max_tokens: int,
            names: tuple[str, ...] = ("auto", "auto+ckpt")) -> list[dict[str, Any]]:
    wl = generate("fits", seed=seed, sessions=2, turns=2, subagent_turns=0, max_tokens=max_tokens)
    rows = []
    for name in names:
        base = configs.CONFIGS[name]
        cfg = configs.BenchConfig(base.name, base.proxy, {**base.options, "slots_probe_interval": 1},
                                  base.description, base.save_dir, base.checkpoints)
        with configs.stand_up(cfg, log_dir, tag="restart-", threads=threads) as stack:
            assert stack.server is not None
            asyncio.run(_ask(stack.url, wl, 0, 0, name))
            stack.server.restart()
            noticed = _wait_for(log_dir / f"restart-{name}.mitm.log", "restarted (new media_marker)")
            known = asyncio.run(_ask(stack.url, wl, 0, 1, name))
            new = asyncio.run(_ask(stack.url, wl, 1, 0, name))
            prefix = _prefix_tokens(stack.server_url, wl)
        for who, rec in (("known session", known), ("new session", new)):
            cached = rec.cache_n or 0
            refilled = max(0, prefix - cached)
            rows.append({"config": name, "request": who, "noticed": noticed, "prefix_tokens": prefix,
                         "prompt_n": rec.prompt_n, "cache_n": rec.cache_n, "prefix_prefilled": refilled,
                         "prefix_prefilled_pct": 100.0 * refilled / prefix if prefix else None,
                         "error": rec.error})
    return rows


def text(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    head = ["config", "first request after restart", "prefix tok", "prompt_n", "cache_n", "prefix prefilled"]
    lines = []
    for r in rows:
        pct = "-" if r["prefix_prefilled_pct"] is None else (
            f"{r['prefix_prefilled']} ({r['prefix_prefilled_pct']:.0f}%)")
        lines.append([r["config"], r["request"], str(r["prefix_tokens"]), str(r["prompt_n"]), str(r["cache_n"]), pct])
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|---|---|---:|---:|---:|---:|"]
                         + ["| " + " | ".join(c) + " |" for c in lines])
    widths = [max(len(x) for x in col) for col in zip(head, *lines, strict=True)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in [head, *lines])


if __name__ == "__main__":
    print(json.dumps(measure(Path("/tmp/restart-bench"), configs.default_threads(), 0, 8), indent=1))
