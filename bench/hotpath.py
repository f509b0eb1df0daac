"""In-process cost of the hooks for a known session's request (`python -m bench.hotpath`).

Why: the proxy overhead in `make bench` is mitmproxy's cost plus ours, measured over the network, and it moves
with the machine. This measures only our hooks, in process: every addon of `addon.addons` in chain order, as
mitmproxy calls them, on a known session's next turn (the hot path), with a real but trivial upstream
(`bench.fake_upstream`) for the one `/props` + `/slots` look-up of the session's first request. It works on
any version of the addon that exports `addons`, so two commits can be compared side by side.

Printed: median and p90 microseconds of the request hooks and of the response hooks (responseheaders,
response), over `--rounds` rounds of `--requests` requests, for a body of `--kb` kilobytes.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HOOKS_REQUEST = ("requestheaders", "request")
HOOKS_RESPONSE = ("responseheaders", "response")


def agent_body(kb: int, turns: int) -> dict[str, Any]:
    system = "You are a coding agent. " + " ".join(f"Rule {i}: keep changes small." for i in range(40))
    tools = [{"type": "function", "function": {"name": f"tool{i}", "description": "d" * 200,
                                               "parameters": {"type": "object", "properties": {}}}}
             for i in range(4)]
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system},
                                  {"role": "user", "content": [{"type": "text", "text": "Fix the bug."}]}]
    filler = "x" * max(1, (kb * 1024) // max(turns, 1))
    for t in range(turns):
        msgs.append({"role": "assistant", "content": f"step {t}"})
        msgs.append({"role": "user", "content": f"output {t}: {filler}"})
    return {"model": "m", "messages": msgs, "stream": True, "stream_options": {"include_usage": True},
            "max_completion_tokens": 4, "tools": tools}


async def call(addons: list[Any], hook: str, flow: Any) -> None:
    for a in addons:
        fn = getattr(a, hook, None)
        if fn is None:
            continue
        r = fn(flow)
        if inspect.isawaitable(r):
            await r


async def run(a: argparse.Namespace, upstream: str) -> dict[str, float]:
    from mitmproxy import http
    from mitmproxy.test import taddons, tflow

    from bench.workload import anthropic_body

    sys.path.insert(0, str(ROOT))
    mod = importlib.import_module("addon")
    addons = list(mod.addons)
    answer = json.dumps({"choices": [{"message": {"content": "ok"}}],
                         "timings": {"cache_n": 900, "prompt_n": 20}}).encode()
    with tempfile.TemporaryDirectory() as tmp, taddons.context(*addons) as tctx:
        opts = {"slots_state_dir": tmp, "slots_probe_interval": 0, "slots_log_requests": "off",
                "mode": [f"reverse:{upstream}@127.0.0.1:1"]}
        if a.state_url:
            opts["slots_state_url"] = a.state_url
        for addon in addons:
            known = {k: v for k, v in opts.items() if k in tctx.options or k == "mode"}
            tctx.configure(addon, **known)
        body = agent_body(a.kb, a.turns)

        path = "/v1/chat/completions"
        if a.route == "messages":  # the same conversation as an Anthropic request: translated every time
            body, path = anthropic_body(body["messages"], body["tools"], 4, stream=False), "/v1/messages"

        def make_flow(b: dict[str, Any]) -> Any:
            req = http.Request.make("POST", upstream + path, json.dumps(b).encode(),
                                    {"content-type": "application/json"})
            return tflow.tflow(req=req)

        async def one(b: dict[str, Any]) -> tuple[float, float]:
            f = make_flow(b)
            t0 = time.perf_counter_ns()
            for h in HOOKS_REQUEST:
                await call(addons, h, f)
            t1 = time.perf_counter_ns()
            f.response = http.Response.make(200, answer, {"content-type": "application/json"})
            t2 = time.perf_counter_ns()
            for h in HOOKS_RESPONSE:
                await call(addons, h, f)
            t3 = time.perf_counter_ns()
            return (t1 - t0) / 1000, (t3 - t2) / 1000

        await one(body)  # the session's first request: the slow path (a /props + /slots look-up)
        req_us: list[float] = []
        resp_us: list[float] = []
        for _ in range(a.rounds):
            for _ in range(a.requests):
                r, s = await one(body)
                req_us.append(r)
                resp_us.append(s)
        for addon in addons:
            done = getattr(addon, "done", None)
            if done is not None:
                done()
    q = statistics.quantiles
    return {"request_p50_us": statistics.median(req_us), "request_p90_us": q(req_us, n=10)[-1],
            "response_p50_us": statistics.median(resp_us), "response_p90_us": q(resp_us, n=10)[-1],
            "body_bytes": len(json.dumps(body).encode()), "samples": len(req_us)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kb", type=int, default=20, help="size of the conversation part of the body")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--route", choices=["chat", "messages"], default="chat",
                    help="messages: the body as an Anthropic /v1/messages request (the translation's cost)")
    ap.add_argument("--state-url", default="", help="slots_state_url (e.g. redis://127.0.0.1:6379/0)")
    a = ap.parse_args(argv)
    from slotkeeper.launch.mitmdump import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.fake_upstream", "--port", str(port)], cwd=str(ROOT),
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # "listening"
        out = asyncio.run(run(a, f"http://127.0.0.1:{port}"))
    finally:
        proc.terminate()
        proc.wait(5)
    print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
