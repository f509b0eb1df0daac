"""Two models on a server that holds one at a time: conversations that survive the swaps (`--swap`).

The workflow: a llama-swap in its default configuration (one model loaded at a time) serves a main model (2 slots)
and a small helper model (1 slot) an agent uses for titles and summaries. Two agent sessions take turns on the
main model; after each round the helper is asked once, which swaps the main model out; the next round swaps it back.
Measured for each configuration (stock: the client talks to llama-swap directly; `auto`: through the proxy):
tokens prefilled by each session's first turn after a swap back, the share of what its previous prompt left in
its slot that it found (`reuse`), the model loads the traffic made, and, through the proxy, the seconds its
page-outs before each swap and its page-ins after took. llama-swap itself installs from no registry here: its
stand-in is tests/swap_stub.py (its routes, a real llama-server per model, started and stopped as llama-swap
does); llama-server's own router (`--models-max 1`) runs beside it when upstream's binary is here. Target
(docs/model-swaps.md): reuse ≥ 90% after each swap back, no model load the traffic would not make.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import httpx

from bench import configs
from bench.client import RequestRecord, send
from bench.workload import generate

HELPER_SYSTEM = "You write a five-word title for the conversation you are shown. Reply with the title only."


def _body(messages: list[dict[str, Any]], model: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}


async def _ask(url: str, body: dict[str, Any], tag: str, session: str, index: int) -> RequestRecord:
    rec = RequestRecord(tag, "model-swap", session, index, 0.0, None, 0.0, None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0)) as client:
        await send(client, url.rstrip("/") + "/v1/chat/completions", body, rec)
    return rec


def _run(url: str, tag: str, seed: int, rounds: int, max_tokens: int) -> list[dict[str, Any]]:
    """Every turn of the workflow against `url`: (session, turn, after a swap back, prompt_n, cache_n)."""
    wl = generate("fits", seed=seed, sessions=2, turns=rounds + 1, subagent_turns=0, max_tokens=max_tokens)
    out = []
    for turn in range(rounds + 1):
        for s in wl.sessions:
            spec = s.requests[turn]
            rec = asyncio.run(_ask(url, {**wl.body(spec), "model": "main"}, tag, s.id, turn))
            out.append({"session": s.id, "turn": turn, "swapped_back": turn > 0,
                        "prompt_n": rec.prompt_n, "cache_n": rec.cache_n, "error": rec.error})
        if turn < rounds:  # the helper's title call: it swaps the main model out
            title = [{"role": "system", "content": HELPER_SYSTEM},
                     {"role": "user", "content": f"Round {turn}: the agent fixed a failing test and ran the suite."}]
            rec = asyncio.run(_ask(url, _body(title, "helper", max_tokens), tag, "helper", turn))
            out.append({"session": "helper", "turn": turn, "swapped_back": False, "prompt_n": rec.prompt_n,
                        "cache_n": rec.cache_n, "error": rec.error})
    return out


def _summary(name: str, turns: list[dict[str, Any]], loads: list[str], jsonl: Path | None) -> dict[str, Any]:
    """One configuration's row: swap-back turns' prefill and reuse (of what the session's previous prompt left)."""
    left: dict[str, int] = {}
    reuse, prefilled = [], 0
    for t in turns:
        if t["session"] == "helper" or t["prompt_n"] is None:
            continue
        total = (t["prompt_n"] or 0) + (t["cache_n"] or 0)
        if t["swapped_back"] and left.get(t["session"]):
            reuse.append(min(1.0, (t["cache_n"] or 0) / left[t["session"]]))
            prefilled += t["prompt_n"] or 0
        left[t["session"]] = total
    records = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl and jsonl.exists() else []
    swaps = [r for r in records if r.get("kind") == "swap-out"]
    page_ins = [r for r in records if r.get("kind") == "page" and r.get("in") and not r.get("seed")]
    return {"config": name, "swap_backs": len(reuse), "prefilled_after_swap": prefilled,
            "reuse_min_pct": 100 * min(reuse) if reuse else None,
            "reuse_mean_pct": 100 * sum(reuse) / len(reuse) if reuse else None,
            "model_loads": len(loads), "loads": loads,
            "saves": sum(r["saved"] for r in swaps), "lost": sum(r["lost"] for r in swaps),
            "save_s": sum(r["seconds"] for r in swaps), "restore_s": sum(r["seconds"] for r in page_ins),
            "errors": [t["error"] for t in turns if t["error"]]}


def _swapper(kind: str, tmp: Path, save: Path, log_dir: Path, name: str, threads: int) -> Any:
    """The llama-swap stand-in (real llama-servers; llama-swap installs from no registry here), or llama-server's
    own router (`--models-max 1`, upstream's binary: xllamacpp refuses router mode)."""
    if kind == "router":
        from tests.router_server import RouterServer

        return RouterServer(tmp, ["main", "helper"], save, slots=2, ctx=2 * configs.SERVER.ctx_per_slot,
                            threads=threads)
    from tests.swap_stub import SwapStub

    common = {"ctx_per_slot": configs.SERVER.ctx_per_slot, "threads": threads, "slot_save_path": str(save)}
    specs = {"main": {**common, "slots": 2, "log_path": str(log_dir / f"swap-{name}.main.log")},
             "helper": {**common, "slots": 1, "log_path": str(log_dir / f"swap-{name}.helper.log")}}
    return SwapStub(specs, exclusive=True)


def measure(log_dir: Path, threads: int, seed: int = 0, rounds: int = 3, max_tokens: int = 4,
            ) -> list[dict[str, Any]]:
    """Stock and the proxy behind the llama-swap stand-in, and behind the real router when its binary is here."""
    from bench.real.mitmdump import MitmProxy
    from tests.router_server import router_binary

    log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    kinds = ["llama-swap", *(["router"] if router_binary() else [])]
    for kind, name in [(k, n) for k in kinds for n in ("stock", "auto")]:
        with tempfile.TemporaryDirectory(prefix=f"slotkeeper-swap-{name}-") as tmp:
            save = Path(tmp) / "slots"
            save.mkdir()
            jsonl = log_dir / f"swap-{kind}-{name}.jsonl"
            with _swapper(kind, Path(tmp), save, log_dir, f"{kind}-{name}", threads) as swap:
                swap.load("main")
                if name == "stock":
                    turns = _run(swap.url, name, seed, rounds, max_tokens)
                    jsonl = None
                else:
                    opts = {**configs.CONFIGS["auto"].options, "slots_upstreams": [swap.url],
                            "slots_state_dir": str(Path(tmp) / "state"), "slots_log_file": str(jsonl),
                            "slots_save_dir": str(save)}
                    with MitmProxy(swap.url, opts, log_path=str(log_dir / f"swap-{kind}-{name}.mitm.log")) as px:
                        turns = _run(px.url, name, seed, rounds, max_tokens)
                loads = list(swap.load_log)
            rows.append({"swapper": kind, **_summary(name, turns, loads, jsonl)})
    return rows


def note(rows: list[dict[str, Any]]) -> str:
    """One line for the report's notes."""
    return "; ".join(
        f"{r['swapper']} {r['config']}: reuse after each swap back min {r['reuse_min_pct']:.1f}% "
        f"mean {r['reuse_mean_pct']:.1f}%, "
        f"{r['prefilled_after_swap']} tokens prefilled after swaps, {r['model_loads']} model loads, pages out "
        f"{r['save_s']:.2f} s and in {r['restore_s']:.2f} s" for r in rows if r["reuse_min_pct"] is not None)


def text(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    head = ["swapper", "config", "swap-backs", "prefilled after swap", "reuse min", "reuse mean", "model loads",
            "paged out", "lost", "save s", "restore s"]
    lines = []
    for r in rows:
        pct = [("-" if r[k] is None else f"{r[k]:.1f}%") for k in ("reuse_min_pct", "reuse_mean_pct")]
        lines.append([r["swapper"], r["config"], str(r["swap_backs"]), str(r["prefilled_after_swap"]), *pct,
                      str(r["model_loads"]), str(r["saves"]), str(r["lost"]), f"{r['save_s']:.2f}",
                      f"{r['restore_s']:.2f}"])
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
                         + ["| " + " | ".join(c) + " |" for c in lines])
    widths = [max(len(x) for x in col) for col in zip(head, *lines, strict=True)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in [head, *lines])


if __name__ == "__main__":
    result = measure(Path("/tmp/swap-bench"), configs.default_threads())
    print(text(result))
    print(json.dumps(result, indent=1))
