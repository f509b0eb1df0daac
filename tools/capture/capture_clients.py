"""Capture what the real agent clients send: 2 sessions x 2 turns in one project, plus 1 session in another.

Why: slotkeeper's session, prefix and side-call rules must match real traffic. For each client this starts a
fresh embedded llama-server on the long-context SmolLM2 copy (bench/real/long_context.py), a plain mitmdump in
front of it (`-w` flows + tools/capture/capture_addon.py, no slotkeeper), and runs, one after another:
session 1 turn 1, session 1 turn 2, session 2 turn 1, session 2 turn 2 (both in project A, a git repo),
then session 3 turn 1 in project B (not a git repo). All sessions share one throw-away HOME, like one user.

    .venv/bin/python tools/capture/capture_clients.py --out /tmp/captures claude-code opencode codex qwen-code

Writes <out>/<client>/{flows.mitm, capture.jsonl, turns.json, llama.log, mitm.log}. The captures hold the
clients' full prompts and local paths: keep them out of the repository.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.real.clients import CLIENTS, ClientSession  # noqa: E402
from bench.real.llama_server import LlamaServer  # noqa: E402
from bench.real.long_context import long_context_model  # noqa: E402
from bench.real.mitmdump import MitmProxy  # noqa: E402

ADDON = Path(__file__).resolve().parent / "capture_addon.py"
PROMPTS = {
    "s1": ["Reply with one short sentence: what is a hash map?",
           "Reply with one short sentence: when is it a bad choice?"],
    "s2": ["Reply with one short sentence: what is a linked list?",
           "Reply with one short sentence: name one program that uses it."],
    "s3": ["Reply with one short sentence: what is a binary heap?"],
}

# Same questions, worded so the first messages differ within their first 21 characters.
DISTINCT_PROMPTS = {
    "s1": ["Hash maps: reply with one short sentence saying what they are.", PROMPTS["s1"][1]],
    "s2": ["Linked lists? Reply with one short sentence.", PROMPTS["s2"][1]],
    "s3": ["Define a binary heap in one short sentence.", PROMPTS["s3"][0]],
}


def make_projects(work: Path) -> tuple[Path, Path]:
    """Project A: a small git repo with one commit; project B: a plain folder with one file."""
    a, b = work / "project-a", work / "project-b"
    for p in (a, b):
        p.mkdir(parents=True, exist_ok=True)
    (a / "README.md").write_text("# demo\nA tiny project used to capture agent traffic.\n")
    (a / "main.py").write_text("def add(a, b):\n    return a + b\n")
    (b / "notes.txt").write_text("scratch notes\n")
    if not (a / ".git").exists():
        git = ["git", "-C", str(a), "-c", "user.name=capture", "-c", "user.email=capture@localhost"]
        subprocess.run([*git, "init", "-q"], check=True)
        subprocess.run([*git, "add", "."], check=True)
        subprocess.run([*git, "commit", "-q", "-m", "initial"], check=True)
    return a, b


def run_client(name: str, out: Path, work_root: Path, slots: int, ctx: int, threads: int, timeout: float,
               context_length: int, tag: str = "", client_env: dict[str, str] | None = None,
               client_args: list[str] | None = None, prompts: dict[str, list[str]] | None = None) -> dict[str, Any]:
    cls = CLIENTS[name]
    cls.ensure_installed()
    prompts = prompts or PROMPTS
    dest = out / (name + tag)
    dest.mkdir(parents=True, exist_ok=True)
    for f in ("flows.mitm", "capture.jsonl", "llama.log", "mitm.log"):
        (dest / f).unlink(missing_ok=True)
    work = work_root / (name + tag)
    a, b = make_projects(work)
    home = work / "home"
    model = long_context_model(context_length)
    report: dict[str, Any] = {"client": name, "version": cls.version, "slots": slots, "ctx_per_slot": ctx,
                              "threads": threads, "client_env": client_env, "client_args": client_args,
                              "turns": []}
    kw: dict[str, Any] = {"context_window": ctx, "extra_env": client_env or {}, "extra_args": client_args or ()}
    with LlamaServer(slots=slots, ctx_per_slot=ctx, threads=threads, model=str(model), n_predict=32,
                     log_path=str(dest / "llama.log")) as server, \
            MitmProxy(server.url, addon=False, log_path=str(dest / "mitm.log"),
                      extra=["-w", str(dest / "flows.mitm"), "-s", str(ADDON),
                             "--set", f"capture_path={dest / 'capture.jsonl'}"]) as proxy:
        sessions: dict[str, ClientSession] = {
            "s1": cls(proxy.url, a, home, **kw),
            "s2": cls(proxy.url, a, home, **kw),
            "s3": cls(proxy.url, b, home, **kw),
        }
        plan = [("s1", 0), ("s1", 1), ("s2", 0), ("s2", 1), ("s3", 0)]
        for key, i in plan:
            started = time.time()
            res = sessions[key].run_turn(prompts[key][i], timeout=timeout)
            row = {"session": key, "turn": i + 1, "session_id": sessions[key].session_id, "start": started,
                   "end": time.time(), "seconds": res.seconds, "returncode": res.returncode,
                   "stdout_tail": res.stdout_tail[-600:], "stderr_tail": res.stderr_tail[-1200:]}
            report["turns"].append(row)
            print(json.dumps({k: row[k] for k in ("session", "turn", "seconds", "returncode")}), flush=True)
            (dest / "turns.json").write_text(json.dumps(report, indent=1))
            time.sleep(2)  # let trailing side calls (memory extraction, titles) reach the proxy log
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("clients", nargs="+", choices=sorted(CLIENTS))
    ap.add_argument("--out", type=Path, required=True)
    # Outside any git repository, or the clients report the enclosing repo's git status.
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "slotkeeper-capture-work")
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--context-length", type=int, default=32768)
    ap.add_argument("--tag", default="", help="suffix for the output folder, e.g. -noattr")
    ap.add_argument("--client-env", action="append", default=[], metavar="K=V", help="extra client env")
    ap.add_argument("--client-arg", action="append", default=[], help="extra client argument (repeat)")
    ap.add_argument("--distinct-openings", action="store_true",
                    help="first prompts that differ early (Claude Code's billing line hashes chars 4, 7, 20)")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the server, proxy and client
    env = dict(item.split("=", 1) for item in a.client_env)
    prompts = DISTINCT_PROMPTS if a.distinct_openings else PROMPTS
    for name in a.clients:
        run_client(name, a.out, a.work, a.slots, a.ctx, a.threads, a.timeout, a.context_length, a.tag, env,
                   a.client_arg, prompts)


if __name__ == "__main__":
    main()
