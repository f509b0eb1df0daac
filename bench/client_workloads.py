"""The real-client workloads (`client-<name>`): three sessions of one real agent client (Claude Code,
OpenCode, Codex CLI, Qwen Code, aider; `bench/real/clients.py`) in one project folder, on a server with fewer
slots than sessions, so eviction, paging and prefix checkpoints all matter.

Shape: a fresh llama-server per configuration on the long-context SmolLM2 copy (`bench/real/long_context.py`:
client prompts need more than SmolLM2's 8K), 2 slots of 24,576 tokens, `-n 16` (Codex sends no answer cap),
a slot save path; a fresh HOME and project folder per configuration; turns run one after another,
interleaved s1t1, s2t1, s3t1, s1t2, s2t2, s3t2, with fixed prompts (SmolLM2 decodes greedily, so every
configuration sends the same conversation). Answers are capped at 16 tokens and the client is told the
slot's context size, as the pi workload caps pi.

Numbers: EVERY configuration runs through mitmdump with the addon, a JSONL log (`slots_log_file`) and `-w`
flows; the per-request numbers are what the server reported for each request (`cache_n`, `prompt_n`, and
the side-call flag the addon stores in each flow's metadata). `stock` here is that same proxy with
`slots_policy=off` and `slots_anthropic=off`: it observes and rewrites nothing (the client's bytes reach
the server unchanged, Claude Code's billing block included), so stock's numbers are measured the same way
as the others'.

Physical limit: from the prompts as the server received them under the first configuration that pins
(`auto`, or `auto+ckpt`): slotkeeper strips Claude Code's per-session billing block there, so those prompts
are the conversations a perfect cache would need (under stock they differ per session at char 47 of the
system prompt, which no cache can share). Each request is rendered with the server's own `/apply-template`
and `/tokenize`: chat bodies as they are (Claude Code's requests are chat completions by then), Codex's
Responses bodies through `bench.responses.to_chat`, stock's Anthropic bodies through slotlogic's
translation. Every rendered count is checked against the `cache_n + prompt_n` the server reported for that
request, in every configuration; differences are printed and reported, never hidden.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import limit, loss
from bench.client import RequestRecord
from bench.configs import BenchConfig, Stack
from bench.real.clients import CLIENTS, ClientSession, ClientUnavailable, node_available
from bench.real.llama_server import LlamaServer
from bench.real.mitmdump import MitmProxy
from bench.responses import ResponsesError
from bench.responses import to_chat as responses_to_chat
from slotlogic import anthropic
from slotlogic.endpoints import ANTHROPIC_PATHS, CHAT_PATHS, RESPONSES_PATHS, normalise_path

PREFIX = "client-"
NAMES = tuple(CLIENTS)  # claude-code, opencode, codex, qwen-code, aider
SLOTS = 2
CTX_PER_SLOT = 24576
N_PREDICT = 16
MAX_TOKENS = 16
TURN_TIMEOUT_S = 1800.0
# First prompts differ within their first 21 characters (Claude Code hashes chars 4, 7 and 20 of the first
# prompt into its billing block, as users' prompts would); the follow-up is the same for every session.
FIRST_PROMPTS = ("What is a hash map? Reply with one short sentence.",
                 "Name one use of a binary heap, in one short sentence.",
                 "Describe a trie in one short sentence, please.")
FOLLOW_UP = "Reply with one short sentence: when is it a bad choice?"
DEFAULT_CONFIGS = ("stock", "auto", "auto+ckpt")
# The proxied stand-in for `stock`: the same mitmdump and addon, observing only.
OBSERVED_STOCK = BenchConfig("stock", proxy=True, options={"slots_policy": "off", "slots_anthropic": "off"},
                             description="llama-server's own slot choice; the proxy observes only (slots_policy=off, "
                                         "slots_anthropic=off: the client's bytes reach the server unchanged)")
MISMATCH_TOLERANCE = 0  # rendered tokens must equal cache_n + prompt_n exactly (a full hit is N-1 + 1 = N)


def workload_name(client: str) -> str:
    return PREFIX + client


def client_of(workload: str) -> str:
    return workload[len(PREFIX):]


def prompts(session: int, turns: int = 2) -> list[str]:
    return [FIRST_PROMPTS[session % len(FIRST_PROMPTS)], *[FOLLOW_UP] * (turns - 1)]


def unavailable(client: str) -> str | None:
    """Why the client cannot run here (node missing, install failed), or None."""
    cls = CLIENTS[client]
    if cls.name != "aider" and not node_available() and not cls.binary().exists():
        return f"{workload_name(client)}: node/npm not found; skipped"
    try:
        cls.ensure_installed()
    except (ClientUnavailable, OSError) as e:
        return f"{workload_name(client)}: {cls.name} is not installed ({type(e).__name__}: {str(e)[:300]}); skipped"
    return None


# ------------------------------------------------------------------------------------------------ one run

@dataclass
class Turn:
    session: int
    turn: int
    start: float  # wall clock (time.time(), the clock mitmproxy stamps flows with)
    end: float
    returncode: int | None
    stderr_tail: str
    error: str | None = None  # the client's own error message (TurnResult.error)


@dataclass
class Request:
    """One completion request as the server received it, from the saved flow."""

    start: float
    end: float
    path: str                 # as sent upstream (a translated Anthropic request: /v1/chat/completions)
    body: dict[str, Any] | None
    status: int | None
    cache_n: int | None
    prompt_n: int | None
    side: bool
    session_key: str | None
    error: str | None = None
    source: str | None = None  # where the addon found the session (a header name, content:root, …)
    session: int | None = None  # which client session's turn it came in (0-based), None: outside every turn
    turn: int | None = None
    rendered: int | None = None  # /apply-template + /tokenize length
    render_error: str | None = None

    @property
    def served(self) -> int | None:
        if self.cache_n is None or self.prompt_n is None:
            return None
        return self.cache_n + self.prompt_n


@dataclass
class ClientRun:
    workload: str
    config: str
    wall_s: float
    turns: list[Turn]
    requests: list[Request]
    warmup: int = 0
    paging: dict[str, Any] | None = None
    tokens: list[list[int]] = field(default_factory=list, repr=False)  # rendered token lists, request order
    failed: str | None = None
    own_tokens: list[list[int]] = field(default_factory=list, repr=False)  # this run's conversation, billing-free
    total_s: float = 0.0  # the whole configuration: server and proxy start, the turns, rendering, shutdown
    checkpoints: dict[str, int] = field(default_factory=dict)  # the proxy's checkpoint steps by outcome
    no_marker: bool = False  # the proxy logged that no configured marker matched (a prefix is learned, if any)
    lost: dict[str, Any] | None = None  # the proxy's loss counter at the end (bench/loss.py), None: no meter


def read_flows(path: Path) -> list[Request]:
    """Completion requests of a `-w` file, in request start order, with the addon's per-request metadata."""
    from mitmproxy import http, io

    if not path.exists():
        return []
    with path.open("rb") as f:
        flows = [fl for fl in io.FlowReader(f).stream() if isinstance(fl, http.HTTPFlow)]
    out = []
    for fl in sorted(flows, key=lambda x: x.request.timestamp_start):
        meta = fl.metadata.get("slotkeeper")
        if fl.request.method != "POST" or not isinstance(meta, dict):
            continue
        try:
            body = json.loads(fl.request.get_content() or b"null")
        except ValueError:
            body = None
        resp = fl.response
        # a failed request (its client gone, a cut stream) lasted until its error: counted from its start to 0 s, the
        # side-call p95 left out a title call OpenCode gave up on after 92 s (bench mix-4, stock)
        failed_at = fl.error.timestamp if fl.error is not None and fl.error.timestamp else None
        end = (resp.timestamp_end if resp is not None and resp.timestamp_end else None) or failed_at \
            or fl.request.timestamp_start
        error = None
        if fl.error is not None:
            error = "transport"
        elif resp is not None and resp.status_code >= 400:
            error = f"HTTP {resp.status_code}"
        out.append(Request(fl.request.timestamp_start, end, fl.request.path, body if isinstance(body, dict) else None,
                           resp.status_code if resp is not None else None, meta.get("cache_n"), meta.get("prompt_n"),
                           bool(meta.get("side")), meta.get("session"), error, meta.get("source")))
    return out


