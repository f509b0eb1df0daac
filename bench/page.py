"""The slot page's costs (`python -m bench.page`): its render time in headless Chromium with a large status, and
a known session's request latency through a real mitmdump with and without the page open.

- render: the page served with a synthetic status of `--slots` slots and `--sessions` sessions (plus a full
  timeline: 2,048 spans, 1,024 marks); each load is timed from navigation start to the end of its first
  render (`data-first-render-at`), and each later refresh's render alone (`data-render-ms`).
- hot path: one mitmdump + addon in front of `bench.fake_upstream` (answers in microseconds, so what is
  measured is the proxy); a known session sends `--requests` requests per phase, and phases alternate
  between one headless Chromium on `about:blank` and the same browser showing `/_slots/` (refreshing every
  second), `--phases` times each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

from bench.real.browser import Browser
from bench.real.mitmdump import ROOT, MitmProxy
from slotkeeper.launch.mitmdump import free_port

CAUSES = ("evicted", "other-process", "restart", "side-call")
KINDS = ("page-out", "page-in", "seed", "prefix", "loss")


def synthetic_status(slots: int = 8, sessions: int = 200, now: float = 1.8e9) -> dict[str, Any]:
    """A status of the real shape (`/_slots/status`), as large as a busy proxy's: for the render test."""
    keys = [f"{i * 2654435761 % (1 << 32):08x}" for i in range(sessions)]
    sess = {k: {"slot": i % slots, "requests": 1 + i % 17, "prefill_tokens": 300 + 7 * i,
                "cached_tokens": 4000 + 13 * i, "reuse_pct": round(100 * (4000 + 13 * i) / (4300 + 20 * i), 1),
                "saved_s": round(0.01 * i, 2),
                "source": "content:root", "lost_tokens": 50 * (i % 5), "lost_unexpected": 0}
            for i, k in enumerate(keys)}
    spans = [{"start": now - 600 + i * 0.29, "end": now - 600 + i * 0.29 + 0.8, "slot": i % slots,
              "session": keys[i % sessions]} for i in range(2048 if sessions else 0)]
    marks = [{"t": now - 600 + i * 0.58, "slot": i % slots, "kind": KINDS[i % len(KINDS)],
              "session": keys[i % sessions], "tokens": 1000 + i} for i in range(1024 if sessions else 0)]
    extras = {k: {"client": "chat/content:root" if i % 3 else "claude-code",
                  "lost_by_cause": {CAUSES[i % 4]: 50 * (i % 5)} if i % 5 else {},
                  "pages_out": i % 3, "pages_in": i % 2} for i, k in enumerate(keys)}
    server = {"upstream": "http://127.0.0.1:8080", "media_marker": None, "total_slots": slots,
              "n_ctx_per_slot": 8192, "prefill_s_saved": round(sum(s["saved_s"] for s in sess.values()), 2),
              "slots": [{"id": i, "session": keys[i] if i < sessions else None, "last_used_s_ago": 1.0,
                         "claimed": i < sessions} for i in range(slots)],
              "sessions": sess, "model": {"architecture": "llama", "layers": 30}, "page_budget": {"mb": 4096,
              "tokens": 180000}, "throughput": {"prefill_tok_s": 1234.5, "decode_tok_s": 99.0},
              "pages": {k: {"bytes": (1 + i % 4) << 20, "tokens": 3000} for i, k in enumerate(keys[::2])},
              "recent": {"now": now, "horizon_s": 600.0, "spans": spans, "marks": marks,
                         "warnings": [{"t": now - 5, "line": "slotkeeper: a warning, worded by slotlogic.wording"}],
                         "sessions": extras}}
    return {"policy": "auto", "ttl": 120.0, "servers": [server], "warnings": [], "waiting": [], "state": "file"}


