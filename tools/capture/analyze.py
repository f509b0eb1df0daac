"""Summarise a client capture (tools/capture/capture_clients.py output) into the facts docs/clients.md records.

For one `<out>/<client>/` folder it prints JSON: every request (route, turn it belongs to, session headers,
system-prompt opening and hash, tool count, cache numbers, overlap with other requests), which headers and
body fields carry a session id, where the system prompts of different sessions first differ, and whether a
later turn's body extends the previous one element by element.

    .venv/bin/python tools/capture/analyze.py /tmp/captures/opencode
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any

SESSIONISH = ("session", "conversation", "thread", "affinity", "request-id", "cache")
# Strings that start or sit in a per-session / per-folder part of some client's system prompt.
MARKERS = ("x-anthropic-billing-header", "<env>", "Working directory", "Primary working directory", "Today's date",
           "Is directory a git repo", "gitStatus", "Current branch", "<environment_context>", "<cwd>",
           "Platform:", "auto memory", "memory", "# Environment", "Environment", "<system-reminder>", "Date:")


def load(folder: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    reqs: dict[int, dict[str, Any]] = {}
    for line in (folder / "capture.jsonl").read_text().splitlines():
        rec = json.loads(line)
        seq = rec.get("seq")
        if rec["event"] == "request":
            reqs[seq] = {**rec, "t0": rec["t"]}
        elif seq in reqs:
            reqs[seq]["outcome"] = rec
    turns = json.loads((folder / "turns.json").read_text())
    return [reqs[k] for k in sorted(reqs)], turns


def system_text(body: dict[str, Any]) -> str:
    """The system prompt as the client laid it out (Anthropic blocks, chat system messages, Responses)."""
    if "system" in body:  # Anthropic Messages
        system = body["system"]
        if isinstance(system, str):
            return system
        return "\n\n".join(block.get("text", "") for block in system)
    if "messages" in body:
        parts = []
        for msg in body["messages"]:
            if msg.get("role") not in ("system", "developer"):
                break
            content = msg.get("content")
            parts.append(content if isinstance(content, str) else
                         "".join(p.get("text", "") for p in content or []))
        return "\n\n".join(parts)
    parts = [body.get("instructions") or ""]
    for item in body.get("input") or []:
        if item.get("role") != "developer":
            break
        parts.extend(c.get("text", "") for c in item.get("content") or [])
    return "\n\n".join(parts)


def conversation(body: dict[str, Any]) -> list[Any]:
    return body.get("messages") or body.get("input") or []


def tool_names(body: dict[str, Any]) -> list[str]:
    names = []
    for tool in body.get("tools") or []:
        names.append(tool.get("name") or (tool.get("function") or {}).get("name") or tool.get("type", "?"))
    return names


def cache_numbers(outcome: dict[str, Any] | None) -> dict[str, Any]:
    if not outcome:
        return {}
    timings = outcome.get("timings") or {}
    usage = outcome.get("usage") or {}
    out = {k: timings.get(k) for k in ("cache_n", "prompt_n", "predicted_n") if k in timings}
    for k in ("input_tokens", "cache_read_input_tokens", "prompt_tokens", "output_tokens", "completion_tokens"):
        if k in usage:
            out[k] = usage[k]
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    if "cached_tokens" in details:
        out["cached_tokens"] = details["cached_tokens"]
    return out


def first_diff(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n if len(a) != len(b) else -1


def append_only(prev: dict[str, Any], cur: dict[str, Any]) -> dict[str, Any]:
    """Does `cur` extend `prev`? Element-wise over the conversation, plus system/tools equality."""
    a, b = conversation(prev), conversation(cur)
    same_head = [json.dumps(x, sort_keys=True) == json.dumps(y, sort_keys=True) for x, y in zip(a, b, strict=False)]
    first_changed = next((i for i, same in enumerate(same_head) if not same), None)
    raw_a = json.dumps(a, separators=(",", ":"))
    raw_b = json.dumps(b, separators=(",", ":"))
    return {"prev_items": len(a), "cur_items": len(b), "prefix_items_equal": first_changed is None,
            "first_changed_item": first_changed,
            "system_equal": system_text(prev) == system_text(cur),
            "tools_equal": json.dumps(prev.get("tools")) == json.dumps(cur.get("tools")),
            "conversation_json_first_diff": first_diff(raw_a, raw_b), "prev_conversation_json_len": len(raw_a)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    a = ap.parse_args()
    reqs, turns = load(a.folder)
    rows = []
    for r in reqs:
        body = r["body"] if isinstance(r["body"], dict) else {}
        headers = {k.lower(): v for k, v in r["headers"]}
        turn = next((f"{t['session']}t{t['turn']}" for t in turns["turns"] if t["start"] <= r["t0"] <= t["end"]),
                    None)
        system = system_text(body) if body else ""
        outcome = r.get("outcome") or {}
        rows.append({
            "seq": r["seq"], "turn": turn, "method": r["method"], "path": r["path"], "body_len": r["body_len"],
            "t0": round(r["t0"], 2), "t1": round(outcome.get("t", 0), 2),
            "status": outcome.get("status"), "error": outcome.get("error"),
            "session_headers": {k: v for k, v in headers.items() if any(s in k for s in SESSIONISH)},
            "user_agent": headers.get("user-agent"),
            "body_keys": list(body),
            "system_chars": len(system), "system_sha": hashlib.sha256(system.encode()).hexdigest()[:12],
            "system_open": system[:90], "tools": len(body.get("tools") or []),
            "items": len(conversation(body)), "max_tokens": body.get("max_tokens"),
            "cache": cache_numbers(outcome), "text": (outcome.get("text") or "")[:60],
            "finish": outcome.get("finish_reason"),
            "body_session_fields": {k: body.get(k) for k in ("metadata", "prompt_cache_key", "user", "session_id")
                                    if k in body},
        })
    overlaps = [(x["seq"], y["seq"]) for i, x in enumerate(rows) for y in rows[i + 1:]
                if x["t1"] and y["t0"] < x["t1"] and x["method"] == "POST" and y["method"] == "POST"]
    by_sha: dict[str, list[int]] = {}
    for row in rows:
        if row["system_chars"]:
            by_sha.setdefault(row["system_sha"], []).append(row["seq"])
    # The main request of each turn: the POST with the most conversation items and the largest body.
    main_rows: dict[str, dict[str, Any]] = {}
    bodies = {r["seq"]: r["body"] for r in reqs}
    for row in rows:
        if row["turn"] and row["method"] == "POST" and row["tools"]:
            cur = main_rows.get(row["turn"])
            if cur is None or (row["system_chars"], row["body_len"]) > (cur["system_chars"], cur["body_len"]):
                main_rows[row["turn"]] = row
    mains = {turn: bodies[row["seq"]] for turn, row in main_rows.items()}
    diffs = {}
    for x, y in (("s1t1", "s2t1"), ("s1t1", "s3t1"), ("s1t1", "s1t2")):
        if x in mains and y in mains:
            sx, sy = system_text(mains[x]), system_text(mains[y])
            at = first_diff(sx, sy)
            diffs[f"{x}~{y}"] = {"system_first_diff": at, "len": [len(sx), len(sy)],
                                 "context_x": sx[max(0, at - 40):at + 60] if at >= 0 else "",
                                 "context_y": sy[max(0, at - 40):at + 60] if at >= 0 else "",
                                 "raw_body_first_diff": first_diff(json.dumps(mains[x]), json.dumps(mains[y]))}
    markers = {}
    if "s1t1" in mains:
        text = system_text(mains["s1t1"])
        markers = {m: text.find(m) for m in MARKERS if m in text}
    appends = {f"{p}->{c}": append_only(mains[p], mains[c]) for p, c in (("s1t1", "s1t2"), ("s2t1", "s2t2"))
               if p in mains and c in mains}
    print(json.dumps({"client": turns["client"], "version": turns["version"],
                      "turns": [{k: t[k] for k in ("session", "turn", "session_id", "seconds", "returncode")}
                                for t in turns["turns"]],
                      "requests": rows, "overlapping_posts": overlaps, "system_prompts_by_sha": by_sha,
                      "main_request_per_turn": {k: v["seq"] for k, v in main_rows.items()},
                      "system_diffs": diffs, "s1t1_marker_offsets": markers,
                      "append_only": appends}, indent=1))


if __name__ == "__main__":
    main()
