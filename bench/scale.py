"""The `scale` workload (`make bench ARGS=--scale`): the agents workload on 2 llama-servers × 2 slots (one
thread each), through

- `slotkeeper`: one proxy fronting both (`slots_upstreams`), paging and prefix checkpoints in a save dir
  both servers share;
- `round-robin` and `least-conn`: a plain load balancer, no pinning (`bench/lb.py`);
- `2 proxies+redis`: two slotkeeper proxies on one Redis store, the sessions split between them.

Every configuration gets fresh servers (and store). Reported: prefill tokens × the physical limit, TTFT
p50/p95, and for the slotkeeper rows the placements that took a claimed slot (an eviction) while another was
free on some server according to the proxies' own logs. Then the hot path with the Redis store against the
file store (`bench.hotpath`, in process, side by side).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import loss
from bench.client import RequestRecord, run_session
from bench.real.llama_server import LlamaServer
from bench.real.mitmdump import MitmProxy
from bench.real.redis_server import RedisServer
from bench.report import run_row
from bench.workload import Workload
from slotkeeper.launch.mitmdump import free_port

ROOT = Path(__file__).resolve().parent.parent
SLOTS = 2
CTX_PER_SLOT = 8192
CONFIGS = ("slotkeeper", "round-robin", "least-conn", "2 proxies+redis")
OPTIONS = {"slots_policy": "auto", "slots_prefix_cache": "disk"}


async def run_split(urls: list[str], wl: Workload, config: str) -> tuple[list[RequestRecord], float]:
    """Session i talks to urls[i % len(urls)]."""
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    await asyncio.gather(*(run_session(urls[i % len(urls)], wl, s.requests, config, t0, records, s.forks)
                           for i, s in enumerate(wl.sessions)))
    return sorted(records, key=lambda r: r.start_s), time.perf_counter() - t0


@contextlib.contextmanager
def balancer(policy: str, servers: list[str], log: Path) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.lb", "--port", str(port), "--policy", policy, *servers],
                            cwd=str(ROOT), stdout=open(log, "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "listening" not in log.read_text():
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(5)


def proxy_records(logs: list[Path]) -> list[dict[str, Any]]:
    out = []
    for log in logs:
        if log.exists():
            out += [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return out


def evictions(records: list[dict[str, Any]]) -> int:
    """New-session placements that evicted a live owner (`evict-*`, `all-busy`, `seed-claimed-*`)."""
    return sum(1 for r in records if r.get("kind") == "request" and
               any(w in (r.get("reason") or "") for w in ("evict-", "all-busy", "seed-claimed")))


def paging(records: list[dict[str, Any]]) -> dict[str, Any]:
    pages = [r for r in records if r.get("kind") == "page"]
    ins = [p["in_tokens"] for p in pages if isinstance(p.get("in_tokens"), int)]
    return {"page_ins": len(ins), "paged_in_tokens": sum(ins),
            "page_outs": sum(1 for p in pages if isinstance(p.get("out_tokens"), int)),
            "paging_ms": round(sum(p.get("server_ms") or 0.0 for p in pages), 1)}


def warmup(records: list[dict[str, Any]]) -> int:
    return sum(r.get("prompt_n") or 0 for r in records if r.get("kind") == "checkpoint")


def run_config(name: str, wl: Workload, log_dir: Path, threads: int) -> tuple[dict[str, Any], list[RequestRecord],
                                                                               str]:
    with tempfile.TemporaryDirectory(prefix="slotkeeper-scale-") as tmp, contextlib.ExitStack() as stack:
        save = Path(tmp) / "slots"
        save.mkdir()
        tag = name.replace(" ", "_").replace("+", "_")
        servers = [stack.enter_context(LlamaServer(slots=SLOTS, ctx_per_slot=CTX_PER_SLOT, threads=threads,
                                                   slot_save_path=str(save),
                                                   log_path=str(log_dir / f"scale-{tag}-{i}.llama.log")))
                   for i in range(2)]
        urls = [s.url for s in servers]
        logs: list[Path] = []
        if name in ("round-robin", "least-conn"):
            entry = [stack.enter_context(balancer(name, urls, log_dir / f"scale-{tag}.lb.log"))]
        else:
            opts = {**OPTIONS, "slots_save_dir": str(save), "slots_upstreams": [urls[1]]}
            n = 1
            if name.startswith("2 proxies"):
                store = stack.enter_context(RedisServer())
                opts["slots_state_url"] = store.url
                n = 2
            entry = []
            for i in range(n):
                logs.append(log_dir / f"scale-{tag}-{i}.requests.jsonl")
                # One machine: the proxies share the state dir, where the checkpoint index lives (with
                # slots_state_url=redis://…, the claims and pages are in Redis).
                px = MitmProxy(urls[0], {**opts, "slots_state_dir": str(Path(tmp) / "state"),
                                         "slots_log_file": str(logs[-1])},
                               log_path=str(log_dir / f"scale-{tag}-{i}.mitm.log"))
                entry.append(stack.enter_context(px).url)
        records, wall = asyncio.run(run_split(entry, wl, name))
        time.sleep(1.0)  # the proxies' JSONL lines are written a moment after the answers
        recs = proxy_records(logs)
        row = run_row("scale", name, records, wall, None, warmup(recs), paging(recs) if logs else None)
        row.update(loss.row_fields(loss.proxy_lost(entry) if logs else None,
                                   loss.bench_lost(loss.sent_of(records, wl.by_key()))))
        if logs:
            row["evictions"] = evictions(recs)
            row["servers_used"] = len({r.get("upstream") for r in recs if r.get("kind") == "request"})
        return row, records, urls[0]


def measure(wl: Workload, log_dir: Path, threads: int, limit_fn: Any, configs: list[str] | None = None
            ) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per configuration, the limit row first; `limit_fn(server_url, wl, records, source)` is the
    bench's own limit computation (bench/__main__.py), run on a server of the first configuration."""
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    lim = None
    for name in configs or CONFIGS:
        if name not in CONFIGS:
            raise ValueError(f"unknown scale configuration {name!r}; choose from {', '.join(CONFIGS)}")
        row, records, _ = run_config(name, wl, log_dir, threads)
        if lim is None:
            with LlamaServer(slots=1, ctx_per_slot=CTX_PER_SLOT, threads=threads,
                             log_path=str(log_dir / "scale-limit.llama.log")) as srv:
                lim = limit_fn(srv.url, wl, records, name)
        row["ratio_to_limit"] = row["prefill"] / lim["limit_tokens"] if lim["limit_tokens"] else None
        rows.append(row)
        print(f"scale/{name}: prefill {row['prefill']}, x limit {row['ratio_to_limit']:.2f}, "
              f"errors {row['errors']}, wall {row['wall_s']:.1f}s", flush=True)
    assert lim is not None
    from bench.report import limit_row

    rows.insert(0, limit_row("scale", lim))
    notes.append(f"scale: 2 llama-servers x {SLOTS} slots, {threads} thread(s) each; limit in the start order of "
                 f"the `{lim['order_from']}` run ({lim['requests']} requests)")
    one = next((r for r in rows if r["config"] == "slotkeeper"), None)
    two = next((r for r in rows if r["config"].startswith("2 proxies")), None)
    if one and two and one["prefill"]:
        diff = 100 * (two["prefill"] / one["prefill"] - 1)
        notes.append(f"scale: two proxies on one Redis store prefill {diff:+.1f}% vs one proxy; evicting placements "
                     f"{two.get('evictions')} vs {one.get('evictions')}")
    return rows, notes


def hotpath_side_by_side(requests: int = 500, rounds: int = 3) -> list[dict[str, Any]]:
    """`bench.hotpath` (in process) with the file store and with a Redis store, one after the other."""
    out = []
    with RedisServer() as store:
        for name, url in (("file", ""), ("redis", store.url)):
            argv = [sys.executable, "-m", "bench.hotpath", "--requests", str(requests), "--rounds", str(rounds)]
            if url:
                argv += ["--state-url", url]
            res = subprocess.run(argv, cwd=str(ROOT), capture_output=True, text=True, timeout=600, check=True)
            out.append({"store": name, **json.loads(res.stdout.strip().splitlines()[-1])})
    return out