def assign_turns(requests: Sequence[Request], turns: Sequence[Turn]) -> None:
    """Each request belongs to the turn whose process was running when it started (turns never overlap)."""
    for r in requests:
        for t in turns:
            if t.start <= r.start <= t.end:
                r.session, r.turn = t.session, t.turn
                break


def chat_body(path: str, body: dict[str, Any], *, strip_billing: bool = False) -> dict[str, Any]:
    """The chat-completions body the server renders for a request sent to `path` (`strip_billing`: an
    Anthropic request as it would be without Claude Code's per-session billing block)."""
    p = normalise_path(path)
    if p in RESPONSES_PATHS:
        return responses_to_chat(body)
    if p in ANTHROPIC_PATHS:
        return anthropic.to_chat((anthropic.strip_billing(body) if strip_billing else None) or body)
    if p in CHAT_PATHS:
        return body
    raise ValueError(f"no chat rendering for {p}")


def render(server_url: str, requests: Sequence[Request], *, strip_billing: bool = False) -> list[list[int]]:
    """Token lists of every request (empty when it cannot be rendered; `render_error` says why). As the
    server received them, which each request's `rendered` records; or (`strip_billing`) without Claude
    Code's billing block, for the limit of a run whose proxy kept it, leaving `rendered` alone."""
    lists: list[list[int]] = []
    with httpx.Client(timeout=120.0) as client:
        for r in requests:
            tokens: list[int] = []
            try:
                if r.body is None:
                    raise ValueError("no JSON body")
                chat = chat_body(r.path, r.body, strip_billing=strip_billing)
                tokens = limit.render_body_tokens(server_url, chat, client)
                if not strip_billing:
                    r.rendered = len(tokens)
            except (ValueError, ResponsesError, anthropic.TranslationError, httpx.HTTPError) as e:
                if not strip_billing:
                    r.render_error = f"{type(e).__name__}: {str(e)[:200]}"
            lists.append(tokens)
    return lists


