"""`make bench` / `python -m bench`: prefill and latency of each configuration on each workload, plus the
proxy's per-request overhead, in one table (stdout, `latest.json`, `latest.md`) and one plot (`latest.png`).

Loop: for each workload, for each configuration, stand up a fresh llama-server (+ proxy), replay the
workload's deterministic sessions, record what the server reports. The physical limit of a workload is
computed on the server of its first configuration run (`stock` by default), in that run's start order.
The default knobs are sized to finish in well under 10 minutes on 2 CPU cores with SmolLM2-135M.

Your own server and model: `--llama-server PATH --model GGUF [--ngl 99] [--ctk q8_0]` starts your build for
every configuration, `--llama-url URL [--save-dir ITS_SLOT_SAVE_PATH]` uses one that runs. Either way the
report starts with the server's numbers (model, build, KV bytes per token, prefill tok/s, save and restore
GB/s: bench/costs.py's moves on slot 0 of a server of its own, or of the running one before the workloads),
and each proxied row shows the cost model's choices from the proxy's JSONL log.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import (
    client_workloads,
    configs,
    limit,
    loss,
    mix_workload,
    model_swap,
    overhead,
    pi_workload,
    report,
    restart,
    subagent_workload,
)
from bench.client import RequestRecord, run_workload
from bench.workload import WORKLOADS, Workload, generate
from slotlogic import anthropic

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
# Real clients (client-<name>): only aider's three configurations fit the default run's budget (about 2 min
# on 2 shared cores); the npm clients took 4.5-7 min and more each (docs/performance.md, "Real clients") and
# run on request with --workloads.
DEFAULT_WORKLOADS = ["agents", "fits", "pi", "generic", "client-aider"]
# On your own server (--llama-server/--model/--llama-url): the synthetic agent workloads. The real clients run
# on a long-context model of their own (bench/client_workloads.py), pi needs the pi CLI.
OWN_SERVER_WORKLOADS = ["agents", "fits", "generic", "subagents"]
SPEED_WORDS = (25, 50, 100, 200, 400)  # the server's moves (bench/costs.py): ~100 to ~1,600 tokens


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench", description="Benchmark slotkeeper's slot policies "
                                 "against stock llama-server; writes latest.json, latest.md, latest.png.")
    ap.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                    help=f"comma-separated, from {', '.join(WORKLOADS)}")
    ap.add_argument("--configs", default="",
                    help=f"comma-separated, from {', '.join(configs.CONFIGS)} (default: "
                         f"{','.join(configs.DEFAULT_CONFIGS)}, fewer for workloads that name their own)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sessions", type=int, default=None,
                    help="sessions per workload (default: the workload's own, agents 6, fits 3; the subagents "
                         "workloads take every size from --seed)")
    ap.add_argument("--turns", type=int, default=None,
                    help="requests per main conversation (default: the workload's own, agents 3, fits 2)")
    ap.add_argument("--subagent-turns", type=int, default=3, help="requests per subagent (agents only)")
    ap.add_argument("--max-tokens", type=int, default=4,
                    help="tokens generated per request (assistant turns are scripted: decode only shapes timing)")
    ap.add_argument("--threads", type=int, default=None,
                    help="llama-server compute threads (default: 2 on an idle machine, else 1; see "
                         "bench/configs.py)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--restart", action="store_true",
                    help="also run the server-restart scenario (auto vs auto+ckpt, ~30 s; kept out of the default "
                         "run so that it stays under 10 minutes on 2 cores)")
    ap.add_argument("--swap", action="store_true",
                    help="also run the two-model workflow: a main and a helper model behind a swapper that holds "
                         "one at a time (the llama-swap stand-in, and the router when upstream's binary is here), "
                         "stock against the proxy (~4-8 min; docs/model-swaps.md)")
    ap.add_argument("--overhead-requests", type=int, default=1000, help="requests per overhead target")
    ap.add_argument("--scale", action="store_true",
                    help="also run the scale workload: agents on 2 servers x 2 slots through slotkeeper, round-robin, "
                         "least-connections and two proxies on one Redis store, plus the hot path with the Redis "
                         "store vs the file store (~5-7 min on 2 cores: kept out of the default run)")
    ap.add_argument("--sim", action="store_true",
                    help="instead of a real server: generated workloads through the slot simulator (bench/sim, "
                         "docs/simulator.md); prints workloads, seconds, worst x limit and lost tokens")
    ap.add_argument("--sim-seeds", type=int, default=1000, help="simulated workloads (seeds 0..N-1) for --sim")
    ap.add_argument("--sim-seed", type=int, default=None,
                    help="one simulated seed with its whole reproduction (a failing seed of --sim)")
    ap.add_argument("--sim-processes", type=int, default=None, help="worker processes for --sim (default: 2)")
    ap.add_argument("--scale-configs", default="slotkeeper,round-robin,least-conn,2 proxies+redis",
                    help="the scale configurations to run (comma-separated; the first one's order gives the limit)")
    own = ap.add_argument_group("your own llama-server (docs/performance.md, \"Your own server\")")
    own.add_argument("--llama-server", metavar="PATH", help="a llama-server binary, started for every configuration")
    own.add_argument("--model", metavar="GGUF",
                     help="the model it loads (tiny:NAME: a model of tests/tiny_models.py, e.g. tiny:dense_8b_kv, "
                          "the 8B KV layout)")
    own.add_argument("--ngl", type=int, help="layers offloaded to the GPU (-ngl)")
    own.add_argument("--ctk", default="f16", help="KV cache type for K and V (-ctk/-ctv; the proxy is told)")
    own.add_argument("--ctx-per-slot", type=int, default=configs.CTX_PER_SLOT,
                     help="context per slot (-c = slots x this)")
    own.add_argument("--np-default", action="store_true",
                     help="start the server without -np, as most people do: its default 4 slots on one unified "
                          "KV cache (-c = 4 x --ctx-per-slot), idle slots cleared into its RAM prompt cache")
    own.add_argument("--llama-url", metavar="URL",
                     help="a running llama-server instead: every configuration runs on it (its slots erased "
                          "before each)")
    own.add_argument("--save-dir", type=Path,
                     help="with --llama-url: its --slot-save-path (the paging configurations need it)")
    own.add_argument("--speeds", action="store_true",
                     help="measure the server's speeds first on the default server too (on by default on yours)")
    own.add_argument("--speed-words", default=",".join(map(str, SPEED_WORDS)),
                     help="conversation sizes (words) of the speed moves")
    a = ap.parse_args(argv)
    a.own_server = bool(a.llama_server or a.model or a.llama_url or a.ngl is not None or a.ctk != "f16"
                        or a.ctx_per_slot != configs.CTX_PER_SLOT)
    if a.llama_url and (a.llama_server or a.model or a.ngl is not None):
        ap.error("--llama-url is a server that runs: --llama-server, --model and --ngl are for one the bench starts")
    if a.save_dir and not a.llama_url:
        ap.error("--save-dir is the --slot-save-path of the server of --llama-url")
    if a.own_server and "--workloads" not in (argv if argv is not None else sys.argv[1:]):
        a.workloads = ",".join(OWN_SERVER_WORKLOADS)
    a.workloads = _pick(ap, a.workloads, WORKLOADS, "workload")
    a.explicit_configs = bool(a.configs)
    a.configs = _pick(ap, a.configs or ",".join(configs.DEFAULT_CONFIGS), configs.CONFIGS, "configuration")
    return a


def _pick(ap: argparse.ArgumentParser, value: str, registry: dict[str, Any], what: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in registry]
    if unknown:
        ap.error(f"unknown {what}(s) {', '.join(unknown)}; choose from {', '.join(registry)}")
    return names


def server_of(a: argparse.Namespace, tmp: Path) -> configs.Server:
    """The server the flags name (`tiny:NAME` models are written to `tmp`)."""
    model = a.model
    if model and model.startswith("tiny:"):
        from tests import tiny_models  # the repository's own tiny GGUFs (numpy and gguf: the test extra)

        name = model.removeprefix("tiny:")
        model = str(getattr(tiny_models, name)(tmp / f"{name}.gguf"))
    extra = ["-ngl", str(a.ngl)] if a.ngl is not None else []
    extra += ["-ctk", a.ctk, "-ctv", a.ctk] if a.ctk != "f16" else []
    return configs.Server(binary=a.llama_server, model=model, extra=tuple(extra), cache_type=a.ctk,
                          ctx_per_slot=a.ctx_per_slot, url=a.llama_url.rstrip("/") if a.llama_url else None,
                          save_dir=a.save_dir, np_default=a.np_default)


def measure_server(a: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """bench/costs.py's moves on the bench's server: model, build, KV bytes a token, prefill, save, restore."""
    from bench import costs

    words = [int(w) for w in a.speed_words.split(",") if w.strip()]
    if configs.SERVER.url:
        configs.erase_slots(configs.SERVER.url)
        return costs.measure(configs.SERVER.url, configs.SERVER.save_dir, words, kv=a.ctk, compress=False)
    probe = configs.BenchConfig("speeds", proxy=False, save_dir=True)
    with configs.stand_up(probe, log_dir, tag="speeds-", threads=a.threads, slots=1) as stack:
        return costs.measure(stack.server_url, stack.save_dir, words, kv=a.ctk, compress=False)


def build_workload(name: str, a: argparse.Namespace) -> Workload:
    spec = WORKLOADS[name]
    if name.startswith("subagents"):  # every size comes from the seed
        return subagent_workload.generate(name, seed=a.seed, max_tokens=a.max_tokens)
    return generate(name, seed=a.seed, sessions=a.sessions or spec.sessions, turns=a.turns or spec.turns,
                    subagent_turns=a.subagent_turns if spec.subagents else 0, max_tokens=a.max_tokens)


def compute_limit(server_url: str, wl: Workload, records: list[RequestRecord], source: str) -> dict[str, Any]:
    """The workload's physical limit, in the start order of `records` (one run of the workload)."""
    specs = wl.by_key()
    ordered = [specs[(r.session, r.index)] for r in records]
    if wl.route == "messages":  # rendered as the server renders an Anthropic request: its chat conversion
        chats = [anthropic.to_chat(wl.body(s)) for s in ordered]
        lim = limit.workload_limit(server_url, [(c["messages"], c.get("tools", [])) for c in chats])
    else:
        lim = limit.workload_limit(server_url, [(s.messages, wl.tools) for s in ordered])
    lim["order_from"] = source
    lim["start_s"] = [r.start_s for r in records]
    seen = [r for r in records if r.prompt_n is not None and r.cache_n is not None]
    lim["server_prompt_tokens"] = sum((r.prompt_n or 0) + (r.cache_n or 0) for r in seen)
    lim["server_prompt_tokens_complete"] = len(seen) == len(records)
    return lim


