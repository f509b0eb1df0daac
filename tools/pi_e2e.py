"""Real pi sessions end to end: through `make run` (the addon) and, for comparison, straight at llama-server.

Each configuration gets a fresh server. pi's own session log gives `cache_n`/`prompt_n` per request (pi
stores llama-server's cached_tokens as `cacheRead` and the rest as `input`), so the stock run needs no proxy.

    .venv/bin/python tools/pi_e2e.py --sessions 3 --turns 3 [--configs stock,addon,addon+ckpt]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.real.llama_server import LlamaServer  # noqa: E402
from bench.real.pi import PiSession, ensure_pi_installed, run_sessions_concurrently  # noqa: E402
from slotkeeper.launch.mitmdump import free_port  # noqa: E402

TOPICS = ["a hash map", "a linked list", "a binary heap", "a trie", "a bloom filter"]
FOLLOW_UPS = ["Reply with one short sentence: when is it a bad choice?",
              "Reply with one short sentence: name one real program that uses it.",
              "Reply with one short sentence: what is its worst case?"]


def prompts(window: int, turns: int) -> list[str]:
    return [f"Reply with one short sentence: what is {TOPICS[window % len(TOPICS)]}?", *FOLLOW_UPS][:turns]


def start_make_run(llama_port: int, proxy_port: int, slots: int, extra: list[str], log: Path) -> subprocess.Popen:
    args = " ".join(["--set slots_state_dir=" + str(log.parent / "state"),
                     "--set slots_log_file=" + str(log.parent / "requests.jsonl"), *extra])
    cmd = ["make", "run", f"LLAMA_PORT={llama_port}", f"PROXY_PORT={proxy_port}", f"SLOTS={slots}", f"ARGS={args}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{proxy_port}/_slots/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    raise TimeoutError("make run did not come up; see " + str(log))


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def run_config(name: str, sessions: int, turns: int, slots: int, work: Path) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    if name == "stock":
        server = LlamaServer(slots=slots, ctx_per_slot=8192, log_path=str(work / "llama.log")).start()
        base, proc = server.url, None
    else:
        # make run points slots_save_dir at its own server's --slot-save-path: checkpoints are on by default.
        extra = [] if name == "addon+ckpt" else ["--set slots_prefix_cache=off"]
        proxy_port = free_port()
        proc = start_make_run(free_port(), proxy_port, slots, extra, work / "make-run.log")
        base, server = f"http://127.0.0.1:{proxy_port}", None
    try:
        windows = [PiSession(base, work, f"w{i}") for i in range(sessions)]
        started = time.monotonic()
        results = run_sessions_concurrently(windows, [prompts(i, turns) for i in range(sessions)], timeout=600)
        wall = time.monotonic() - started
    finally:
        if proc is not None:
            stop(proc)
        if server is not None:
            server.stop()
    per = {w.name: w.assistant_usage() for w in windows}
    log = work / "requests.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    proxy_prefill = sum(r.get("prompt_n") or 0 for r in records if r.get("kind") == "checkpoint")
    return {"config": name, "wall_s": round(wall, 1), "returncodes": {k: [r.returncode for r in v]
                                                                        for k, v in results.items()},
            "turns": per,
            "prefill": sum(u["prompt_n"] or 0 for rows in per.values() for u in rows),
            "checkpoint_prefill": proxy_prefill,  # warm-ups and verification probes the proxy itself sent
            "cached": sum(u["cache_n"] or 0 for rows in per.values() for u in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--configs", default="stock,addon")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    ensure_pi_installed()
    work = Path(tempfile.mkdtemp(prefix="pi-e2e-"))
    report = [run_config(c, a.sessions, a.turns, a.slots, work / c.replace("+", "-"))
              for c in a.configs.split(",")]
    text = json.dumps(report, indent=1)
    print(text)
    for r in report:
        print(f"\n{r['config']}: prefill {r['prefill']} (+{r['checkpoint_prefill']} by checkpoint warm-ups) "
              f"cached {r['cached']} wall {r['wall_s']} s")
        for w, rows in r["turns"].items():
            print(f"  {w}: " + "  ".join(f"{u['prompt_n']}/{u['cache_n']}" for u in rows) + "   (prompt_n/cache_n)")
    if a.out:
        a.out.write_text(text)


if __name__ == "__main__":
    main()