def mismatches(requests: Sequence[Request]) -> list[dict[str, Any]]:
    """Requests whose rendered length differs from what the server reported (cache_n + prompt_n)."""
    out = []
    for i, r in enumerate(requests):
        if r.rendered is None or r.served is None or abs(r.rendered - r.served) > MISMATCH_TOLERANCE:
            if r.rendered is None and r.served is None:
                continue  # nothing to compare (a failed request; reported as an error)
            out.append({"request": i, "session": _label(r), "path": normalise_path(r.path), "side": r.side,
                        "rendered": r.rendered, "cache_n": r.cache_n, "prompt_n": r.prompt_n,
                        "render_error": r.render_error})
    return out


def _label(r: Request) -> str:
    return f"s{r.session + 1}t{(r.turn or 0) + 1}" if r.session is not None else "?"


def run_config(client: str, cfg: BenchConfig, log_dir: Path, threads: int, sessions: int = 3, turns: int = 2,
               progress: Any = None) -> ClientRun:
    """One configuration: the client's sessions, then every request rendered and checked on the same server."""
    cls: type[ClientSession] = CLIENTS[client]
    name = workload_name(client)
    tag = f"{name}-{cfg.name}"
    flows = log_dir / f"{tag}.flows.mitm"
    flows.unlink(missing_ok=True)
    done: list[Turn] = []
    failed = None
    started = time.perf_counter()
    with server_and_proxy(cfg, log_dir, tag, threads, flows) as (server, stack, root, stop_proxy):
        windows = [cls(stack.url, root / "project", root / "home", max_tokens=MAX_TOKENS,
                       context_window=CTX_PER_SLOT) for _ in range(sessions)]
        script = [prompts(i, turns) for i in range(sessions)]
        t0 = time.perf_counter()
        for k in range(turns):
            for i, w in enumerate(windows):
                start = time.time()
                res = w.run_turn(script[i][k], timeout=TURN_TIMEOUT_S)
                done.append(Turn(i, k, start, time.time(), res.returncode, res.stderr_tail[-600:], res.error))
                if progress:
                    progress(f"{tag}: s{i + 1}t{k + 1} {res.outcome()} in {res.seconds:.0f}s")
                # Claude Code exits 1 when its answers stay cut at the tiny cap after its resumes: not a failure
                if res.returncode != 0 and not res.capped and failed is None:
                    failed = f"s{i + 1}t{k + 1} {res.outcome()}; stderr: {res.stderr_tail[-400:]}"
        wall = time.perf_counter() - t0
        time.sleep(0.5)  # the last answer's counters are added once its stream has ended
        lost = loss.proxy_lost([stack.url])
        stop_proxy()  # the flows file and the JSONL log are complete once mitmdump has exited
        requests = read_flows(flows)
        assign_turns(requests, done)
        tokens = render(server.url, requests)
        anthropic_route = any(normalise_path(r.path) in ANTHROPIC_PATHS for r in requests)
        own = render(server.url, requests, strip_billing=True) if anthropic_route else tokens
    steps = stack.checkpoint_steps()
    mitm_log = log_dir / f"{tag}.mitm.log"
    no_marker = mitm_log.exists() and "no stable-prefix marker" in mitm_log.read_text(errors="replace")
    return ClientRun(name, cfg.name, wall, done, requests, stack.proxy_prefill(),
                     stack.proxy_paging() if cfg.save_dir else None, tokens, failed, own,
                     time.perf_counter() - started, steps, no_marker, lost)


