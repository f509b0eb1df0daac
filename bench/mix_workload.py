"""Several real clients at once (`mix-<name>`): sessions of several agent clients (bench/real/clients.py) running
their turns concurrently against one llama-server with fewer slots than sessions, so side calls of one
client meet another client's prefills and sessions share slots.

Shape, per mix (`MIXES`): the clients, sessions per client, turns per session and slots. Every session is a
thread that runs its turns one after another (fixed prompts, as `client-<name>`); all start together, a
second apart. Each client has its own HOME and project folder. The server is the long-context SmolLM2 copy
(`bench/real/long_context.py`), 32K a slot, `-n 16`, with a slot save path; every configuration runs through
mitmdump with the addon and `-w` flows (`stock` is the proxy observing only, as in `client-<name>`).

Numbers, per configuration, from the saved flows: prefill (Σ prompt_n, plus what the proxy's own checkpoint
warm-ups and probes made the server prefill: the proxy's JSON-lines log; the clients never see those requests,
so the flows do not hold them), wall time of the turns, requests
whose answer failed (`error=` lines: no prompt_n, a status ≥ 400 or a cut stream), side calls and their
prefill, the side calls' whole-request time p95 (they answer ≤ 16 tokens, so it is their time to first token
plus a few tokens), turns whose client exited with an error, and the proxy's own loss meter (side-call
losses included). Each configuration's physical limit is its own: the clients decide their requests as they
go, so two runs never send the same prompts. It is rendered as the client workloads render theirs (the
server's `/apply-template` and `/tokenize`, Claude Code's billing block stripped, bench/client_workloads.py),
from that run's requests in start order, with every rendered length checked against the server's
`cache_n + prompt_n`. Beside the tokens, `work` weighs each prefilled token by its depth in its context
(bench/work.py), the limit's too: a wall-time ratio to stock cannot pass stock's `x limit work`.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import limit, loss, work
from bench.client_workloads import (
    MAX_TOKENS,
    N_PREDICT,
    TURN_TIMEOUT_S,
    Request,
    config_for,
    mismatches,
    prompts,
    read_flows,
    render,
    server_and_proxy,
    unavailable,
)
from bench.configs import BenchConfig
from bench.real.clients import CLIENTS

PREFIX = "mix-"
CTX_PER_SLOT = 32768
STAGGER_S = 1.0


@dataclass(frozen=True)
class Mix:
    clients: tuple[str, ...]
    sessions: int   # per client
    turns: int
    slots: int
    description: str


MIXES: dict[str, Mix] = {
    "mix-4": Mix(("claude-code", "opencode", "codex", "qwen-code"), 2, 2, 3,
                 "4 real clients x 2 sessions x 2 turns at once on 3 slots"),
    "mix-3": Mix(("opencode", "qwen-code", "claude-code"), 1, 2, 2,
                 "3 real clients x 1 session x 2 turns at once on 2 slots"),
}
DEFAULT_CONFIGS = ("stock", "auto")


@dataclass
class TurnDone:
    client: str
    session: int
    turn: int
    seconds: float
    returncode: int | None
    stderr_tail: str
    error: str | None = None  # the client's own error message (bench/real/clients.py, TurnResult.error)
    capped: bool = False  # that error is the client giving up on answers cut at the bench's tiny answer cap

    @property
    def failed(self) -> bool:
        """A turn whose client exited non-zero for any reason but the answer cap (Claude Code exits 1 then)."""
        return self.returncode != 0 and not self.capped


def missing(mix: Mix) -> str | None:
    for c in mix.clients:
        why = unavailable(c)
        if why:
            return why
    return None


def run_config(name: str, mix: Mix, cfg: BenchConfig, log_dir: Path, threads: int, log: Any) -> dict[str, Any]:
    tag = f"{name}-{cfg.name}"
    flows = log_dir / f"{tag}.flows.mitm"
    flows.unlink(missing_ok=True)
    done: list[TurnDone] = []
    with server_and_proxy(cfg, log_dir, tag, threads, flows, slots=mix.slots, ctx_per_slot=CTX_PER_SLOT) as (
            server, stack, root, stop_proxy):
        def session(client: str, i: int, delay: float) -> None:
            time.sleep(delay)
            w = CLIENTS[client](stack.url, root / f"project-{client}", root / f"home-{client}",
                                max_tokens=MAX_TOKENS, context_window=CTX_PER_SLOT)
            for k, prompt in enumerate(prompts(i, mix.turns)):
                res = w.run_turn(prompt, timeout=TURN_TIMEOUT_S)
                done.append(TurnDone(client, i, k, res.seconds, res.returncode, res.stderr_tail[-400:], res.error,
                                     res.capped))
                log(f"{tag}: {client} s{i + 1}t{k + 1} {res.outcome()} in {res.seconds:.0f}s")

        threads_ = [threading.Thread(target=session, args=(c, i, STAGGER_S * n), daemon=True)
                    for n, (c, i) in enumerate((c, i) for i in range(mix.sessions) for c in mix.clients)]
        t0 = time.perf_counter()
        for t in threads_:
            t.start()
        for t in threads_:
            t.join()
        wall = time.perf_counter() - t0
        time.sleep(0.5)
        lost = loss.proxy_lost([stack.url]) if cfg.options.get("slots_policy") != "off" else None
        stop_proxy()
        requests = read_flows(flows)
        render(server.url, requests)  # each request's rendered length, for the mismatch check
        own = render(server.url, requests, strip_billing=True)
    return summary(cfg.name, requests, done, wall, lost, own, warmup=stack.proxy_prefills())


def _p95(values: Sequence[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(0.95 * (len(s) - 1)))]


def failed(r: Request) -> bool:
    return r.prompt_n is None or (r.status is not None and r.status >= 400) or bool(r.error and r.prompt_n is None)


def summary(config: str, requests: Sequence[Request], done: Sequence[TurnDone], wall: float,
            lost: Any, tokens: Sequence[Sequence[int]] = (), *, warmup: Sequence[int] = (),
            depth: float = work.DEPTH_TOKENS) -> dict[str, Any]:
    """One configuration's row; `tokens`: its requests' rendered prompts in start order (empty where one could
    not be rendered: then no limit, as a limit over part of the requests would flatter the ratio); `warmup`: the
    tokens of each of the proxy's own checkpoint warm-ups and probes (counted in `prefill`: no configuration
    hides work). `work` weighs every prefilled token by its depth (bench/work.py), the limit's too: the ratio
    a wall time can reach at most when prefill is what the server spends its time on."""
    side = [r for r in requests if r.side]
    prefill = sum(r.prompt_n or 0 for r in requests) + sum(warmup)
    done_work = work.served_work([(r.cache_n or 0, r.prompt_n) for r in requests if r.prompt_n], depth) + \
        sum(work.span(0, n, depth) for n in warmup)
    new = limit.new_tokens(tokens) if tokens and all(tokens) and len(tokens) == len(requests) else None
    lim = sum(new) if new else None
    lim_work = work.limit_work(tokens, new, depth) if new else None
    return {"config": config, "requests": len(requests), "prefill": prefill, "warmup": sum(warmup),
            "limit": lim, "x_limit": round(prefill / lim, 3) if lim else None,
            "work": round(done_work), "limit_work": round(lim_work) if lim_work else None,
            "x_limit_work": round(done_work / lim_work, 3) if lim_work else None, "depth": depth,
            "unrendered": sum(1 for t in tokens if not t), "mismatches": len(mismatches(requests)),
            "cached": sum(r.cache_n or 0 for r in requests), "wall_s": round(wall, 1),
            "errors": sum(1 for r in requests if failed(r)),
            "error_kinds": sorted({r.error or f"http-{r.status}" for r in requests if failed(r)}),
            "side_calls": len(side), "side_prefill": sum(r.prompt_n or 0 for r in side),
            "side_cached": sum(r.cache_n or 0 for r in side),
            "side_p95_s": _p95([r.end - r.start for r in side]),
            "turns_failed": sum(1 for d in done if d.failed), "turns_capped": sum(1 for d in done if d.capped),
            "turns": len(done), "proxy_lost": lost}


def run_workload(name: str, config_names: Sequence[str], configs: dict[str, BenchConfig], log_dir: Path,
                 threads: int, log: Any) -> list[dict[str, Any]]:
    mix = MIXES[name]
    rows = []
    for cfg_name in config_names:
        cfg = config_for(cfg_name, configs)
        log(f"{name}/{cfg_name}: {mix.description} (long-context SmolLM2, {CTX_PER_SLOT} a slot, -n {N_PREDICT})")
        row = run_config(name, mix, cfg, log_dir, threads, log)
        log(f"{name}/{cfg_name}: {json.dumps(row, default=str)}")
        if row["unrendered"] or row["mismatches"]:
            log(f"{name}/{cfg_name}: {row['unrendered']} request(s) not rendered, {row['mismatches']} rendered to a "
                f"length other than the server's cache_n + prompt_n (no limit when any is unrendered)")
        rows.append({"workload": name, **row})
    return rows


def _k(v: float | None) -> str:
    return f"{v / 1000:,.0f}" if v else "-"


def _x(v: float | None) -> str:
    return f"{v:.2f}" if v else "-"


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The mix rows; `turns failed` counts a client's non-zero exit unless it gave up on answers cut at the
    answer cap (`capped`, shown beside it: Claude Code exits 1 then, on stock as through the proxy); `lost` is
    the proxy's loss meter (every session's and side-call home's tokens it had and lost, `unlabelled` its
    cause-unknown part; `-` without a proxy)."""
    head = ("| workload | config | requests | prefill | of which warm-up | limit | x limit | work k | limit work k | "
            "x limit work | wall s | error lines | side calls | side prefill | side p95 s | turns failed | lost | "
            "lost unlabelled |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        p95 = f"{r['side_p95_s']:.1f}" if r["side_p95_s"] is not None else "-"
        lost = r.get("proxy_lost")
        total, unknown = (f"{lost['total']:,}", f"{lost['unknown']:,}") if lost else ("-", "-")
        capped = f" ({r['turns_capped']} capped)" if r.get("turns_capped") else ""
        lim, ratio = r.get("limit"), r.get("x_limit")
        lines.append(f"| {r['workload']} | {r['config']} | {r['requests']} | {r['prefill']:,} | "
                     f"{r.get('warmup', 0):,} | {f'{lim:,}' if lim else '-'} | {_x(ratio)} | "
                     f"{_k(r.get('work'))} | {_k(r.get('limit_work'))} | {_x(r.get('x_limit_work'))} | "
                     f"{r['wall_s']:.0f} | "
                     f"{r['errors']} | {r['side_calls']} | {r['side_prefill']:,} | {p95} | "
                     f"{r['turns_failed']}/{r['turns']}{capped} | {total} | {unknown} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from bench import configs

    ap = argparse.ArgumentParser(prog="python -m bench.mix_workload", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="mix-4", help=f"comma-separated: {', '.join(MIXES)}")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args(argv)
    threads = a.threads or configs.default_threads()
    log_dir = Path(tempfile.mkdtemp(prefix="slotkeeper-bench-logs-"))
    t0 = time.monotonic()

    def log(m: str) -> None:
        print(f"[{time.monotonic() - t0:6.0f}s] {m}", flush=True)

    log(f"logs in {log_dir}")
    rows: list[dict[str, Any]] = []
    for name in a.workloads.split(","):
        why = missing(MIXES[name])
        if why:
            log(why)
            continue
        rows += run_workload(name, a.configs.split(","), configs.CONFIGS, log_dir, threads, log)
    print(table(rows))
    (log_dir / "mix.json").write_text(json.dumps(rows, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
