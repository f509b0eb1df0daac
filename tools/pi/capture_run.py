"""Record what real pi sends: N concurrent pi windows x T turns, via a capturing mitmdump or directly.

Why: slotkeeper's session identification must match pi's actual wire format, so we look at real traffic
instead of trusting documentation. Run from the repo root with the venv's python:

    .venv/bin/python tools/pi/capture_run.py --mode proxy  --out /tmp/pi_capture   # mitmdump -w + capture addon
    .venv/bin/python tools/pi/capture_run.py --mode direct --out /tmp/pi_direct    # no proxy; pi's own log

Prints a JSON report (requests, headers, body keys, system-prompt markers, side calls, cache_n/prompt_n).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.real.llama_server import LlamaServer  # noqa: E402
from bench.real.mitmdump import MitmProxy  # noqa: E402
from bench.real.pi import PiSession, ensure_pi_installed, run_sessions_concurrently  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capture_addon import sse_summary  # noqa: E402

CAPTURE_ADDON = Path(__file__).resolve().parent / "capture_addon.py"
TOPICS = ["a hash map", "a linked list", "a binary heap", "a trie"]
FOLLOW_UPS = ["Reply with one short sentence: when is it a bad choice?",
              "Reply with one short sentence: name one real program that uses it.",
              "Reply with one short sentence: what is its worst case?"]


def prompts_for(window: int, turns: int) -> list[str]:
    """Distinct first messages per window (two windows of one project share the system prompt)."""
    first = f"Reply with one short sentence: what is {TOPICS[window % len(TOPICS)]}?"
    return [first, *FOLLOW_UPS][:turns]


def system_prompt_facts(system: str) -> dict[str, Any]:
    return {"chars": len(system), "has_cwd_tag": "\n<cwd>" in system or "<cwd>" in system,
            "has_current_date": "\nCurrent date: " in system,
            "has_current_working_directory": "\nCurrent working directory: " in system,
            "tail": system[-160:]}


def read_mitm(path: Path) -> list[dict[str, Any]]:
    """Completed flows from `mitmdump -w` (requests only complete once their response did)."""
    from mitmproxy import io

    rows = []
    with path.open("rb") as f:
        for flow in io.FlowReader(f).stream():
            req = flow.request  # type: ignore[attr-defined]
            if not req.path.startswith("/v1/"):
                continue
            body = json.loads(req.content or b"{}")
            resp = flow.response  # type: ignore[attr-defined]
            timings = sse_summary(resp.content or b"").get("timings", {}) if resp else {}
            rows.append({"path": req.path, "headers": dict(req.headers), "body_keys": list(body),
                         "status": resp.status_code if resp else None,
                         "resp_bytes": len(resp.content or b"") if resp else 0,
                         "cache_n": timings.get("cache_n"), "prompt_n": timings.get("prompt_n")})
    return rows


def summarize_capture(jsonl: Path) -> dict[str, Any]:
    requests: dict[int, dict[str, Any]] = {}
    for line in jsonl.read_text().splitlines():
        rec = json.loads(line)
        if rec["event"] == "request":
            if not rec["path"].startswith("/v1/"):
                continue
            body = rec["body"]
            msgs = body.get("messages", [])
            system = msgs[0]["content"] if msgs and msgs[0]["role"] in ("system", "developer") else ""
            first_user = next((m["content"] for m in msgs if m["role"] == "user"), None)
            requests[rec["seq"]] = {
                "seq": rec["seq"], "path": rec["path"], "t": rec["t"],
                "headers": {k: v for k, v in rec["headers"]},
                "body_keys": list(body), "max_completion_tokens": body.get("max_completion_tokens"),
                "tools": [t["function"]["name"] for t in body.get("tools", [])],
                "roles": [m["role"] for m in msgs], "system": system, "first_user": first_user,
            }
        elif rec.get("seq") in requests:
            r = requests[rec["seq"]]
            r["outcome"] = rec["event"]
            r["timings"] = {k: rec.get("timings", {}).get(k) for k in ("cache_n", "prompt_n", "predicted_n")}
            r["tool_calls"] = rec.get("tool_calls")
            r["finish_reason"] = rec.get("finish_reason")
            r["error"] = rec.get("error")
    rows = sorted(requests.values(), key=lambda r: r["seq"])
    systems = sorted({r["system"] for r in rows}, key=len)
    return {"requests": [{k: v for k, v in r.items() if k != "system"} for r in rows],
            "distinct_system_prompts": [system_prompt_facts(s) for s in systems],
            "side_calls": [r["seq"] for r in rows if "summarization" in r["system"]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["proxy", "direct"], default="proxy")
    ap.add_argument("--out", type=Path, default=Path("/tmp/pi_capture"))
    ap.add_argument("--sessions", type=int, default=2)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--separate-projects", action="store_true", help="one project cwd per window")
    ap.add_argument("--compaction", action="store_true", help="leave pi's auto-compaction on")
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    ensure_pi_installed()
    mitm_file, capture = a.out / "pi_capture.mitm", a.out / "capture.jsonl"
    for f in (mitm_file, capture):
        f.unlink(missing_ok=True)
    report: dict[str, Any] = {"mode": a.mode}
    with LlamaServer(slots=2, ctx_per_slot=8192, log_path=str(a.out / "llama.log")) as server:
        proxy = None
        if a.mode == "proxy":
            proxy = MitmProxy(server.url, addon=False, log_path=str(a.out / "mitm.log"),
                              extra=["-w", str(mitm_file), "-s", str(CAPTURE_ADDON),
                                     "--set", f"capture_path={capture}"]).start()
        try:
            base = proxy.url if proxy else server.url
            sessions = [PiSession(base, a.out / "work", f"w{i}", compaction=a.compaction,
                                  cwd=(a.out / "work" / f"project{i}") if a.separate_projects else None)
                        for i in range(a.sessions)]
            started = time.monotonic()
            results = run_sessions_concurrently(
                sessions, [prompts_for(i, a.turns) for i in range(a.sessions)], timeout=a.timeout)
            report["wall_seconds"] = round(time.monotonic() - started, 1)
        finally:
            if proxy:
                proxy.stop()
    report["turns"] = {s.name: [{"seconds": round(t.seconds, 1), "rc": t.returncode,
                                 "stdout": t.stdout.strip()[:120], "stderr": t.stderr.strip()[-200:]}
                                for t in s.history] for s in sessions}
    report["usage_from_pi_log"] = {s.name: s.assistant_usage() for s in sessions}
    report["returncodes"] = {name: [r.returncode for r in rs] for name, rs in results.items()}
    if a.mode == "proxy":
        report["capture"] = summarize_capture(capture)
        report["mitm_flows"] = read_mitm(mitm_file) if mitm_file.exists() else []
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