@contextlib.contextmanager
def server_and_proxy(cfg: BenchConfig, log_dir: Path, tag: str, threads: int, flows: Path, *, slots: int = SLOTS,
                     ctx_per_slot: int = CTX_PER_SLOT) -> Iterator[Any]:
    """A fresh long-context llama-server and a fresh proxy with `-w flows` (every configuration is proxied);
    yields the proxy's `stop` too, so the flows can be read while the server still renders."""
    from bench.real.long_context import long_context_model

    with tempfile.TemporaryDirectory(prefix=f"slotkeeper-bench-{tag}-") as tmp:
        root = Path(tmp)
        slot_dir = root / "slots"
        slot_dir.mkdir()
        with LlamaServer(slots=slots, ctx_per_slot=ctx_per_slot, threads=threads, model=str(long_context_model()),
                         n_predict=N_PREDICT, slot_save_path=str(slot_dir),
                         log_path=str(log_dir / f"{tag}.llama.log")) as server:
            log = log_dir / f"{tag}.requests.jsonl"
            options: dict[str, object] = {**cfg.options, "slots_state_dir": str(root / "state"),
                                          "slots_log_file": str(log)}
            if cfg.save_dir:
                options["slots_save_dir"] = str(slot_dir)
            proxy = MitmProxy(server.url, options, log_path=str(log_dir / f"{tag}.mitm.log"),
                              extra=["-w", str(flows)])
            with proxy:
                yield server, Stack(proxy.url, server.url, log, server), root, proxy.stop


# ------------------------------------------------------------------------------------------------ metrics

def records(run: ClientRun, t0: float | None = None) -> list[RequestRecord]:
    """The run's requests as the bench's per-request records (the session is the client session)."""
    base = t0 if t0 is not None else (run.turns[0].start if run.turns else 0.0)
    out = []
    for r in run.requests:
        label = f"s{r.session + 1}" if r.session is not None else "other"
        out.append(RequestRecord(run.config, run.workload, label, r.turn if r.turn is not None else -1,
                                 start_s=r.start - base, ttft_s=None, total_s=max(0.0, r.end - r.start),
                                 status=r.status, prompt_n=r.prompt_n, cache_n=r.cache_n,
                                 # served (the server reported its prompt) counts, even when the client hung up
                                 # after the answer (Codex does after `response.completed`)
                                 error=None if r.prompt_n is not None else (r.error or "no prompt_n")))
    return out


