"""`python -m bench.loss_trace [bench/results/latest.json]`: every loss the bench counted, with the proxy's
JSON-lines records around it and a first classification.

Why: the `lost (bench)` column says how much was lost, not why. For each request that lost tokens
(`bench.loss.bench_lost`), this prints the proxy's records on that slot between the session's previous answer
and the lossy request's answer (placements, page steps, prefix-cache steps, source waits; a step that ends
while the request runs may have written the slot before it), and labels the loss from them:

- `slot-written-under-owner`: the session went out as `known` on its slot, and a page step or prefix-cache
  step of another placement wrote that slot after the session's previous answer;
- `stale-page`: the session was paged in from a page shorter than the conversation it had already sent;
- `placed-as-new`: the proxy placed the session as a new one (its claim expired after `slots_ttl`, or it was
  forgotten), and it was not given its conversation back;
- `unexplained`: none of the above (read the records).

When the proxy has a loss meter, its own `loss` of the request is printed beside it. The records carry no prompt
text; sessions are matched to the bench's by `cache_n`/`prompt_n` and time.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.loss import TOLERANCE


@dataclass
class Loss:
    workload: str
    config: str
    session: str  # the bench's session id (m1.a1)
    index: int
    tokens: int
    had: int  # the previous request's prompt length
    cache_n: int
    kind: str
    proxy_session: str | None
    reason: str | None
    slot: int | None
    records: list[dict[str, Any]]
    proxy_loss: dict[str, Any] | None = None  # the proxy's own `loss` on that request record, once it has a meter


def _match(rec: dict[str, Any], requests: list[dict[str, Any]], t0: float | None) -> dict[str, Any] | None:
    """The proxy's `request` record of a bench record: same cache_n and prompt_n, the nearest end time."""
    same = [q for q in requests if q.get("cache_n") == rec["cache_n"] and q.get("prompt_n") == rec["prompt_n"]]
    if len(same) <= 1 or t0 is None:
        return same[0] if same else None
    end = t0 + rec["start_s"] + rec["total_s"]
    return min(same, key=lambda q: abs(q["t"] - end))


def _clock(records: list[dict[str, Any]], bench: list[dict[str, Any]]) -> float | None:
    """The wall time of the bench run's t=0, from the first uniquely matched request."""
    reqs = [q for q in records if q.get("kind") == "request" and "t" in q]
    for r in bench:
        same = [q for q in reqs if q.get("cache_n") == r["cache_n"] and q.get("prompt_n") == r["prompt_n"]]
        if len(same) == 1:
            return float(same[0]["t"]) - r["start_s"] - r["total_s"]
    return None


def classify(reason: str | None, slot: int | None, had: int, between: list[dict[str, Any]],
             own: str | None) -> str:
    """The loss kind from the lossy request's reason and the proxy's records on its slot since its last answer."""
    if reason and "paged-in" in reason:
        paged = [p for p in between if p.get("kind") == "page" and own and p.get("in") == own[:8]]
        if paged and (paged[-1].get("in_tokens") or 0) + TOLERANCE < had:
            return "stale-page"
    if reason == "known":
        writes = [p for p in between if p.get("slot") == slot and p.get("kind") in ("page", "checkpoint")]
        if writes:
            return "slot-written-under-owner"
    if reason and not reason.startswith(("known", "displaced", "resumed", "side-call")):
        return "placed-as-new"  # the proxy no longer knew the session (its claim expired, or it was forgotten)
    return "unexplained"


def trace(doc: dict[str, Any], log_dir: Path | None = None) -> list[Loss]:
    """Every bench-counted loss of the proxied runs in a bench result (`latest.json`)."""
    log_dir = log_dir or Path(doc["meta"]["log_dir"])
    out: list[Loss] = []
    for run in doc["runs"]:
        wl, cfg = run["workload"], run["config"]
        path = log_dir / f"{wl}-{cfg}.requests.jsonl"
        if not path.exists():
            continue
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        bench = [r for r in run["records"] if r["error"] is None and r["cache_n"] is not None]
        t0 = _clock(records, bench)
        reqs = [q for q in records if q.get("kind") == "request"]
        last: dict[str, dict[str, Any]] = {}
        for r in bench:
            prev = last.get(r["session"])
            last[r["session"]] = r
            if prev is None:
                continue
            had = prev["cache_n"] + prev["prompt_n"]
            if had - r["cache_n"] <= TOLERANCE:
                continue
            q, p = _match(r, reqs, t0), _match(prev, reqs, t0)
            slot = q.get("slot") if q else None
            lo = p["t"] if p else float("-inf")
            hi = q["t"] if q else float("inf")  # a step that ends while the request runs may have written first
            server = q.get("upstream") if q else None  # several servers: slot ids repeat across them
            between = [x for x in records if lo <= x.get("t", 0.0) <= hi and x is not p
                       and x.get("upstream") == server and (x.get("slot") == slot or x.get("kind") == "page")]
            own = q.get("session") if q else None
            kind = classify(q.get("reason") if q else None, slot, had, between, own)
            out.append(Loss(wl, cfg, r["session"], r["index"], had - r["cache_n"], had, r["cache_n"], kind,
                            own[:8] if own else None, q.get("reason") if q else None, slot, between,
                            q.get("loss") if q else None))
    return out


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    path = Path(args[0]) if args else Path(__file__).resolve().parent / "results" / "latest.json"
    losses = trace(json.loads(path.read_text()))
    for x in losses:
        print(f"{x.workload}/{x.config} {x.session}#{x.index} (proxy {x.proxy_session}) slot={x.slot} "
              f"why={x.reason}: lost {x.tokens} of {x.had} tokens -> {x.kind}; the proxy's own: "
              f"{json.dumps(x.proxy_loss) if x.proxy_loss else 'none'}")
        for rec in x.records:
            fields = {k: v for k, v in rec.items() if k not in ("upstream", "path", "source", "error")}
            print("    " + json.dumps(fields))
    kinds: dict[str, int] = {}
    for x in losses:
        kinds[f"{x.workload}/{x.config} {x.kind}"] = kinds.get(f"{x.workload}/{x.config} {x.kind}", 0) + x.tokens
    for k, v in sorted(kinds.items()):
        print(f"{k}: {v} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
