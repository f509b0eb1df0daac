"""The reliability soak (`make reliability`, `python -m bench.reliability`): faults, kills, load, bad input and
security checks against real processes, summed up in one table.

Classes (each also has fast cases in `make test`; docs/reliability.md says which):
- upstream: a real llama-server down at start, killed with SIGKILL mid-stream, restarted; `/slots` hanging (a
  stub, since a real server hangs there only when its loop is wedged); `/slots` disabled (`--no-slots`);
  slot files disabled (no `--slot-save-path` while the proxy pages and checkpoints);
- kill -9: mitmdump processes SIGKILL-ed at random moments (≥ 200) while they place sessions, write the state,
  page and build checkpoints against a stub that writes real slot files, next to one proxy that is never
  killed; the state file is read every 10 ms and must always be valid JSON; no page record may name a file
  with other contents (a restore it would mislead); the surviving proxy must lose no request;
- load: 32 concurrent new sessions (two turns each) through 3 mitmdump processes sharing one state dir, on a
  real 4-slot llama-server; every request completes, no slot is shared while another is free (sampled every
  100 ms, and after the run settles), and a known session's request takes no lock (counted in process);
- bad input: crafted bodies through mitmdump (invalid UTF-8, lone surrogates, deep nesting, huge numbers,
  a 20 MB body, gzip/br/zstd bombs, duplicate and escaped keys, chunked uploads, broken encodings) and the
  hypothesis fuzzers of tests/test_fuzz.py at thousands of examples;
- memory bounds (`bench/memory_bounds.py`, `bench/memory_bounds_streams.py`): one value, one client or one
  upstream stream that could grow the proxy without bound (a huge `total_slots` in the state, unlisted
  llama-swap models, 8 MB system prompts, SSE without line or event ends, one huge line in a translated stream,
  deeply nested and huge state, 1 GB answers that are not streams), each against its own proxy: peak RSS
  growth next to its cap, alive, health answered within 1 s throughout; its per-attack table is printed too;
- store & doors (`bench/reliability_store.py`): hostile values in the shared Redis store (200 MB, 600k fake
  sessions, stamps from the future, a negative page size, a squatted lock), a rebinding `Host` on the local API,
  clients' keys in front of an `--api-key` server, an IPv6 server, the console script's arguments; one row per
  attack, measured as the memory bounds are;
- disk (`bench/disk_budget.py`): pages and prefix checkpoints of two proxies sharing a save dir, sampled every
  0.25 s through a soak, never over their budgets; a FIFO as the model file; a symlink as `slots_log_file`;
- security: an `--api-key` llama-server; the local API from a non-loopback address; file modes; hostile
  symlinks in the save dir; and every output of the run (proxy logs, JSONL files, state files) scanned for
  the prompts' sentinel string.

Printed: ONE table (faults injected, survived; bad inputs tried; requests; lost; state files corrupted; memory
peak of the proxy processes), after the memory-bounds class's own table (one row per attack), and the failed
checks, if any; the details go to bench/results/reliability.json.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import random
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import brotli
import httpx
from mitmproxy.net import encoding

from bench import disk_budget, memory_bounds, reliability_store
from bench.real.llama_server import LlamaServer
from bench.real.mitmdump import ROOT, MitmProxy
from slotkeeper.launch.mitmdump import free_port, mitm_argv
from slotlogic import paging

RESULTS = ROOT / "bench" / "results" / "reliability.json"
OWN_NAMES = re.compile(r"^(state-[A-Za-z0-9-]+-[0-9a-f]{8}\.json(\.lock|\.corrupt-\d+|\.\w+\.tmp)?|"
                       r"checkpoints\.json(\.lock|\.\w+\.tmp)?|"
                       r"page-[0-9a-f]{20}\.bin|prefix-[0-9a-f]{16}\.bin|.*\.jsonl(\.1)?|.*\.log)$")


@dataclass
class Row:
    name: str
    faults: int = 0
    survived: int = 0
    bad_inputs: int = 0
    requests: int = 0
    lost: int = 0
    corrupted: int = 0
    memory_mb: float = 0.0
    seconds: float = 0.0
    failed: list[str] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    def check(self, ok: bool, what: str) -> bool:
        if not ok:
            self.failed.append(what)
        return ok


class Soak:
    """One run: a private scratch dir, the sentinel every prompt carries, and every process it started."""

    def __init__(self, threads: int) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="slotkeeper-soak-"))
        os.chmod(self.root, 0o700)
        self.sentinel = f"SENTINEL{random.randrange(16**12):012x}"
        self.threads = threads
        self.procs: list[subprocess.Popen[bytes]] = []
        self.proxies: list[MitmProxy] = []
        self.peaks: dict[int, float] = {}

    def dir(self, name: str) -> Path:
        d = self.root / name
        d.mkdir(mode=0o700, exist_ok=True)
        return d

    def messages(self, tag: str, turns: int = 0) -> list[dict[str, str]]:
        system = (f"You are a careful agent {self.sentinel}. Follow the rules of the repository and keep answers "
                  "short.\nCurrent date: 2026-01-01")
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"{tag} {self.sentinel} go"}]
        for i in range(turns):
            msgs += [{"role": "assistant", "content": f"step {i}"},
                     {"role": "user", "content": f"output {i} {self.sentinel} of {tag}"}]
        return msgs

    def stub(self, **flags: Any) -> str:
        port = free_port()
        argv = [sys.executable, "-m", "bench.stub_llama", "--port", str(port)]
        for k, v in flags.items():
            if v is True:
                argv.append(f"--{k.replace('_', '-')}")
            elif v is not None and v is not False:
                argv += [f"--{k.replace('_', '-')}", str(v)]
        proc = subprocess.Popen(argv, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        self.procs.append(proc)
        assert proc.stdout is not None
        proc.stdout.readline()
        return f"http://127.0.0.1:{port}"

    def proxy(self, upstream: str, opts: dict[str, Any], name: str, **kw: Any) -> MitmProxy:
        px = MitmProxy(upstream, opts, log_path=str(self.root / f"{name}.log"), **kw)
        self.proxies.append(px)
        return px.start(timeout=60)

    def sample(self, px: MitmProxy) -> float:
        """The process's peak resident memory so far (MB); remembered for the table."""
        if px.proc is None:
            return 0.0
        peak = vm_hwm(px.proc.pid)
        if peak:
            self.peaks[px.proc.pid] = max(self.peaks.get(px.proc.pid, 0.0), peak)
        return self.peaks.get(px.proc.pid, 0.0)

    def stop(self, px: MitmProxy) -> float:
        peak = self.sample(px)
        px.stop()
        return peak

    def server(self, **kw: Any) -> LlamaServer:
        kw.setdefault("threads", self.threads)
        kw.setdefault("log_path", str(self.root / f"llama-{free_port()}.log"))
        return LlamaServer(**kw)

    def close(self) -> None:
        for px in self.proxies:
            with contextlib.suppress(Exception):
                if px.proc is not None and px.proc.poll() is None:
                    px.proc.kill()
                    px.proc.wait(5)
        for proc in self.procs:
            with contextlib.suppress(Exception):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def vm_hwm(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def chat(base: str, msgs: list[dict[str, str]], *, timeout: float = 120, stream: bool = False,
         headers: dict[str, str] | None = None, max_tokens: int = 1) -> httpx.Response:
    body = {"messages": msgs, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=timeout, headers=headers)


def alive(px: MitmProxy) -> bool:
    try:
        return px.proc is not None and px.proc.poll() is None and httpx.get(
            px.url + "/_slots/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def timed(row: Row) -> Iterator[Row]:
    t0 = time.monotonic()
    try:
        yield row
    except Exception as e:  # a class that crashes is a failed check, not a lost table
        row.failed.append(f"crashed: {type(e).__name__}: {e}")
    finally:
        row.seconds = round(time.monotonic() - t0, 1)


# ------------------------------------------------------------------------------------------- upstream faults


def upstream_faults(soak: Soak) -> Row:
    row = Row("upstream faults")
    with timed(row):
        state = str(soak.dir("a-state"))
        port = free_port()
        srv = soak.server(port=port, slots=2, ctx_per_slot=1024)
        url = f"http://127.0.0.1:{port}"
        px = soak.proxy(url, {"slots_state_dir": state, "slots_probe_interval": 1,
                              "slots_log_file": str(soak.root / "a.jsonl")}, "a-proxy")
        # 1. down at start: an answer (502), never a hang or a crash; pinned once the server is up
        row.faults += 1
        r = chat(px.url, soak.messages("down-at-start"), timeout=30)
        row.requests += 1
        srv.start()
        ok = chat(px.url, soak.messages("after-start"))
        row.requests += 1
        if row.check(r.status_code == 502 and ok.status_code == 200 and ok.headers.get("x-slot-id") is not None
                     and alive(px), "down at start"):
            row.survived += 1
        # 2. killed mid-stream (SIGKILL), 3. restarted
        row.faults += 2
        msgs = soak.messages("mid-stream")
        got_chunk = False
        body = {"messages": msgs, "max_tokens": 400, "stream": True, "ignore_eos": True}
        with contextlib.suppress(httpx.HTTPError), httpx.stream("POST", px.url + "/v1/chat/completions", timeout=60,
                                                                json=body) as s:
            for _ in s.iter_bytes():
                if not got_chunk:
                    got_chunk = True
                    assert srv.proc is not None
                    os.killpg(srv.proc.pid, signal.SIGKILL)
        row.requests += 1
        survived_kill = alive(px)
        srv.proc = None
        srv.start()
        log = soak.root / "a-proxy.log"
        deadline = time.monotonic() + 30
        while "restarted (new media_marker)" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        after = chat(px.url, soak.messages("mid-stream", 1))
        row.requests += 1
        restarted = "restarted (new media_marker)" in log.read_text()
        if row.check(got_chunk and survived_kill and after.status_code == 200, "killed mid-stream"):
            row.survived += 1
        if row.check(restarted and after.headers.get("x-slot-id") is not None, "restart noticed"):
            row.survived += 1
        # 6. slot files disabled: the proxy pages and checkpoints, the server answers 501 (server has no save path)
        row.faults += 1
        save = soak.dir("a-save")
        px2 = soak.proxy(url, {"slots_state_dir": str(soak.dir("a2-state")), "slots_save_dir": str(save),
                               "slots_probe_interval": 0}, "a-nosave")
        codes = [chat(px2.url, soak.messages(f"no-save-{i}")).status_code for i in range(3)]
        codes.append(chat(px2.url, soak.messages("no-save-0", 1)).status_code)
        row.requests += len(codes)
        warned = "answered 501" in (soak.root / "a-nosave.log").read_text()
        if row.check(codes == [200] * 4 and warned and alive(px2), "no --slot-save-path"):
            row.survived += 1
        row.memory_mb = max(soak.stop(px), soak.stop(px2))
        srv.stop()
        # 5. /slots disabled on a real server
        row.faults += 1
        with soak.server(slots=2, ctx_per_slot=1024, extra=["--no-slots"]) as s2:
            px3 = soak.proxy(s2.url, {"slots_state_dir": str(soak.dir("a3-state")), "slots_probe_interval": 0},
                             "a-noslots")
            rs = [chat(px3.url, soak.messages(f"no-slots-{i}")) for i in range(2)]
            row.requests += 2
            slots = {r.headers.get("x-slot-id") for r in rs}
            warned = "/slots unavailable" in (soak.root / "a-noslots.log").read_text()
            if row.check(all(r.status_code == 200 for r in rs) and len(slots) == 2 and None not in slots and warned,
                         "--no-slots"):
                row.survived += 1
            row.memory_mb = max(row.memory_mb, soak.stop(px3))
        # 4. /slots hanging (stub): new sessions do not each wait for it
        row.faults += 1
        stub = soak.stub(slots_delay=30)
        px4 = soak.proxy(stub, {"slots_state_dir": str(soak.dir("a4-state")), "slots_probe_interval": 0},
                         "a-hang")
        waits = []
        for i in range(6):
            t0 = time.monotonic()
            rr = chat(px4.url, soak.messages(f"hang-{i}"), timeout=30)
            waits.append(round(time.monotonic() - t0, 2))
            row.requests += 1
            row.lost += rr.status_code != 200
        row.notes["slots_hanging_waits_s"] = waits
        if row.check(waits[0] >= 2.5 and max(waits[1:]) < 1.0, f"/slots hanging: waits {waits}"):
            row.survived += 1
        row.memory_mb = max(row.memory_mb, soak.stop(px4))
    return row


# ------------------------------------------------------------------------------------------- kill -9


class StateWatch(threading.Thread):
    """Reads every JSON file of a state dir every 10 ms: each must parse; each page record with tokens must name
    a file holding that many tokens (the stub writes the count into the file)."""

    def __init__(self, state: Path, save: Path) -> None:
        super().__init__(daemon=True)
        self.state, self.save = state, save
        self.stop = threading.Event()
        self.reads = self.corrupted = self.misleading = 0
        self.bad: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            for p in list(self.state.glob("*.json")):
                try:
                    raw = p.read_bytes()
                except OSError:
                    continue
                self.reads += 1
                try:
                    data = json.loads(raw)
                except ValueError:
                    self.corrupted += 1
                    self.bad.append(p.name)
                    continue
                if p.name.startswith("state-"):
                    for rec in (data.get("pages") or {}).values():
                        if rec.get("n_tokens", 0) > 0:
                            with contextlib.suppress(OSError):
                                head = (self.save / rec["file"]).read_bytes()[:8]
                                if head and int.from_bytes(head, "little") != rec["n_tokens"]:
                                    self.misleading += 1
            time.sleep(0.01)


def kills(soak: Soak, target: int, parallel: int = 3) -> Row:
    row = Row("kill -9 under load")
    with timed(row):
        state, save = soak.dir("b-state"), soak.dir("b-save")
        outside = soak.dir("b-outside") / "precious.txt"
        outside.write_text("KEEP")
        os.chmod(outside, 0o644)
        for i in range(3):  # hostile symlinks under page-file names, pointing out of the save dir
            (save / paging.page_file("hostile", str(i))).symlink_to(outside)
        stub = soak.stub(slots=4, save_dir=str(save), chat_delay=0.02)
        opts = {"slots_state_dir": str(state), "slots_save_dir": str(save), "slots_prefix_cache": "disk",
                "slots_probe_interval": 2, "slots_page_max_mb": 1}
        stable = soak.proxy(stub, {**opts, "slots_log_file": str(soak.root / "b-stable.jsonl")}, "b-stable")
        watch = StateWatch(state, save)
        watch.start()
        stop = threading.Event()
        counts = {"stable": 0, "stable_lost": 0, "victim": 0, "kills": 0}
        lock = threading.Lock()
        victims: list[MitmProxy | None] = [None] * parallel

        def stable_load(n: int) -> None:
            i = 0
            while not stop.is_set():
                for turn in range(3):
                    try:
                        r = chat(stable.url, soak.messages(f"stable-{n}-{i}", turn), timeout=60)
                        ok = r.status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    with lock:
                        counts["stable"] += 1
                        counts["stable_lost"] += not ok
                i += 1

        def victim_load(v: int) -> None:
            i = 0
            while not stop.is_set():
                px = victims[v]
                if px is None:
                    time.sleep(0.02)
                    continue
                with contextlib.suppress(httpx.HTTPError):
                    chat(px.url, soak.messages(f"victim-{v}-{i // 2}", i % 2), timeout=10)
                    with lock:
                        counts["victim"] += 1
                i += 1

        def killer(v: int) -> None:
            while not stop.is_set():
                with lock:
                    if counts["kills"] >= target:
                        return
                px = MitmProxy(stub, {**opts, "slots_log_file": str(soak.root / f"b-victim{v}.jsonl")},
                               log_path=str(soak.root / f"b-victim{v}.log"))
                try:
                    px.start(timeout=60)
                except (RuntimeError, TimeoutError):
                    continue
                victims[v] = px
                time.sleep(random.uniform(0.05, 1.5))
                soak.sample(px)
                assert px.proc is not None
                px.proc.kill()  # SIGKILL
                px.proc.wait(10)
                victims[v] = None
                with lock:
                    counts["kills"] += 1

        workers = [threading.Thread(target=stable_load, args=(n,), daemon=True) for n in range(2)]
        workers += [threading.Thread(target=victim_load, args=(v,), daemon=True) for v in range(parallel)]
        killers = [threading.Thread(target=killer, args=(v,), daemon=True) for v in range(parallel)]
        for t in (*workers, *killers):
            t.start()
        for t in killers:
            t.join()
        stop.set()
        for t in workers:
            t.join(120)
        # A proxy started after all that: it sweeps temp files and, at its first paging step, orphans.
        final = soak.proxy(stub, {**opts, "slots_log_file": str(soak.root / "b-final.jsonl")}, "b-final")
        for i in range(6):
            counts["stable"] += 1
            counts["stable_lost"] += chat(final.url, soak.messages(f"final-{i}")).status_code != 200
        time.sleep(1.0)
        watch.stop.set()
        watch.join()
        row.memory_mb = max(soak.stop(stable), soak.stop(final), *soak.peaks.values())
        row.faults = counts["kills"]
        alive_after = [json.loads(p.read_bytes()) for p in state.glob("state-*.json")]
        row.survived = counts["kills"] if alive_after and watch.corrupted == 0 else 0
        row.requests = counts["stable"] + counts["victim"]
        row.lost = counts["stable_lost"]
        row.corrupted = watch.corrupted
        recorded = {r["file"] for s in alive_after for r in (s.get("pages") or {}).values()}
        pages_on_disk = {p.name for p in save.iterdir() if paging.FILE_RE.match(p.name) and not p.is_symlink()}
        tmp_left = [p.name for p in state.iterdir() if p.name.endswith(".tmp")]
        row.notes.update(kills=counts["kills"], state_reads=watch.reads, stable_requests=counts["stable"],
                         victim_requests=counts["victim"], misleading_page_records=watch.misleading,
                         unrecorded_page_files=len(pages_on_disk - recorded), tmp_files_left=len(tmp_left),
                         page_files=len(pages_on_disk))
        row.check(counts["kills"] >= target, f"only {counts['kills']} kills")
        row.check(watch.corrupted == 0, f"corrupt reads: {watch.bad[:3]}")
        row.check(watch.misleading == 0, f"{watch.misleading} page records naming another content")
        row.check(counts["stable_lost"] == 0, f"{counts['stable_lost']} requests of the surviving proxy lost")
        row.check(outside.read_text() == "KEEP" and stat.S_IMODE(outside.stat().st_mode) == 0o644,
                  "a hostile symlink's target was changed")
    return row


# ------------------------------------------------------------------------------------------- load


def shared_while_free(state: Path, ttl: float, total: int) -> bool:
    """The state file shows a slot with two live sessions while another slot has none and no live claim."""
    for p in state.glob("state-*.json"):
        try:
            data = json.loads(p.read_bytes())
        except (OSError, ValueError):
            continue
        now = time.time()
        per: dict[int, int] = {}
        for rec in (data.get("sessions") or {}).values():
            if now - rec["last_used"] < ttl:
                per[rec["slot"]] = per.get(rec["slot"], 0) + 1
        claimed = {int(k) for k, v in (data.get("slots") or {}).items()
                   if v.get("owner") and now - v["last_used"] < ttl}
        free = [s for s in range(total) if s not in per and s not in claimed]
        if free and any(n >= 2 for n in per.values()):
            return True
    return False


def known_session_locks(url: str, state_dir: str, turns: int) -> int:
    """Lock acquisitions (state file and checkpoint index) during the request hooks of a known session's turns:
    the addon in process, against the real server (its first turn is the slow path and does take one)."""
    import asyncio

    from mitmproxy import http as mhttp
    from mitmproxy.test import taddons, tflow

    from slotkeeper import addon as addon_module
    from slotkeeper.drivers import store_file

    count = [0]
    real_async, real_sync = store_file.JsonFile.locked, store_file.JsonFile.locked_sync

    def counting_async(self: Any) -> Any:
        count[0] += 1
        return real_async(self)

    def counting_sync(self: Any) -> Any:
        count[0] += 1
        return real_sync(self)

    async def run() -> int:
        addons = addon_module.make_addons()
        with taddons.context(*addons) as tctx:
            for a in addons:
                tctx.configure(a, slots_state_dir=state_dir, slots_probe_interval=0, slots_log_requests="off")
            msgs = [{"role": "system", "content": "You are a test agent. " * 10}, {"role": "user", "content": "go"}]

            async def hook(body: dict[str, Any]) -> None:
                req = mhttp.Request.make("POST", url + "/v1/chat/completions", json.dumps(body).encode(),
                                         {"content-type": "application/json"})
                f = tflow.tflow(req=req)
                for a in addons:
                    fn = getattr(a, "request", None)
                    if fn is not None:
                        await fn(f)

            await hook({"messages": msgs})
            store_file.JsonFile.locked, store_file.JsonFile.locked_sync = counting_async, counting_sync  # type: ignore[method-assign]
            try:
                for i in range(turns):
                    msgs = [*msgs, {"role": "assistant", "content": f"a{i}"}, {"role": "user", "content": f"u{i}"}]
                    await hook({"messages": msgs})
            finally:
                store_file.JsonFile.locked, store_file.JsonFile.locked_sync = real_async, real_sync  # type: ignore[method-assign]
            for up in addons[0].rt.upstreams.values():
                await up.aclose()
        return count[0]

    return asyncio.run(run())


def load(soak: Soak, sessions: int) -> Row:
    row = Row("load: 3 proxies, 4 slots")
    with timed(row):
        state = soak.dir("c-state")
        with soak.server(slots=4, ctx_per_slot=1024) as srv:
            opts = {"slots_state_dir": str(state), "slots_probe_interval": 0}
            pxs = [soak.proxy(srv.url, {**opts, "slots_log_file": str(soak.root / f"c{i}.jsonl")}, f"c{i}")
                   for i in range(3)]
            # three new sessions at once on four slots: three slots, never a shared one
            first: list[httpx.Response | None] = [None] * 3

            def one(i: int) -> None:
                first[i] = chat(pxs[i].url, soak.messages(f"trio-{i}"))

            ts = [threading.Thread(target=one, args=(i,)) for i in range(3)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            trio = {r.headers.get("x-slot-id") for r in first if r is not None}
            row.requests += 3
            row.check(len(trio) == 3 and None not in trio, f"three sessions on three proxies got slots {trio}")
            # 32 new sessions at once, two turns each
            results: list[int] = []
            streak_start: list[float | None] = [None]
            longest = [0.0]
            done = threading.Event()

            def sampler() -> None:
                while not done.is_set():
                    if shared_while_free(state, 120.0, 4):
                        streak_start[0] = streak_start[0] or time.monotonic()
                        longest[0] = max(longest[0], time.monotonic() - streak_start[0])
                    else:
                        streak_start[0] = None
                    time.sleep(0.1)

            def session(i: int) -> None:
                px = pxs[i % 3]
                for turn in range(2):
                    try:
                        r = chat(px.url, soak.messages(f"load-{i}", turn), timeout=600)
                        results.append(r.status_code)
                    except httpx.HTTPError:
                        results.append(0)

            sam = threading.Thread(target=sampler, daemon=True)
            sam.start()
            ts = [threading.Thread(target=session, args=(i,)) for i in range(sessions)]
            t0 = time.monotonic()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            row.notes["load_seconds"] = round(time.monotonic() - t0, 1)
            time.sleep(8)  # settle: touches flushed, shared slots noticed
            done.set()
            sam.join()
            row.requests += len(results)
            row.lost = sum(1 for c in results if c != 200)
            settled_bad = shared_while_free(state, 120.0, 4)
            row.notes["longest_shared_while_free_s"] = round(longest[0], 1)
            row.check(row.lost == 0, f"{row.lost} load requests failed")
            row.check(not settled_bad, "a slot shared while another is free after the run settled")
            row.check(longest[0] < 10.0, f"a slot shared while another was free for {longest[0]:.1f} s")
            for px in pxs:
                row.memory_mb = max(row.memory_mb, soak.stop(px))
            locks = known_session_locks(srv.url, str(soak.dir("c-inproc")), 20)
            row.notes["lock_acquisitions_per_known_request"] = locks / 20
            row.check(locks == 0, f"{locks} lock acquisitions in 20 known-session requests")
    return row


# ------------------------------------------------------------------------------------------- bad input


def bombs() -> dict[str, tuple[bytes, str]]:
    head, tail = b'{"messages":[{"role":"user","content":"', b'"}]}'
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    g = c.compress(head) + b"".join(c.compress(b"A" * (1 << 20)) for _ in range(200)) + c.compress(tail) + c.flush()
    big = head + b"A" * (200 << 20) + tail
    out = {"gzip bomb 200 MB": (g, "gzip"), "br bomb 200 MB": (brotli.compress(big, quality=5), "br"),
           "zstd bomb 200 MB": (encoding.encode(big, "zstd"), "zstd")}
    del big
    return out


def crafted(soak: Soak) -> list[tuple[str, bytes, dict[str, str]]]:
    s = soak.sentinel
    base = json.dumps({"messages": soak.messages("crafted")}).encode()
    j = {"content-type": "application/json"}
    cases = [
        ("invalid UTF-8", base[:-3] + b"\xff\xfe\xc3\x28" + base[-3:], j),
        ("lone surrogate", base[:-3] + b' \\ud800' + base[-3:], j),
        ("lone surrogate + id_slot", base[:-1] + b', "id_slot": 1, "x": "\\udc00"}', j),
        ("deep nesting 100k", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", j),
        ("huge float 1e400", base[:-1] + b', "temperature": 1e400, "top_p": -1e999}', j),
        ("huge int 5000 digits", base[:-1] + b', "seed": ' + b"9" * 5000 + b"}", j),
        ("duplicate keys", base[:-1] + b', "messages": [{"role": "user", "content": "' + s.encode() + b'"}]}', j),
        ("duplicate id_slot", base[:-1] + b', "id_slot": 1, "id_slot": 99, "cache_prompt": false}', j),
        ("escaped keys", base[:-1] + b', "id\\u005fslot": 2, "cache\\u005fprompt": false}', j),
        ("truncated JSON", base[:-7], j),
        ("not an object", b"[" + base + b"]", j),
        ("NaN literal", base[:-1] + b', "temperature": NaN}', j),
        ("empty body", b"", j),
        ("gzip header, not gzip", b"definitely not gzip", {**j, "content-encoding": "gzip"}),
        ("unknown encoding", gzip.compress(base), {**j, "content-encoding": "compress"}),
        ("gzip body", gzip.compress(base), {**j, "content-encoding": "gzip"}),
        ("20 MB body", json.dumps({"messages": [*soak.messages("big"), {"role": "user",
                                                                        "content": "z" * (20 << 20)}]}).encode(), j),
    ]
    for name, (raw, enc) in bombs().items():
        cases.append((name, raw, {**j, "content-encoding": enc}))
    return cases


def received_ok(sent: bytes, headers: dict[str, str], got: bytes) -> bool:
    """What reached the server is the client's bytes, or the same JSON object with our two fields set."""
    if got == sent:
        return True
    enc = headers.get("content-encoding")
    try:
        plain_sent = gzip.decompress(sent) if enc == "gzip" else sent
        plain_got = gzip.decompress(got) if enc == "gzip" else got
        a, b = json.loads(plain_sent), json.loads(plain_got)
    except (ValueError, OSError, EOFError):
        return False
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    strip = lambda d: json.dumps({k: v for k, v in d.items() if k not in ("id_slot", "cache_prompt")},  # noqa: E731
                                 sort_keys=True)  # as text: NaN equals NaN
    return strip(a) == strip(b)


def bad_input(soak: Soak, fuzz_examples: int) -> Row:
    row = Row("bad input")
    with timed(row):
        import asyncio

        from bench.stub_llama import StubLlama

        stub = StubLlama()
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(stub.start(), loop).result(10)
        px = soak.proxy(stub.url, {"slots_state_dir": str(soak.dir("d-state")), "slots_probe_interval": 0,
                                   "slots_log_file": str(soak.root / "d.jsonl")}, "d-proxy")
        worst = 0.0
        for name, raw, headers in crafted(soak):
            row.bad_inputs += 1
            before = len(stub.seen)
            t0 = time.monotonic()
            try:
                r = httpx.post(px.url + "/v1/chat/completions", content=raw, headers=headers, timeout=120)
                answered = r.status_code in (200, 400)
            except httpx.HTTPError:
                answered = False
            worst = max(worst, time.monotonic() - t0)
            got = stub.seen[-1].body if len(stub.seen) > before else None
            ok = answered and got is not None and received_ok(raw, headers, got) and alive(px)
            if row.check(ok, f"bad input {name!r}"):
                row.survived += 1
            soak.sample(px)
        # chunked uploads (a generator body: httpx sends Transfer-Encoding: chunked)
        for name, size in (("chunked upload", 4096), ("chunked upload 5 MB", 5 << 20)):
            msgs = [*soak.messages("chunked"), {"role": "user", "content": "c" * size}]
            raw = json.dumps({"messages": msgs}).encode()
            row.bad_inputs += 1

            def gen(data: bytes = raw) -> Iterator[bytes]:
                for i in range(0, len(data), 65536):
                    yield data[i:i + 65536]

            r = httpx.post(px.url + "/v1/chat/completions", content=gen(), timeout=60,
                           headers={"content-type": "application/json"})
            got = stub.seen[-1].body
            if row.check(r.status_code == 200 and received_ok(raw, {}, got) and b"id_slot" in got, name):
                row.survived += 1
        row.requests = row.bad_inputs
        text = (soak.root / "d-proxy.log").read_text()
        row.check("Addon error" not in text and "Traceback" not in text, "a traceback in the proxy log")
        row.notes["slowest_bad_input_s"] = round(worst, 2)
        row.memory_mb = soak.stop(px)
        asyncio.run_coroutine_threadsafe(stub.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        # the fuzzers, at soak size
        env = {**os.environ, "SLOTKEEPER_FUZZ_EXAMPLES": str(fuzz_examples)}
        fz = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_fuzz.py",
                             "tests/test_fastpath.py", "tests/test_rewrite.py", "tests/test_body_decode.py"],
                            cwd=str(ROOT), env=env, capture_output=True, text=True)
        fuzz_tests = 4
        row.bad_inputs += fuzz_tests * fuzz_examples
        row.notes["fuzz"] = fz.stdout.strip().splitlines()[-1] if fz.stdout.strip() else fz.stderr[-300:]
        row.check(fz.returncode == 0, f"fuzzers: {row.notes['fuzz']}")
    return row


# ------------------------------------------------------------------------------------------- security


def non_loopback_ip() -> str | None:
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.255", 1))
        ip = s.getsockname()[0]
        return None if ip.startswith("127.") else ip
    return None


def security(soak: Soak) -> Row:
    row = Row("security")
    with timed(row):
        key = f"sk-soak-{random.randrange(16**10):010x}"
        with soak.server(slots=2, ctx_per_slot=1024, extra=["--api-key", key]) as srv:
            px = soak.proxy(srv.url, {"slots_state_dir": str(soak.dir("e-state")), "slots_api_key": key,
                                      "slots_log_file": str(soak.root / "e.jsonl")}, "e-apikey")
            r = chat(px.url, soak.messages("api-key"), headers={"authorization": f"Bearer {key}"})
            row.requests += 1
            row.faults += 1
            if row.check(r.status_code == 200 and r.headers.get("x-slot-id") is not None, "--api-key server pinned"):
                row.survived += 1
            row.memory_mb = soak.stop(px)
        # the local API from a non-loopback address
        ip = non_loopback_ip()
        if ip is None:
            row.notes["local_api_non_loopback"] = "skipped: no non-loopback address"
        else:
            port = free_port()
            argv = [a.replace("@127.0.0.1:", "@0.0.0.0:") for a in mitm_argv(
                "http://127.0.0.1:9", port, {"slots_state_dir": str(soak.dir("e2-state"))})]
            proc = subprocess.Popen(argv, cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            soak.procs.append(proc)
            deadline = time.monotonic() + 30
            codes: dict[str, int] = {}
            while time.monotonic() < deadline:
                try:
                    codes = {"remote": httpx.get(f"http://{ip}:{port}/_slots/status", timeout=5).status_code,
                             "loopback": httpx.get(f"http://127.0.0.1:{port}/_slots/status", timeout=5).status_code,
                             "post": httpx.post(f"http://127.0.0.1:{port}/_slots/status", timeout=5).status_code}
                    break
                except httpx.HTTPError:
                    time.sleep(0.2)
            proc.send_signal(signal.SIGINT)
            proc.wait(15)
            row.notes["local_api"] = codes
            row.check(codes == {"remote": 403, "loopback": 200, "post": 405}, f"local API answers {codes}")
    return row


def scan_outputs(soak: Soak, row: Row) -> None:
    """Every output of the run: no sentinel, private modes, only our own file names."""
    hits, modes, names = [], [], []
    sentinel = soak.sentinel.encode()
    for p in soak.root.rglob("*"):
        if p.is_symlink() or p.name.startswith("llama-") or "outside" in str(p):
            continue
        if p.is_dir():
            if p.name.endswith("-save"):
                continue  # the server's directory (its files are the server's)
            if stat.S_IMODE(p.stat().st_mode) != 0o700:
                modes.append(f"{p.relative_to(soak.root)} {stat.S_IMODE(p.stat().st_mode):o}")
            continue
        if sentinel in p.read_bytes():
            hits.append(str(p.relative_to(soak.root)))
        in_state = p.parent.name.endswith("-state") or p.parent.name.endswith("-inproc")
        if in_state and stat.S_IMODE(p.stat().st_mode) != 0o600:
            modes.append(f"{p.relative_to(soak.root)} {stat.S_IMODE(p.stat().st_mode):o}")
        if p.suffix == ".jsonl" and stat.S_IMODE(p.stat().st_mode) != 0o600:
            modes.append(f"{p.relative_to(soak.root)} {stat.S_IMODE(p.stat().st_mode):o}")
        if (in_state or p.parent.name.endswith("-save")) and not OWN_NAMES.match(p.name):
            names.append(str(p.relative_to(soak.root)))
    row.notes.update(files_scanned=sum(1 for _ in soak.root.rglob("*")), sentinel_hits=hits, bad_modes=modes,
                     foreign_names=names)
    row.check(not hits, f"prompt text in {hits[:3]}")
    row.check(not modes, f"modes: {modes[:3]}")
    row.check(not names, f"unexpected file names: {names[:3]}")


# ------------------------------------------------------------------------------------------- table


def table(rows: list[Row]) -> str:
    cols = ["class", "faults injected", "survived", "bad inputs tried", "requests", "lost", "state files corrupted",
            "memory peak MB", "s", "failed checks"]
    data = [[r.name, r.faults, r.survived, r.bad_inputs, r.requests, r.lost, r.corrupted, f"{r.memory_mb:.0f}",
             r.seconds, len(r.failed)] for r in rows]
    data.append(["total", sum(r.faults for r in rows), sum(r.survived for r in rows),
                 sum(r.bad_inputs for r in rows), sum(r.requests for r in rows), sum(r.lost for r in rows),
                 sum(r.corrupted for r in rows), f"{max((r.memory_mb for r in rows), default=0):.0f}",
                 round(sum(r.seconds for r in rows), 1), sum(len(r.failed) for r in rows)])
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *data, strict=True)]
    line = lambda xs: "| " + " | ".join(str(x).ljust(w) for x, w in zip(xs, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, data)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=200)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--fuzz-examples", type=int, default=2500)
    ap.add_argument("--threads", type=int, default=1, help="llama-server threads")
    ap.add_argument("--disk-seconds", type=float, default=60.0, help="the disk budgets' soak")
    ap.add_argument("--only", nargs="*", default=[], help="upstream kills load bad security memory store disk")
    ap.add_argument("--keep", action="store_true", help="keep the scratch dir")
    a = ap.parse_args(argv)
    soak = Soak(a.threads)
    classes: list[tuple[str, Callable[[], Row]]] = [
        ("upstream", lambda: upstream_faults(soak)), ("kills", lambda: kills(soak, a.kills)),
        ("load", lambda: load(soak, a.sessions)), ("bad", lambda: bad_input(soak, a.fuzz_examples)),
        ("memory", lambda: memory_bounds.run(soak)), ("store", lambda: reliability_store.run(soak)),
        ("disk", lambda: disk_budget.run(soak, a.disk_seconds)),
        ("security", lambda: security(soak))]
    rows: list[Row] = []
    try:
        for name, run in classes:
            if a.only and name not in a.only:
                continue
            print(f"reliability: {name} ...", flush=True)
            rows.append(run())
        if rows:
            scan_outputs(soak, next((r for r in rows if r.name == "security"), rows[0]))
    finally:
        soak.close()
        if not a.keep:
            shutil.rmtree(soak.root, ignore_errors=True)
    print(table(rows))
    for r in rows:
        if r.name in ("memory bounds", "store & doors") and r.notes.get("table"):
            print(f"\n{r.name}, one row per attack:\n{r.notes['table']}")
    failed = [f"{r.name}: {f}" for r in rows for f in r.failed]
    for f in failed:
        print("FAILED", f)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": [asdict(r) for r in rows], "table": table(rows)}, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