def later_turns(requests: Sequence[Request]) -> dict[str, Any]:
    """Turn 2+ of every session, main conversation only: Σcache_n / Σ(cache_n + prompt_n), and the worst one."""
    main = [r for r in requests if r.turn is not None and r.turn >= 1 and not r.side and r.served]
    cached = sum(r.cache_n or 0 for r in main)
    total = sum(r.served or 0 for r in main)
    worst = min((100.0 * (r.cache_n or 0) / (r.served or 1) for r in main), default=None)
    return {"later_requests": len(main), "later_reuse_pct": 100.0 * cached / total if total else None,
            "later_worst_pct": worst}


def new_session_first(requests: Sequence[Request]) -> dict[str, Any]:
    """The first main request of turn 1 of every session after the first: cached / new tokens."""
    firsts: dict[int, Request] = {}
    for r in requests:
        if r.session and r.turn == 0 and not r.side and r.session not in firsts:
            firsts[r.session] = r
    chosen = [firsts[k] for k in sorted(firsts)]
    return {"new_turn1_cached": sum(r.cache_n or 0 for r in chosen) if chosen else None,
            "new_turn1_new": sum(r.prompt_n or 0 for r in chosen) if chosen else None,
            "new_turn1_each": [f"{r.cache_n}/{r.prompt_n}" for r in chosen]}


def limit_of(run: ClientRun) -> dict[str, Any]:
    """The physical limit over `run`'s requests (its rendered prompts, in start order)."""
    per_request = limit.new_tokens(run.tokens)
    total = sum(len(t) for t in run.tokens)
    return {"requests": len(run.tokens), "prompt_tokens": total, "limit_tokens": sum(per_request),
            "per_request": per_request, "prompt_lengths": [len(t) for t in run.tokens],
            "order_from": f"{run.config} (its flows)",
            "start_s": [r.start - (run.turns[0].start if run.turns else 0.0) for r in run.requests],
            "unrendered": sum(1 for r in run.requests if r.rendered is None),
            "server_prompt_tokens_complete": False, "server_prompt_tokens": 0}


def prefix_source(run: ClientRun) -> str:
    """How the proxy knew the shared prefix: a configured marker, learned from traffic, or not at all."""
    if not run.checkpoints:
        return "none"
    return "learned" if run.no_marker else "marker"


def row_extras(run: ClientRun) -> dict[str, Any]:
    side = [r for r in run.requests if r.side]
    return {"prefix": prefix_source(run), "checkpoint_steps": run.checkpoints,
            "session_sources": sorted({r.source for r in run.requests if r.source}),
            "sessions_seen": len({r.session_key for r in run.requests if not r.side and r.session_key}),
            **later_turns(run.requests), **new_session_first(run.requests), "side_calls": len(side),
            "side_prefill": sum(r.prompt_n or 0 for r in side), "mismatches": len(mismatches(run.requests)),
            "outside_turns": sum(1 for r in run.requests if r.session is None),
            "cut": sum(1 for r in run.requests if r.error and r.prompt_n is not None), "failed": run.failed}


def pins(cfg: BenchConfig) -> bool:
    """A configuration whose proxy pins (and strips Claude Code's billing block): its prompts give the limit."""
    return cfg.proxy and cfg.options.get("slots_policy", "auto") != "off"


def config_for(name: str, configs: dict[str, BenchConfig]) -> BenchConfig:
    """The configuration a client workload runs: `stock` is the observing proxy, every other one as registered."""
    return OBSERVED_STOCK if name == "stock" else configs[name]


def to_jsonable(run: ClientRun) -> dict[str, Any]:
    return {"workload": run.workload, "config": run.config, "wall_s": run.wall_s, "total_s": run.total_s,
            "failed": run.failed, "warmup": run.warmup, "paging": run.paging,
            "turns": [dataclasses.asdict(t) for t in run.turns],
            "requests": [{k: v for k, v in dataclasses.asdict(r).items() if k != "body"} | {"path": r.path}
                         for r in run.requests],
            "mismatches": mismatches(run.requests)}


# ------------------------------------------------------------------------------------------------ the workload


