"""`make record`: re-record the flow files in recordings/ from real traffic against a real llama-server.

Why real recordings: the replay tests (tests/test_replay.py) and the debugging recipes (docs/debugging.md)
must exercise what clients and llama-server really send, streamed SSE bodies included, not hand-written
fixtures. Each recording is made by one fresh `mitmdump -s addon.py -w RAW` (fresh state dir, so the live
decisions stored in every flow's metadata are reproducible offline) in front of a fresh llama-server
(xllamacpp + SmolLM2-135M, 4 slots, 8192 tokens each) on 127.0.0.1:8080 when that port is free, so client
replay against `make run`'s server works verbatim. The raw file is then *scrubbed* (credential headers
blanked, the addon's own /_slots/ answers dropped, flows sorted by request start so file order is request
order) into recordings/<name>.mitm, and recordings/manifest.json records how it was made.

    .venv/bin/python tools/record.py                 # all recordings
    .venv/bin/python tools/record.py --only agents_subagent

Recordings:
- pi_two_windows:   real pi 0.73.1, 2 concurrent windows of one project x 2 turns;
- agents_subagent:  bench.workload's synthetic agents, 3 concurrent sessions, s0 runs a 2-turn subagent;
- server_restart:   2 synthetic sessions, llama-server restarted in the middle (the proxy's /props probe
                    logs "restarted"), then both continue and a third session starts;
- client_<name>:    a real agent client (Claude Code, OpenCode, Codex, Qwen Code, aider; bench/real/clients.py),
                    headless and offline: sessions 1 and 2 in one project (turn 1 each, then turn 2 each),
                    then session 3's first turn; long-context SmolLM2, 3 slots, a save dir (the shipped
                    defaults of `make run`: paging and prefix checkpoints, learned prefixes included).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import datetime as dt
import json
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import mitmproxy  # noqa: E402
from mitmproxy import http, io  # noqa: E402

from bench.client import run_workload  # noqa: E402
from bench.real.clients import (  # noqa: E402
    AiderSession,
    ClaudeCodeSession,
    ClientSession,
    CodexSession,
    OpenCodeSession,
    QwenCodeSession,
)
from bench.real.llama_server import LlamaServer  # noqa: E402
from bench.real.long_context import long_context_model  # noqa: E402
from bench.real.mitmdump import MitmProxy  # noqa: E402
from bench.real.pi import PI_VERSION, PiSession, ensure_pi_installed, run_sessions_concurrently  # noqa: E402
from bench.workload import SessionScript, Workload, generate  # noqa: E402
from slotkeeper.launch.mitmdump import mitm_argv  # noqa: E402

OUT = ROOT / "recordings"
PREFERRED_PORT = 8080
SLOTS = 4
CTX_PER_SLOT = 8192
# Credential-bearing headers: their values never go into a committed recording.
SECRET_HEADERS = ("authorization", "proxy-authorization", "x-api-key", "api-key", "cookie", "set-cookie",
                  "x-goog-api-key")
SCRUBBED = "<scrubbed>"
TOOL_OUTPUT_CHARS = 300  # short tool outputs keep recordings small and prefill fast on 2 CPUs


def port_free(port: int) -> bool:
    """Nobody listens on `port` (SO_REUSEADDR like the servers: TIME_WAIT leftovers do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# ------------------------------------------------------------------------------------------------ scrubbing

def scrub_flow(f: http.HTTPFlow) -> None:
    """Blank credential headers in place (request and response); the header names stay as evidence."""
    for msg in (f.request, f.response):
        if msg is None:
            continue
        for name in SECRET_HEADERS:
            if name in msg.headers:
                msg.headers[name] = SCRUBBED


def scrub_file(src: Path, dst: Path) -> int:
    """Rewrite a raw `-w` file into a committed recording; returns the number of flows kept.

    Drops the addon's own `/_slots/` answers (MitmProxy polls /_slots/health at start-up) and sorts by
    request start, so replaying in file order (`mitmdump -nr`, the tests) replays in request order; `-w`
    itself writes flows in completion order."""
    with src.open("rb") as fp:
        flows = [f for f in io.FlowReader(fp).stream()
                 if isinstance(f, http.HTTPFlow) and not f.request.path.startswith("/_slots/")]
    flows.sort(key=lambda f: f.request.timestamp_start)
    with dst.open("wb") as fp:
        writer = io.FlowWriter(fp)
        for f in flows:
            scrub_flow(f)
            writer.add(f)
    return len(flows)


# ------------------------------------------------------------------------------------------------ workloads

def shrink(wl: Workload, max_chars: int = TOOL_OUTPUT_CHARS) -> Workload:
    """Cut tool outputs to `max_chars` (the same cut in every request, so prompts still extend)."""
    out = copy.deepcopy(wl)
    for script in out.sessions:
        for spec in script.requests:
            for msg in spec.messages[2:]:
                if msg.get("role") in ("tool", "user") and isinstance(msg.get("content"), str):
                    msg["content"] = msg["content"][:max_chars]
    return out


def subset(wl: Workload, keep: Callable[[str, int], bool]) -> Workload:
    """The requests of `wl` for which keep(session, index) holds; sessions without any are dropped."""
    scripts = []
    for s in wl.sessions:
        reqs = [r for r in s.requests if keep(r.session, r.index)]
        if reqs:
            scripts.append(SessionScript(s.id, reqs))
    return Workload(wl.name, wl.seed, wl.tools, scripts, wl.max_tokens)


def run(base_url: str, wl: Workload) -> None:
    records, _ = asyncio.run(run_workload(base_url, wl, "record"))
    bad = [r for r in records if r.error or r.status != 200]
    if bad:
        raise RuntimeError(f"{len(bad)} request(s) failed while recording: {bad[0]}")


# ------------------------------------------------------------------------------------------------ recorders

@dataclass
class Recording:
    name: str
    description: str
    probe_interval: int = 15
    slots: int = SLOTS
    ctx_per_slot: int = CTX_PER_SLOT
    client: type[ClientSession] | None = None  # a real agent client: long-context model, a save dir


def proxy_options(rec: Recording, work: Path) -> dict[str, object]:
    """The addon options of a recording proxy: fresh state dir, kept SSE copies, JSONL log (and, for a real
    client, the server's save dir: paging and prefix checkpoints, as `make run` ships them)."""
    out: dict[str, object] = {"slots_state_dir": str(work / "state"), "slots_keep_streams": True,
                              "slots_log_file": str(work / "slotkeeper.jsonl"),
                              "slots_probe_interval": rec.probe_interval}
    if rec.client is not None:
        out["slots_save_dir"] = str(work / "slots")
    return out


def proxy_command(server_url: str, rec: Recording) -> str:
    """The recording proxy's command line, for the manifest (temp paths and the free port as placeholders)."""
    argv = mitm_argv(server_url, 0, proxy_options(rec, Path("<work>")), extra=["-w", "<work>/raw.mitm"], quiet=False)
    argv[0], argv[2] = ".venv/bin/mitmdump", "addon.py"
    return " ".join(argv).replace("@127.0.0.1:0", "@127.0.0.1:<free port>")


@contextlib.contextmanager
def proxy(server: LlamaServer, rec: Recording, work: Path) -> Iterator[MitmProxy]:
    """One fresh mitmdump + addon writing `work/raw.mitm`."""
    with MitmProxy(server.url, proxy_options(rec, work), log_path=str(work / "proxy.log"), quiet=False,
                   extra=["-w", str(work / "raw.mitm")]) as p:
        yield p


def record_pi(server: LlamaServer, rec: Recording, work: Path) -> dict[str, Any]:
    ensure_pi_installed()
    prompts = [["Reply with one short sentence: what is a hash map?",
                "Reply with one short sentence: when is it a bad choice?"],
               ["Reply with one short sentence: what is a binary heap?",
                "Reply with one short sentence: name one program that uses it."]]
    with proxy(server, rec, work) as p:
        windows = [PiSession(p.url, work, f"window{i}") for i in range(2)]
        results = run_sessions_concurrently(windows, prompts, timeout=600)
    failed = [(name, r.returncode, r.stderr[-300:]) for name, rs in results.items() for r in rs if r.returncode]
    if failed:
        raise RuntimeError(f"pi turns failed: {failed}")
    return {"client": f"pi {PI_VERSION} (tools/pi, bench/real/pi.py), 2 windows x 2 turns, one project",
            "argv": [arg.replace(str(work), "<work>") for arg in windows[0].history[-1].argv]}


def record_agents(server: LlamaServer, rec: Recording, work: Path) -> dict[str, Any]:
    wl = shrink(generate("agents", seed=7, sessions=3, turns=3, subagent_turns=2, max_tokens=8))
    wl = subset(wl, lambda session, _i: not session.endswith(".sub") or session == "s0.sub")
    with proxy(server, rec, work) as p:
        run(p.url, wl)
    return {"client": "bench.workload.generate('agents', seed=7, sessions=3, turns=3, subagent_turns=2, "
                      "max_tokens=8); tool outputs cut to 300 chars; only s0 keeps its subagent; "
                      "bench.client.run_workload (streamed, concurrent sessions)"}


def record_restart(server: LlamaServer, rec: Recording, work: Path) -> dict[str, Any]:
    wl = shrink(generate("restart", seed=3, sessions=3, turns=3, subagent_turns=0, max_tokens=8))
    before = subset(wl, lambda s, i: s in ("s0", "s1") and i == 0)
    after = subset(wl, lambda s, i: (s in ("s0", "s1") and i > 0) or (s == "s2" and i < 2))
    log = work / "proxy.log"
    with proxy(server, rec, work) as p:
        run(p.url, before)
        server.restart()
        deadline = time.monotonic() + 120
        while "restarted" not in log.read_text(errors="replace"):
            if time.monotonic() > deadline:
                raise TimeoutError("the proxy never logged the restart")
            time.sleep(0.5)
        run(p.url, after)
    return {"client": "bench.workload.generate('restart', seed=3, sessions=3, turns=3, subagent_turns=0, "
                      "max_tokens=8); tool outputs cut to 300 chars; s0/s1 turn 0, LlamaServer.restart(), "
                      "wait for the proxy's 'restarted' log line, then s0/s1 turns 1-2 and s2 turns 0-1"}


# Each session opens differently, as real ones do: clients without a session id (Qwen Code, aider) are told
# apart by their conversation's root only.
CLIENT_PROMPTS = [["Reply with one word: hello", "Reply with one word: again"],
                  ["Name one colour in one word", "Reply with one word: another"],
                  ["Which is larger, 3 or 5? One word", "Reply with one word: thanks"]]


def record_client(server: LlamaServer, rec: Recording, work: Path) -> dict[str, Any]:
    """Sessions 1 and 2 in one project (turn 1 each, then turn 2 each), then session 3's first turn."""
    cls = rec.client
    assert cls is not None
    cls.ensure_installed()
    with proxy(server, rec, work) as p:
        project = work / "project"  # outside any git repository: clients report the enclosing repo otherwise
        sessions = [cls(p.url, project, work / "home", max_tokens=16) for _ in range(3)]
        for turn, who in ((0, 0), (0, 1), (1, 0), (1, 1), (0, 2)):
            done = sessions[who].run_turn(CLIENT_PROMPTS[who][turn], timeout=1800)
            if done.returncode not in (0, 1):  # Claude Code exits 1 after its output-limit resumes
                raise RuntimeError(f"{cls.name} session {who} turn {turn} failed ({done.returncode}): "
                                   f"{done.stderr_tail[-600:]}")
    return {"client": f"{cls.name} {cls.version} ({cls.package}, tools/{cls.name}, "
                      "bench/real/clients.py): sessions "
                      "1 and 2 in one project, turns 1 then 2, then session 3 turn 1, each session its own prompts; "
                      "max 16 tokens",
            "argv": [arg.replace(str(work), "<work>").replace(str(ROOT), ".") for arg in sessions[0].history[-1].argv]}


CLIENTS = (ClaudeCodeSession, OpenCodeSession, CodexSession, QwenCodeSession, AiderSession)
RECORDINGS: dict[str, tuple[Recording, Callable[[LlamaServer, Recording, Path], dict[str, Any]]]] = {
    **{f"client_{c.name.replace('-', '_')}": (
        Recording(f"client_{c.name.replace('-', '_')}",
                  f"real {c.name}: 3 sessions, 2 of them 2 turns, 4 slots (one for side calls)", slots=4,
                  ctx_per_slot=24576, client=c), record_client)
       for c in CLIENTS},
    "pi_two_windows": (Recording("pi_two_windows", "real pi, 2 concurrent windows x 2 turns"), record_pi),
    "agents_subagent": (Recording("agents_subagent", "synthetic agents: 3 sessions, one subagent"),
                        record_agents),
    "server_restart": (Recording("server_restart", "llama-server restarted mid-run", probe_interval=1),
                       record_restart),
}


def record(name: str, port: int | None, work_root: Path) -> dict[str, Any]:
    rec, fn = RECORDINGS[name]
    work = work_root / name
    work.mkdir(parents=True)
    started = time.monotonic()
    server_kw: dict[str, Any] = {}
    if rec.client is not None:
        (work / "slots").mkdir()
        server_kw = {"model": str(long_context_model()), "n_predict": 16, "slot_save_path": str(work / "slots")}
    with LlamaServer(port=port, slots=rec.slots, ctx_per_slot=rec.ctx_per_slot,
                     log_path=str(work / "llama-server.log"), **server_kw) as server:
        props = httpx.get(server.url + "/props", timeout=10).json()
        how = fn(server, rec, work)
    loads = (work / "proxy.log").read_text(errors="replace").count("Loading script")
    if loads != 1:  # mitmdump hot-reloads an edited addon.py: a fresh addon instance would skew the decisions
        raise RuntimeError(f"addon.py was (re)loaded {loads} times while recording {name}; record it again")
    flows = scrub_file(work / "raw.mitm", OUT / f"{name}.mitm")
    live = [line.split("slotkeeper: ", 1)[1] for line in (work / "proxy.log").read_text(errors="replace")
            .splitlines() if "slotkeeper: " in line and "slotkeeper: sessions on" not in line]
    (OUT / f"{name}.live.log").write_text("".join(f"slotkeeper: {line}\n" for line in live))
    return {"description": rec.description, "file": f"{name}.mitm", "flows": flows,
            "bytes": (OUT / f"{name}.mitm").stat().st_size, **how,
            "server": {"url": server.url, "build_info": props.get("build_info"),
                       "model": Path(str(props.get("model_path"))).name, "total_slots": props.get("total_slots"),
                       "n_ctx_per_slot": (props.get("default_generation_settings") or {}).get("n_ctx"),
                       "runner": f"xllamacpp {metadata.version('xllamacpp')} (bench/real/llama_server.py)"},
            "proxy": {"mitmproxy": mitmproxy.version.VERSION, "python": sys.version.split()[0],
                      "command": proxy_command(server.url, rec)},
            "recorded": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "seconds": round(time.monotonic() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", choices=list(RECORDINGS), help="record just this one (repeat)")
    ap.add_argument("--port", type=int, default=PREFERRED_PORT,
                    help="llama-server port (default 8080; a free port if 8080 is taken)")
    ap.add_argument("--keep-work", action="store_true", help="keep the temp dir (logs, raw files, state)")
    a = ap.parse_args(argv)
    port = a.port if port_free(a.port) else None
    if port is None:
        print(f"port {a.port} is busy: recording against a free port (see recordings/README.md, retargeting)",
              flush=True)
    manifest_path = OUT / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    work_root = Path(tempfile.mkdtemp(prefix="slotkeeper-record-"))
    for name in a.only or list(RECORDINGS):
        print(f"recording {name} ... (work dir {work_root / name})", flush=True)
        manifest[name] = record(name, port, work_root)
        manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        print(f"  {manifest[name]['flows']} flows, {manifest[name]['bytes']} bytes, "
              f"{manifest[name]['seconds']} s", flush=True)
    if not a.keep_work:
        import shutil

        shutil.rmtree(work_root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