def own_server_unsupported(name: str, servers: int) -> str | None:
    """Why workload `name` does not run on the server the flags name (None: it does)."""
    if not configs.SERVER.own:
        return None
    if name.startswith(client_workloads.PREFIX):
        return f"{name}: not run on your own server (the real clients run on a long-context model of their own)"
    if servers > 1 and configs.SERVER.url:
        return f"{name}: not run on a running server (--llama-url): it needs {servers} servers"
    return None


def costs_summary(server: dict[str, Any]) -> str:
    from bench import costs

    return costs.summary(server)


def log(t0: float, msg: str) -> None:
    print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.sim or a.sim_seed is not None:
        from bench.sim import sweep  # no real server: the simulator only
        return sweep.main(a.sim_seeds, a.sim_seed, a.sim_processes)
    a.threads = a.threads or configs.default_threads()
    t0 = time.monotonic()
    started = dt.datetime.now().isoformat(timespec="seconds")
    notes: list[str] = []
    rows: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    limits: dict[str, dict[str, Any]] = {}
    client_rows: list[dict[str, Any]] = []
    mix_rows: list[dict[str, Any]] = []  # several real clients at once (bench/mix_workload.py)
    log_dir = Path(tempfile.mkdtemp(prefix="slotkeeper-bench-logs-"))
    load_start = os.getloadavg()
    log(t0, f"workloads {a.workloads}, configs {a.configs}, seed {a.seed}, llama-server threads {a.threads}; "
            f"server/proxy logs in {log_dir}")
    configs.use_server(server_of(a, log_dir))
    server = None
    if a.own_server or a.speeds:
        server = measure_server(a, log_dir)
        log(t0, "server: " + costs_summary(server))

    for wl_name in a.workloads:
        spec = WORKLOADS[wl_name]
        if spec.not_wired:
            log(t0, spec.not_wired)
            notes.append(spec.not_wired)
            continue
        if why := own_server_unsupported(wl_name, spec.servers):
            log(t0, why)
            notes.append(why)
            continue
        if wl_name == "pi" and (why := pi_workload.unavailable()):
            log(t0, why)
            notes.append(why)
            continue
        chosen = a.configs if a.explicit_configs or spec.configs is None else [
            c for c in a.configs if c in spec.configs]
        if wl_name.startswith(mix_workload.PREFIX):
            if why := mix_workload.missing(mix_workload.MIXES[wl_name]):
                log(t0, why)
                notes.append(why)
                continue
            mix_rows += mix_workload.run_workload(wl_name, chosen, configs.CONFIGS, log_dir, a.threads,
                                                  lambda m: log(t0, m))
            continue
        if wl_name.startswith(client_workloads.PREFIX):
            if why := client_workloads.unavailable(client_workloads.client_of(wl_name)):
                log(t0, why)
                notes.append(why)
                continue
            c_rows, c_lim, c_notes, c_runs = client_workloads.run_workload(
                wl_name, chosen, configs.CONFIGS, log_dir, a.threads, lambda m: log(t0, m))
            rows += c_rows
            client_rows += c_rows
            notes += c_notes
            runs += c_runs
            if c_lim is not None:
                limits[wl_name] = c_lim
            continue
        wl = build_workload(wl_name, a)
        wl_rows: list[dict[str, Any]] = []
        flows = log_dir / "pi-flows.mitm"
        for cfg_name in chosen:
            cfg = configs.CONFIGS[cfg_name]
            capture = wl_name == "pi" and cfg.proxy and not flows.exists()
            lost_proxy = None
            with configs.stand_up(cfg, log_dir, tag=f"{wl_name}-", threads=a.threads,
                                  extra=["-w", str(flows)] if capture else None, servers=spec.servers,
                                  slots=spec.slots) as stack:
                if wl_name == "pi":
                    records, wall = pi_workload.run(stack.url, cfg_name, log_dir / f"pi-{cfg_name}",
                                                    a.sessions or spec.sessions, a.turns or spec.turns)
                else:
                    records, wall = asyncio.run(run_workload(stack.url, wl, cfg_name))
                    if wl_name not in limits:
                        limits[wl_name] = compute_limit(stack.server_url, wl, records, cfg_name)
                if cfg.proxy:
                    time.sleep(0.5)  # the last answer's counters are added once its stream has ended
                    lost_proxy = loss.proxy_lost([stack.url])
                warmup = stack.proxy_prefill()
                paging = stack.proxy_paging() if cfg.save_dir else None
            if wl_name == "pi" and capture and wl_name not in limits:
                with configs.stand_up(configs.CONFIGS["stock"], log_dir, tag="pi-limit-", threads=a.threads) as st:
                    limits[wl_name] = limit.workload_limit(st.server_url, pi_workload.bodies_from_flows(flows))
                    limits[wl_name]["order_from"] = f"{cfg_name} (saved flows)"
                    limits[wl_name]["server_prompt_tokens_complete"] = False
                    limits[wl_name]["server_prompt_tokens"] = 0
            lim_tokens = limits[wl_name]["limit_tokens"] if wl_name in limits else None
            row = report.run_row(wl_name, cfg_name, records, wall, lim_tokens, warmup, paging)
            lost_bench = None if wl_name == "pi" else loss.bench_lost(loss.sent_of(records, wl.by_key()))
            row.update(loss.row_fields(lost_proxy, lost_bench))
            wl_rows.append(row)
            runs.append({"workload": wl_name, "config": cfg_name, "wall_s": wall,
                         "records": [r.to_dict() for r in records]})
            log(t0, f"{wl_name}/{cfg_name}: {row['requests']} requests, prefill {row['prefill']}, "
                    f"reuse {report.fmt('reuse_pct', row['reuse_pct'])}%, "
                    f"x limit {report.fmt('ratio_to_limit', row['ratio_to_limit'])}, "
                    f"lost {report.fmt('lost', row['lost'])} "
                    f"(unlabelled {report.fmt('lost_unknown', row['lost_unknown'])}, bench "
                    f"{report.fmt('lost_bench', row['lost_bench'])}), wall {wall:.1f}s, "
                    f"errors {row['errors']}"
                    + (f", paging: {paging['page_ins']} in ({paging['paged_in_tokens']} tok), "
                       f"{paging['page_outs']} out, server {paging['paging_ms']:.0f} ms" if paging else ""))
            for r in records:
                if r.error:
                    log(t0, f"  error {r.session}#{r.index}: {r.error}")
                    break
        lim = limits.get(wl_name)
        if lim is None:
            rows += wl_rows
            notes.append(f"{wl_name}: no physical limit (no proxied configuration saved the prompts)")
            continue
        for row in wl_rows:  # rows run before the limit was known (pi: it comes from a later, proxied run)
            if row["ratio_to_limit"] is None and lim["limit_tokens"]:
                row["ratio_to_limit"] = row["prefill"] / lim["limit_tokens"]
        if lim["server_prompt_tokens_complete"] and lim["server_prompt_tokens"] != lim["prompt_tokens"]:
            notes.append(f"{wl_name}: /apply-template+/tokenize gives {lim['prompt_tokens']} prompt tokens but "
                         f"the server reported {lim['server_prompt_tokens']} (prompt_n+cache_n)")
        rows += [report.limit_row(wl_name, lim), *wl_rows]
        notes.append(f"{wl_name}: limit computed in the start order of the `{lim['order_from']}` run "
                     f"({lim['requests']} requests, {lim['prompt_tokens']} prompt tokens in total)")

    restart_rows = None
    swap_rows: list[dict[str, Any]] = []
    if a.restart and configs.SERVER.url:
        notes.append("restart: not run on a running server (--llama-url): the bench restarts the servers it started")
    elif a.restart and any(configs.CONFIGS[c].checkpoints for c in a.configs):
        log(t0, "server-restart scenario (auto vs auto+ckpt)")
        restart_rows = restart.measure(log_dir, a.threads, a.seed, a.max_tokens)
        notes.append("restart: a 2-session fits workload; llama-server restarted after the first turn; the "
                     "proxy's /props probe (1 s) noticed it before the next request")

    if a.swap and configs.SERVER.own:
        notes.append("swap: not run on your own server (it starts its models behind a llama-swap stand-in)")
    elif a.swap:
        log(t0, "two-model workflow: main + helper behind a swapper holding one at a time (stock, auto)")
        swap_rows = model_swap.measure(log_dir, a.threads, a.seed, max_tokens=a.max_tokens)
        notes.append("swap: " + model_swap.note(swap_rows))

    if a.scale and configs.SERVER.own:
        notes.append("scale: not run on your own server (it starts two default servers of its own)")
    elif a.scale:
        from bench import scale

        log(t0, "scale: agents on 2 llama-servers x 2 slots (slotkeeper, round-robin, least-conn, 2 proxies+redis)")
        scale_rows, scale_notes = scale.measure(build_workload("agents", a), log_dir, 1, compute_limit,
                                                a.scale_configs.split(","))
        rows += scale_rows
        notes += scale_notes
        log(t0, "scale: hot path with the file store and the Redis store (in process)")
        for hp in scale.hotpath_side_by_side():
            notes.append(f"hot path ({hp['store']} store, in process): request hooks p50 {hp['request_p50_us']} us, "
                         f"p90 {hp['request_p90_us']} us; response hooks p50 {hp['response_p50_us']} us")

    ov = None
    if not a.skip_overhead:
        body_wl = build_workload("agents", a)
        log(t0, f"proxy overhead: {a.overhead_requests} requests per target (direct, noop, addon)")
        ov = overhead.measure(body_wl.body(body_wl.sessions[0].requests[0]), requests=a.overhead_requests,
                              log_dir=log_dir)

    elapsed = time.monotonic() - t0
    load = f"load average (1/5/15 min) {load_start} at start, {os.getloadavg()} at end on {os.cpu_count()} CPUs"
    notes.append(load + " (timings and TTFT are only comparable between runs on an otherwise idle machine)")
    knobs = {k: (",".join(v) if isinstance(v, list) else str(v) if isinstance(v, Path) else v)
             for k, v in vars(a).items() if k != "out"}
    meta = {"started": started, "elapsed_s": elapsed, "knobs": knobs, "python": sys.version.split()[0],
            "slots": configs.SLOTS, "ctx_per_slot": configs.SERVER.ctx_per_slot, "log_dir": str(log_dir),
            "server": server}
    report.write_all(a.out, meta, rows, runs, limits, ov, notes, restart_rows, client_rows, mix_rows)

    print()
    if server:
        print(report.server_text(server))
        print()
    if rows:
        print(report.text_table(rows, report.COLUMNS))
    if client_rows:
        print()
        print(report.text_table(client_rows, report.CLIENT_COLUMNS))
    if mix_rows:
        print()
        print(mix_workload.table(mix_rows))
    if restart_rows:
        print()
        print(restart.text(restart_rows))
    if swap_rows:
        print()
        print(model_swap.text(swap_rows))
    if ov:
        print()
        print(report.overhead_text(ov))
    for n in notes:
        print(f"note: {n}")
    print(f"\nwrote {a.out}/latest.json, latest.md, latest.png")
    print(f"elapsed: {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
