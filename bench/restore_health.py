"""What a server whose restores do not take costs through the proxy (`python -m bench.restore_health`).

A real llama-server (SmolLM2, `--slot-save-path`) behind `bench.restore_faults.RestoreFault` (`noop`: every
restore answers with the real counts and keeps nothing, llama.cpp #26676), a real mitmdump with the addon in
front. Agents take turns on fewer slots than there are agents (`--agents` on `--slots`, `--turns` requests,
each turn one more exchange of that agent's conversation), so most turns find the agent's conversation paged
out. Reported: restores sent and the tokens they answered, the restores the proxy judged, page-move seconds,
Σprompt_n and its ratio to the physical limit (`bench.limit`), before and after the verdict.

Run it from another checkout (`PYTHONPATH=<checkout> python -m bench.restore_health`, with this file and
`bench/restore_faults.py` copied there) to measure a build of the proxy without the verdict.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.limit import workload_limit
from bench.real.llama_server import LlamaServer
from bench.real.mitmdump import MitmProxy
from bench.restore_faults import RestoreFault

SYSTEM = "You are a careful coding agent working in a repository. " + " ".join(
    f"Rule {i}: read files before editing them, run the tests, and keep changes small." for i in range(10))


def extend(msgs: list[dict[str, str]], n: int) -> None:
    msgs.append({"role": "assistant", "content": f"Running step {n} now."})
    msgs.append({"role": "user", "content": f"Output of step {n}: " + " ".join(f"line{n}-{k} ok" for k in range(25))})


def traffic(url: str, agents: int, turns: int) -> tuple[list[dict[str, Any]], list[list[dict[str, str]]]]:
    convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Task {a}: keep it all."}]
             for a in range(agents)]
    answers, sent = [], []
    with httpx.Client(timeout=600) as c:
        for turn in range(turns):
            a = turn % agents
            if turn >= agents:
                extend(convs[a], turn)
            started = time.monotonic()
            r = c.post(url + "/v1/chat/completions", json={"messages": convs[a], "max_tokens": 4, "temperature": 0})
            r.raise_for_status()
            t = r.json()["timings"]
            answers.append({"agent": a, "cache_n": t["cache_n"], "prompt_n": t["prompt_n"],
                            "seconds": time.monotonic() - started, "t": time.time()})
            sent.append([dict(m) for m in convs[a]])
    return answers, sent


def measure(mode: str, agents: int, slots: int, turns: int, threads: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="restore-health-") as tmp:
        root = Path(tmp)
        save = root / "slots"
        save.mkdir()
        log, jsonl = root / "p.log", root / "req.jsonl"
        opts = {"slots_state_dir": str(root / "state"), "slots_log_file": str(jsonl), "slots_save_dir": str(save),
                "slots_prefix_cache": "off"}
        with LlamaServer(threads=threads, slots=slots, ctx_per_slot=4096, slot_save_path=str(save),
                         log_path=str(root / "s.log")) as srv, RestoreFault(srv.url, mode, save) as fault, \
                MitmProxy(fault.url, opts, log_path=str(log)) as px:
            answers, sent = traffic(px.url, agents, turns)
            limit = workload_limit(srv.url, [(m, []) for m in sent])
            time.sleep(1.0)
            restores = list(fault.restores)
        records = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
        text = log.read_text()
    return summarize(mode, answers, records, restores, limit, text)


def summarize(mode: str, answers: list[dict[str, Any]], records: list[dict[str, Any]],
              restores: list[tuple[int, int, float]], limit: dict[str, Any], text: str) -> dict[str, Any]:
    verdict = next((r["t"] for r in records if r["kind"] == "restores-broken"), None)
    pages = [r for r in records if r["kind"] == "page"]

    def split(rows: list[Any], at: Any) -> tuple[list[Any], list[Any]]:
        return ([r for r in rows if verdict is None or at(r) <= verdict],
                [r for r in rows if verdict is not None and at(r) > verdict])

    r_before, r_after = split(restores, lambda r: r[2])
    p_before, p_after = split(pages, lambda r: r["t"])
    prompt = sum(a["prompt_n"] for a in answers)
    return {
        "mode": mode, "turns": len(answers), "limit_tokens": limit["limit_tokens"], "prompt_n": prompt,
        "x_limit": round(prompt / max(1, limit["limit_tokens"]), 2),
        "restores_sent": len(restores), "restores_before_verdict": len(r_before),
        "restores_after_verdict": len(r_after),
        "restored_tokens_lost_after_verdict": sum(r[1] for r in r_after) if mode == "noop" else 0,
        "page_seconds_before": round(sum(p["seconds"] for p in p_before), 3),
        "page_seconds_after": round(sum(p["seconds"] for p in p_after), 3),
        "verdict_line": sum(1 for line in text.splitlines() if "restores answer but do not take" in line),
        "wall_s": round(sum(a["seconds"] for a in answers), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="noop", choices=("noop", "pass"))
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--turns", type=int, default=18)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    print(json.dumps(measure(a.mode, a.agents, a.slots, a.turns, a.threads)))


if __name__ == "__main__":
    main()