@contextmanager
def serve_page(status: Callable[[], dict[str, Any]]) -> Iterator[str]:
    """The real page file and a given status, on a loopback port: `<url>/_slots/`."""
    from slotkeeper.mitm.localapi import page

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_: Any) -> None:
            pass

        def do_GET(self) -> None:
            if self.path == "/_slots/":
                body, kind = page(), "text/html; charset=utf-8"
            elif self.path == "/_slots/status":
                body, kind = json.dumps(status()).encode(), "application/json"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def render_times(slots: int, sessions: int, loads: int) -> dict[str, float]:
    status = synthetic_status(slots, sessions)
    first: list[float] = []
    refresh: list[float] = []
    with serve_page(lambda: status) as base, Browser() as b:
        for _ in range(loads):
            b.open(base + "/_slots/")
            first.append(float(b.dataset()["firstRenderAt"]))
            b.wait_renders(2)
            refresh.append(float(b.dataset()["renderMs"]))
    return {"first_render_ms_p50": statistics.median(first), "first_render_ms_max": max(first),
            "refresh_render_ms_p50": statistics.median(refresh), "refresh_render_ms_max": max(refresh)}


def hot_path(requests: int, phases: int) -> dict[str, dict[str, float]]:
    body = {"model": "m", "messages": [{"role": "system", "content": "You are a coding agent. " * 40},
                                       {"role": "user", "content": "Fix the bug."}], "max_tokens": 4}
    port = free_port()
    fake = subprocess.Popen([sys.executable, "-m", "bench.fake_upstream", "--port", str(port)], cwd=str(ROOT),
                            stdout=subprocess.PIPE)
    lat: dict[str, list[float]] = {"without page": [], "page open, refreshing 1/s": []}
    try:
        assert fake.stdout is not None
        fake.stdout.readline()
        with tempfile.TemporaryDirectory() as tmp, \
                MitmProxy(f"http://127.0.0.1:{port}", {"slots_state_dir": str(Path(tmp) / "state"),
                                                       "slots_probe_interval": 0}) as px, \
                httpx.Client(base_url=px.url, timeout=10) as client:
            client.post("/v1/chat/completions", json=body).raise_for_status()  # the slow path, once
            with Browser() as browser:  # one browser for both: only the open, refreshing page differs
                for _ in range(phases):
                    for name in lat:
                        page = name != "without page"
                        browser.driver.get(px.url + "/_slots/" if page else "about:blank")
                        seen = browser.renders() if page else 0
                        for _ in range(requests):
                            t0 = time.perf_counter()
                            client.post("/v1/chat/completions", json=body).raise_for_status()
                            lat[name].append((time.perf_counter() - t0) * 1000)
                            time.sleep(0.03)  # a phase spans 3 s or more: several refreshes
                        if page:
                            assert browser.renders() > seen + 1, "the page did not refresh during the phase"
    finally:
        fake.terminate()
        fake.wait(5)
    return {name: {"p50_ms": statistics.median(v), "p90_ms": statistics.quantiles(v, n=10)[-1],
                   "samples": len(v)} for name, v in lat.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--loads", type=int, default=5)
    ap.add_argument("--requests", type=int, default=100, help="requests per phase")
    ap.add_argument("--phases", type=int, default=8)
    a = ap.parse_args(argv)
    r = render_times(a.slots, a.sessions, a.loads)
    print(f"render, {a.slots} slots, {a.sessions} sessions, {a.loads} loads: first render p50 "
          f"{r['first_render_ms_p50']:.0f} ms (max {r['first_render_ms_max']:.0f}), refresh render p50 "
          f"{r['refresh_render_ms_p50']:.0f} ms (max {r['refresh_render_ms_max']:.0f})")
    print("| known session, via mitmdump | p50 ms | p90 ms | requests |\n|---|---:|---:|---:|")
    for name, v in hot_path(a.requests, a.phases).items():
        print(f"| {name} | {v['p50_ms']:.2f} | {v['p90_ms']:.2f} | {v['samples']} |")


if __name__ == "__main__":
    main()