def limit_extras(run: ClientRun, lim: dict[str, Any]) -> dict[str, Any]:
    """What a perfect cache would reuse on the same requests: turn 2+ (main) and new sessions' turn 1."""
    as_limit = [dataclasses.replace(r, cache_n=len(t) - need, prompt_n=need)
                for r, t, need in zip(run.requests, run.tokens, lim["per_request"], strict=True)]
    return {**later_turns(as_limit), **new_session_first(as_limit), "side_calls": sum(r.side for r in run.requests)}


def _fmt_pair(row: dict[str, Any]) -> str:
    if row.get("new_turn1_cached") is None:
        return "-"
    return f"{row['new_turn1_cached']}/{row['new_turn1_new']}"


def run_workload(name: str, config_names: Sequence[str], configs: dict[str, BenchConfig], log_dir: Path,
                 threads: int, log: Any) -> tuple[list[dict[str, Any]], dict[str, Any] | None, list[str],
                                                   list[dict[str, Any]]]:
    """Every configuration of one client workload: (table rows, the limit, notes, per-run JSON)."""
    from bench import report

    client = client_of(name)
    runs: list[ClientRun] = []
    lim: dict[str, Any] | None = None
    notes: list[str] = []
    for cfg_name in config_names:
        cfg = config_for(cfg_name, configs)
        log(f"{name}/{cfg_name}: {SLOTS} slots x {CTX_PER_SLOT} tokens (long-context SmolLM2, -n {N_PREDICT}), "
            f"3 sessions x 2 turns of the real client, interleaved")
        run = run_config(client, cfg, log_dir, threads, progress=log)
        runs.append(run)
        if lim is None and pins(cfg) and run.tokens and all(run.tokens):
            lim = limit_of(run)
            lim_run = run
        bad = mismatches(run.requests)
        log(f"{name}/{cfg_name}: {len(run.requests)} requests, turns {run.wall_s:.0f}s ({run.total_s:.0f}s with "
            f"server start and rendering), "
            f"{len(bad)} count mismatch(es)" + (f", FAILED {run.failed}" if run.failed else ""))
        for m in bad:
            log(f"  mismatch {m}")
        if bad:
            notes.append(f"{name}/{cfg_name}: {len(bad)} of {len(run.requests)} requests rendered to a token count "
                         f"other than the server's cache_n + prompt_n: "
                         + "; ".join(f"{m['session']} {m['path']} rendered {m['rendered']} vs "
                                     f"{m['cache_n']}+{m['prompt_n']}" + (f" ({m['render_error']})"
                                                                          if m['render_error'] else "")
                                     for m in bad[:6]))
        if run.failed:
            notes.append(f"{name}/{cfg_name}: {run.failed}")
    rows = []
    if lim is not None:
        rows.append({**report.limit_row(name, lim), **limit_extras(lim_run, lim)})
        notes.append(f"{name}: limit from the prompts the server received under `{lim_run.config}` "
                     f"({lim['requests']} requests, {lim['prompt_tokens']} prompt tokens)")
    else:
        notes.append(f"{name}: no physical limit (no pinning configuration rendered all of its prompts)")
    for run in runs:
        recs = records(run)
        row = report.run_row(name, run.config, recs, run.wall_s, lim["limit_tokens"] if lim else None, run.warmup,
                             run.paging)
        row.update(row_extras(run))
        row.update(loss.row_fields(run.lost, loss.bench_lost(
            loss.Sent(r.session_key, t, r.cache_n, r.prompt_n) for r, t in zip(run.requests, run.tokens, strict=False)
            if t and r.session_key and not r.side and r.cache_n is not None and r.prompt_n is not None)))
        row["total_s"] = run.total_s
        if run.own_tokens and all(run.own_tokens):  # this run's own conversation: clients vary their requests
            own = sum(limit.new_tokens(run.own_tokens))
            row.update(own_limit=own, ratio_to_own_limit=row["prefill"] / own if own else None)
        rows.append(row)
    for row in rows:
        row["new_turn1"] = _fmt_pair(row)
    return rows, lim, notes, [to_jsonable(r) | {"records": [x.to_dict() for x in records(r)]} for r in runs]
