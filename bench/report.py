"""Metrics and output: the results table (stdout, JSON, Markdown) and the prefill-over-time plot (PNG).

All cache numbers come from what llama-server itself reported per request (`timings.prompt_n`,
`timings.cache_n`), never from client-side guesses; the limit row comes from `bench.limit`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.client import RequestRecord
from bench.overhead import percentile

# Beside x limit in every table: the proxy's own lost-token count (`–`: no proxy, or a proxy without the
# meter), its unlabelled part, and the bench's ground truth from cache_n (bench/loss.py).
LOSS_COLUMNS = [("lost", "lost"), ("lost_unknown", "lost unlabelled"), ("lost_bench", "lost (bench)")]
NO_METER = "–"
# The cost model's moves (the proxy's JSONL `cost` records, `slotlogic.costs.Move`): the move's name when made,
# and what was done instead when prefilling was the quicker.
COST_MOVES = (("page-in", "page-in", "prefill"), ("prefix", "prefix restore", "warm-up"),
              ("page-out", "page-out", "let go"), ("live-seed", "live copy", "prefill"))

# The real-client rows (bench/client_workloads.py): key in the row, column title.
CLIENT_COLUMNS = [("workload", "workload"), ("config", "config"), ("requests", "requests"),
                  ("side_calls", "side calls"), ("prefill", "prefill tok"), ("warmup", "of which warm-up"),
                  ("ratio_to_limit", "x limit"), *LOSS_COLUMNS, ("own_limit", "own limit"),
                  ("ratio_to_own_limit", "x own limit"), ("later_reuse_pct", "turn 2+ reuse %"),
                  ("later_worst_pct", "worst turn 2+ %"), ("new_turn1", "new session turn 1 cached/new"),
                  ("page_ins", "page-ins"), ("mismatches", "count mismatches"), ("wall_s", "turns s"),
                  ("total_s", "config s"),
                  ("errors", "errors")]


COLUMNS = [("workload", "workload"), ("config", "config"), ("requests", "requests"),
           ("prefill", "prefill tok"), ("warmup", "of which proxy warm-up"), ("cached", "cached tok"),
           ("paged_in_tokens", "paged-in tok"), ("reuse_pct", "reuse %"),
           ("ratio_to_limit", "x limit"), *LOSS_COLUMNS, ("wall_s", "wall s"), ("ttft_p50_ms", "TTFT p50 ms"),
           ("ttft_p95_ms", "TTFT p95 ms"), ("errors", "errors"), ("evictions", "evicting placements"),
           ("cost", "cost model: made / prefilled instead")]
OVERHEAD_COLUMNS = [("target", "target"), ("requests", "requests"), ("rps", "req/s"), ("p50_ms", "p50 ms"),
                    ("p99_ms", "p99 ms"), ("added_p50_ms", "added p50 ms"), ("added_p99_ms", "added p99 ms"),
                    ("errors", "errors")]


def run_row(workload: str, config: str, records: list[RequestRecord], wall_s: float,
            limit_tokens: int | None, warmup: int = 0, paging: dict[str, Any] | None = None) -> dict[str, Any]:
    """One table row for a configuration x workload run. `warmup`: tokens the proxy itself had the server
    prefill (checkpoint warm-ups and probes); they count in `prefill`, so no configuration hides work.
    `paging`: what session paging restored from files instead of prefilling (`cached` includes it, since
    the server reports restored tokens as cache hits), with its page-in/out counts and seconds."""
    ok = [r for r in records if r.error is None and r.prompt_n is not None]
    prefill = sum(r.prompt_n or 0 for r in ok) + warmup
    cached = sum(r.cache_n or 0 for r in ok)
    ttfts = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    return {"workload": workload, "config": config, "requests": len(records), "prefill": prefill,
            "warmup": warmup,
            "cached": cached, "reuse_pct": 100.0 * cached / (cached + prefill) if cached + prefill else None,
            "ratio_to_limit": prefill / limit_tokens if limit_tokens else None, "wall_s": wall_s,
            "ttft_p50_ms": percentile(ttfts, 50) if ttfts else None,
            "ttft_p95_ms": percentile(ttfts, 95) if ttfts else None,
            "errors": len(records) - len(ok), **(paging or {}),
            "cost": cost_text(paging.get("cost_choices")) if paging else None}


def cost_text(choices: dict[str, dict[str, int]] | None) -> str:
    """`page-in 3 / prefill 1, page-out 2 / let go 0, …` (moves never weighed left out; `-`: none weighed)."""
    if not choices:
        return "-"
    parts = [f"{made} {choices[m]['moved']} / {instead} {choices[m]['instead']}" for m, made, instead in COST_MOVES
             if m in choices and choices[m]["moved"] + choices[m]["instead"]]
    return ", ".join(parts) or "-"


def limit_row(workload: str, limit: dict[str, Any]) -> dict[str, Any]:
    total, need = limit["prompt_tokens"], limit["limit_tokens"]
    return {"workload": workload, "config": "limit", "requests": limit["requests"], "prefill": need,
            "cached": total - need, "reuse_pct": 100.0 * (total - need) / total if total else None,
            "ratio_to_limit": 1.0, "wall_s": None, "ttft_p50_ms": None, "ttft_p95_ms": None, "errors": 0,
            **{k: "" for k, _ in LOSS_COLUMNS}}


def fmt(key: str, value: Any) -> str:
    if value is None:
        return NO_METER if key in ("lost", "lost_unknown") else "-"
    if isinstance(value, float):
        if key.startswith("ratio_to_"):
            return f"{value:.2f}"
        if key.endswith("_ms") and abs(value) < 10:
            return f"{value:.2f}"
        return f"{value:.1f}" if key.endswith("_pct") or key in ("wall_s", "total_s") else f"{value:.0f}"
    return str(value)


def text_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    cells = [[h for _, h in columns]] + [[fmt(k, r.get(k)) for k, _ in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def md_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    out = ["| " + " | ".join(h for _, h in columns) + " |",
           "|" + "|".join("---" if i < 2 else "---:" for i in range(len(columns))) + "|"]
    out += ["| " + " | ".join(fmt(k, r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join(out)


def server_text(server: dict[str, Any], markdown: bool = False) -> str:
    """The server's own numbers (bench/costs.py's moves): model, build, KV bytes a token and the speeds."""
    tok_s = [t for t in server.get("prefill_tok_s") or [] if t]
    sizes = [m["tokens"] for m in server.get("moves") or [] if m.get("tokens")]
    kv = server.get("kv_bytes_per_token")
    save, restore = server.get("save_gb_s"), server.get("restore_gb_s")
    cells = [("model", str(server.get("model"))), ("build", str(server.get("build"))),
             ("KV cache", str(server.get("kv"))), ("KV bytes per token", f"{kv:,.0f}" if kv else "-"),
             ("prefill tok/s", f"{min(tok_s):,.0f}-{max(tok_s):,.0f} ({len(tok_s)} moves of {min(sizes)}-"
                               f"{max(sizes)} tokens)" if tok_s and sizes else "-"),
             ("save GB/s", f"{save:.2f}" if save else "-"), ("restore GB/s", f"{restore:.2f}" if restore else "-"),
             ("cost model on these moves",
              f"picked the faster of restore and prefill {server.get('right')}/{server.get('of')}")]
    if markdown:
        return "\n".join(["| server | |", "|---|---|", *(f"| {k} | {v} |" for k, v in cells)])
    return "\n".join(f"{k + ':':<27} {v}" for k, v in cells)


def overhead_text(overhead: dict[str, Any], markdown: bool = False) -> str:
    table = (md_table if markdown else text_table)(overhead["rows"], OVERHEAD_COLUMNS)
    per_round = ", ".join(f"{d:.2f}" for d in overhead["addon_cost_per_round_ms"])
    verdict = "within" if overhead["within_target"] else "OVER"
    text = (f"{table}\n\naddon cost over no-op addon (p50): {overhead['addon_cost_p50_ms']:.3f} ms "
            f"({verdict} the {overhead['target_ms']} ms target); per round: {per_round}")
    if overhead.get("translation_cost_p50_ms") is not None:
        rounds = ", ".join(f"{d:.2f}" for d in overhead["translation_cost_per_round_ms"])
        text += (f"\nAnthropic translation over a pinned chat request (p50): "
                 f"{overhead['translation_cost_p50_ms']:.3f} ms (target {overhead['translation_target_ms']} ms); "
                 f"per round: {rounds}")
    return text


def render_markdown(meta: dict[str, Any], rows: list[dict[str, Any]], overhead: dict[str, Any] | None,
                    notes: list[str], restart_rows: list[dict[str, Any]] | None = None,
                    client_rows: list[dict[str, Any]] | None = None, mix_rows: list[dict[str, Any]] | None = None
                    ) -> str:
    parts = ["# slotkeeper benchmark", "",
             f"Run {meta['started']}, elapsed {meta['elapsed_s']:.0f} s, seed {meta['knobs']['seed']}; knobs: "
             + ", ".join(f"`{k}={v}`" for k, v in meta["knobs"].items()), "",
             "Prefill/cached tokens are Σ`timings.prompt_n` / Σ`timings.cache_n` as reported by llama-server "
             "(prefill includes what the proxy's own checkpoint warm-ups and probes made the server prefill); "
             "`x limit` is prefill divided by the physical limit (the `limit` row). `lost` is the proxy's own count of "
             "lost tokens (`slotkeeper_tokens_lost_total`; `–`: no proxy or no meter), `lost unlabelled` its "
             "cause-`unknown` part, `lost (bench)` the bench's own count from `cache_n` (bench/loss.py). "
             "Wall time includes the clients' think time; TTFT is request sent -> first SSE data event.", "",
             *([md_table(rows, COLUMNS), ""] if rows else [])]
    if meta.get("server"):
        parts[4:4] = [server_text(meta["server"], markdown=True), ""]
    if client_rows:
        parts += ["## Real clients (3 sessions x 2 turns, 2 slots; turn 2+ = main conversation only)", "",
                  md_table(client_rows, CLIENT_COLUMNS), ""]
    if mix_rows:
        from bench import mix_workload  # local: it imports the client launchers

        parts += ["## Several real clients at once (fewer slots than sessions)", "", mix_workload.table(mix_rows), ""]
    if restart_rows:
        from bench import restart  # local: restart imports configs, which report need not load otherwise

        parts += ["## After a llama-server restart (first requests)", "", restart.text(restart_rows, True), ""]
    if overhead:
        parts += ["## Proxy overhead (trivial upstream, keep-alive, one session's body repeated)", "",
                  overhead_text(overhead, markdown=True), ""]
    if notes:
        parts += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(parts)


def plot(path: Path, runs: list[dict[str, Any]], limits: dict[str, dict[str, Any]]) -> None:
    """Prefill tokens per request over time, one line per configuration (left), and its running sum (right);
    one row of panels per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in runs))
    if not workloads:
        return
    fig, axes = plt.subplots(len(workloads), 2, figsize=(15, 4 * len(workloads)), squeeze=False,
                             gridspec_kw={"width_ratios": [2, 1]})
    for (ax, cum), wl in zip(axes, workloads, strict=True):
        for run in (r for r in runs if r["workload"] == wl):
            recs = [r for r in run["records"] if r["prompt_n"] is not None]
            xs, ys = [r["start_s"] for r in recs], [r["prompt_n"] for r in recs]
            (line,) = ax.plot(xs, ys, marker="o", markersize=3, linewidth=1, label=run["config"])
            cum.step(xs, _cumsum(ys), where="post", color=line.get_color(), label=run["config"])
        lim = limits.get(wl)
        if lim and lim.get("start_s"):
            label = f"limit (order of {lim['order_from']})"
            ax.plot(lim["start_s"], lim["per_request"], linestyle="--", color="black", linewidth=1, label=label)
            cum.step(lim["start_s"], _cumsum(lim["per_request"]), where="post", linestyle="--", color="black",
                     label=label)
        ax.set_title(f"{wl}: prefill tokens per request")
        ax.set_xlabel("request start (s since workload start)")
        ax.set_ylabel("prompt_n (tokens prefilled)")
        cum.set_title(f"{wl}: cumulative prefill")
        cum.set_xlabel("request start (s)")
        cum.set_ylabel("Σ prompt_n")
        for a in (ax, cum):
            a.grid(alpha=0.3)
            a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _cumsum(values: list[int]) -> list[int]:
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out


def write_all(out_dir: Path, meta: dict[str, Any], rows: list[dict[str, Any]], runs: list[dict[str, Any]],
              limits: dict[str, dict[str, Any]], overhead: dict[str, Any] | None, notes: list[str],
              restart_rows: list[dict[str, Any]] | None = None,
              client_rows: list[dict[str, Any]] | None = None, mix_rows: list[dict[str, Any]] | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta, "rows": rows, "overhead": overhead, "limits": limits, "notes": notes, "runs": runs,
           "restart": restart_rows, "mix": mix_rows}
    (out_dir / "latest.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (out_dir / "latest.md").write_text(render_markdown(meta, rows, overhead, notes, restart_rows, client_rows,
                                                       mix_rows))
    plot(out_dir / "latest.png", runs, limits)
