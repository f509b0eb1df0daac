"""The "memory bounds" class of `make reliability`: attacks where one value or one client could make the proxy
grow without bound, each against a real mitmdump process (issue 20, items 1-3).

Attacks (one row each):
- total_slots: a state file that says the server has 100,000,000 slots, the server down; `/_slots/status` is
  asked and new sessions are placed (only `/props` may size anything; docs/reliability.md);
- swap_models: `slots_upstreams` in front of a llama-swap stand-in that lists one model; 1,000 requests name
  1,000 other models (only listed models get an upstream; their number is capped; idle ones are forgotten);
- fastpath_heads: 60 new sessions with 8 MB system prompts each, two turns (the fast path counts heads, tails
  and middles against its byte cap; `BOUNDS_FAST_SESSIONS` changes the 60).

For each: the proxy's peak resident memory growth over its baseline (VmHWM, /proc) next to the attack's cap,
whether the proxy is still alive, and the slowest `/_slots/health` answer while the attack ran (asked every
250 ms). A proxy whose memory grows past `KILL_MB` is killed at once (the machine is shared): that row fails.

Row shape (`Attack`): name, cap_mb, growth_mb, alive, health_max_s, requests, notes, failed. `run(soak)` returns one
summary row for the main table (duck-typed like `bench.reliability.Row`) with every attack in `notes`, and
prints the per-attack table.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from drivers.store_file import state_file_name
from launch.llama_server import free_port

CAP_MB = 300.0        # every attack's bound on peak RSS growth (issue 20)
HEALTH_S = 1.0        # every health answer within this
KILL_MB = 1500.0      # a proxy that grows past this is killed (the attack is lost; never the machine)
SWAP_MODELS = 1000
FAST_SESSIONS = int(os.environ.get("BOUNDS_FAST_SESSIONS", "60"))
FAST_PROMPT = 8 << 20


@dataclass
class Attack:
    name: str
    cap_mb: float = CAP_MB
    growth_mb: float = 0.0
    alive: bool = False
    health_max_s: float = 0.0
    requests: int = 0   # sent through the proxy by the attack (health checks aside)
    notes: dict[str, Any] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)

    def check(self, ok: bool, what: str) -> bool:
        if not ok:
            self.failed.append(what)
        return ok


@dataclass
class BoundsRow:
    """The summary row for `bench.reliability`'s table (same fields as its `Row`)."""

    name: str = "memory bounds"
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


def _proc_kb(pid: int, key: str) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class Watch(threading.Thread):
    """Samples the proxy's memory every 50 ms (killing it past `KILL_MB` growth) and its health every 250 ms."""

    def __init__(self, pid: int, url: str) -> None:
        super().__init__(daemon=True)
        self.pid, self.url = pid, url
        self.base = _proc_kb(pid, "VmRSS:")
        self.peak = _proc_kb(pid, "VmHWM:")
        self.killed = False
        self.health_max = 0.0
        self.health_failed = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        next_health = 0.0
        with httpx.Client(timeout=5) as client:
            while not self.stopping.is_set():
                self.peak = max(self.peak, _proc_kb(self.pid, "VmHWM:"))
                if not self.killed and _proc_kb(self.pid, "VmRSS:") - self.base > KILL_MB:
                    self.killed = True
                    os.kill(self.pid, signal.SIGKILL)
                if time.monotonic() >= next_health and not self.killed:
                    next_health = time.monotonic() + 0.25
                    t0 = time.monotonic()
                    try:
                        ok = client.get(self.url + "/_slots/health").status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    self.health_max = max(self.health_max, time.monotonic() - t0)
                    self.health_failed += not ok
                self.stopping.wait(0.05)

    def finish(self) -> float:
        self.stopping.set()
        self.join(10)
        self.peak = max(self.peak, _proc_kb(self.pid, "VmHWM:"))
        return self.peak - self.base


# ------------------------------------------------------------------------------------------- stand-ins


def _props(slots: int = 4) -> dict[str, Any]:
    return {"total_slots": slots, "media_marker": "<__media_bounds__>", "build_info": "b0-bounds",
            "model_path": "/bounds.gguf", "default_generation_settings": {"n_ctx": 8192}}


class _Quiet(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a proxy that hung up mid-answer (it was killed, or gave up): nothing to report


class StandIn:
    """A llama-server (or, with `models`, a llama-swap listing them) that keeps nothing of what it is sent."""

    def __init__(self, models: tuple[str, ...] | None = None) -> None:
        self.models = models
        self.port = free_port()
        self.httpd = _Quiet(("127.0.0.1", self.port), self._handler())
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _answer(self, method: str, path: str, model: str | None) -> tuple[int, Any]:
        swap = self.models is not None
        if path == "/health":
            return 200, {"status": "ok"}
        if swap and path == "/running":
            return 200, {"running": [{"model": m, "state": "ready"} for m in self.models or ()]}
        if swap and path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "llama-swap"}
                                                    for m in self.models or ()]}
        if swap and path.startswith("/upstream/"):
            name, _, rest = path[len("/upstream/"):].partition("/")
            if name not in (self.models or ()):
                return 404, "model not found"
            path = "/" + rest
        elif swap and method == "POST" and model not in (self.models or ()):
            return 400, {"error": "could not find model"}
        if path == "/props":
            return 200, _props()
        if path == "/slots":
            return 200, [{"id": i, "n_ctx": 8192, "is_processing": False, "n_prompt_tokens": 0} for i in range(4)]
        if method == "POST" and path.endswith("/chat/completions"):
            return 200, {"choices": [{"message": {"role": "assistant", "content": "ok"}}],
                         "timings": {"cache_n": 0, "prompt_n": 1, "prompt_per_second": 1000.0}}
        return 404, {"error": "not found"}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                model, head = None, b""
                while length > 0:  # read and drop, keeping only enough to see a short "model"
                    chunk = self.rfile.read(min(length, 1 << 20))
                    if not chunk:
                        break
                    head = head or chunk[:4096]
                    length -= len(chunk)
                if head:
                    with_model = head.split(b'"model"', 1)
                    if len(with_model) == 2:
                        model = with_model[1].split(b'"', 2)[1].decode("utf-8", "replace")
                status, body = stand_in._answer(self.command, self.path.split("?", 1)[0], model)
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "text/plain" if isinstance(body, str) else "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _handle

        return Handler


# ------------------------------------------------------------------------------------------- attacks


def _start(soak: Any, upstream: str, opts: dict[str, Any], name: str) -> tuple[Any, Watch]:
    px = soak.proxy(upstream, opts, name)
    httpx.get(px.url + "/_slots/health", timeout=30)
    watch = Watch(px.proc.pid, px.url)
    watch.start()
    return px, watch


def _end(soak: Any, px: Any, watch: Watch, row: Attack) -> None:
    try:
        t0 = time.monotonic()
        ok = httpx.get(px.url + "/_slots/status", timeout=5).status_code == 200
        row.notes["status_s"] = round(time.monotonic() - t0, 3)
        row.check(ok and row.notes["status_s"] <= HEALTH_S, "status not answered within 1 s after the attack")
    except httpx.HTTPError:
        row.check(False, "status not answered after the attack")
    row.growth_mb = round(watch.finish(), 1)
    row.alive = px.proc is not None and px.proc.poll() is None
    row.health_max_s = round(watch.health_max, 3)
    row.notes["killed_past_mb"] = KILL_MB if watch.killed else None
    row.check(row.alive, "proxy died")
    row.check(not watch.killed, f"killed: RSS grew past {KILL_MB:.0f} MB")
    row.check(row.growth_mb <= row.cap_mb, f"peak RSS growth {row.growth_mb} MB > cap {row.cap_mb} MB")
    row.check(watch.health_failed == 0 and watch.health_max <= HEALTH_S,
              f"health: {watch.health_failed} failed, slowest {watch.health_max:.2f} s")
    soak.stop(px)


def _chat(url: str, msgs: list[dict[str, str]], model: str = "m0", timeout: float = 60) -> int:
    body = {"model": model, "messages": msgs, "max_tokens": 1}
    try:
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout).status_code
    except httpx.HTTPError:
        return 0


def total_slots(soak: Any) -> Attack:
    """A state file claiming 100,000,000 slots for a server that is down: status, then new sessions."""
    row = Attack("total_slots")
    state = soak.dir("bounds-total")
    dead = f"http://127.0.0.1:{free_port()}"
    (state / state_file_name(dead)).write_text(json.dumps({"version": 1, "upstream": dead,
                                                           "total_slots": 100_000_000, "slots": {}, "sessions": {}}))
    os.chmod(state / state_file_name(dead), 0o600)
    px, watch = _start(soak, dead, {"slots_state_dir": str(state)}, "bounds-total")
    try:
        codes = []
        for i in range(20):
            codes.append(_chat(px.url, [{"role": "system", "content": f"agent {i}"},
                                        {"role": "user", "content": "go"}], timeout=30))
            with_status = httpx.get(px.url + "/_slots/status", timeout=30)
            codes.append(with_status.status_code)
        status = httpx.get(px.url + "/_slots/status", timeout=30).json()
        server = next(iter(status.get("servers") or [{}]), {})
        row.notes["status_slots"] = len(server.get("slots") or [])
        row.notes["codes"] = sorted(set(codes))
        row.requests = len(codes) + 1
    except (httpx.HTTPError, ValueError) as e:
        row.notes["error"] = type(e).__name__
    finally:
        _end(soak, px, watch, row)
    row.check(row.notes.get("status_slots", 0) <= 1024, "status lists more slots than the cap")
    return row


def swap_models(soak: Any) -> Attack:
    """1,000 requests naming 1,000 models llama-swap does not list."""
    row = Attack("swap_models")
    swap = StandIn(models=("m0",))
    state = soak.dir("bounds-swap")
    px, watch = _start(soak, swap.url, {"slots_state_dir": str(state), "slots_upstreams": [swap.url]}, "bounds-swap")
    try:
        with httpx.Client(timeout=30) as client:
            for i in range(SWAP_MODELS):
                body = {"model": f"attack-{i:05d}", "max_tokens": 1,
                        "messages": [{"role": "system", "content": f"agent {i}"}, {"role": "user", "content": "go"}]}
                with contextlib.suppress(httpx.HTTPError):
                    client.post(px.url + "/v1/chat/completions", json=body)
        row.requests = SWAP_MODELS + 2
        row.notes["listed_model"] = _chat(px.url, [{"role": "system", "content": "real"},
                                                   {"role": "user", "content": "go"}])
        status = httpx.get(px.url + "/_slots/status", timeout=30)
        row.notes["status_kb"] = round(len(status.content) / 1024, 1)
        row.notes["servers"] = len(status.json().get("servers") or [])
        row.notes["state_files"] = len(list(state.iterdir()))
        pid = px.proc.pid
        c0 = cpu_seconds(pid)
        time.sleep(3)
        row.notes["idle_cpu_pct"] = round(100 * (cpu_seconds(pid) - c0) / 3, 1)
    except (httpx.HTTPError, ValueError) as e:
        row.notes["error"] = type(e).__name__
    finally:
        _end(soak, px, watch, row)
        swap.close()
    row.check(row.notes.get("listed_model") == 200, "the listed model's request failed")
    row.check(row.notes.get("servers", 99) <= 8, "unlisted models got upstreams")
    row.check(row.notes.get("state_files", 999) <= 8, "state files for unlisted models")
    row.check(row.notes.get("idle_cpu_pct", 100) < 5, "busy while idle")
    return row


def fastpath_heads(soak: Any) -> Attack:
    """60 new sessions, each with its own 8 MB system prompt (two turns, so the fast path learns and matches)."""
    row = Attack("fastpath_heads")
    server = StandIn()
    px, watch = _start(soak, server.url, {"slots_state_dir": str(soak.dir("bounds-fast"))}, "bounds-fast")
    ok = 0
    try:
        for i in range(FAST_SESSIONS):
            system = f"session {i:03d} " + "x" * FAST_PROMPT
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": "first question please"}]
            ok += _chat(px.url, msgs) == 200
            msgs += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "second"}]
            ok += _chat(px.url, msgs) == 200
            del system, msgs
        row.notes["requests_ok"] = ok
        row.requests = 2 * FAST_SESSIONS
    finally:
        _end(soak, px, watch, row)
        server.close()
    row.check(ok == 2 * FAST_SESSIONS, f"{2 * FAST_SESSIONS - ok} requests failed")
    return row


ATTACKS = (total_slots, swap_models, fastpath_heads)


def table(attacks: list[Attack]) -> str:
    cols = ["attack", "peak RSS growth MB", "cap MB", "alive", "slowest health s", "failed checks"]
    data = [[a.name, f"{a.growth_mb:.0f}", f"{a.cap_mb:.0f}", "yes" if a.alive else "NO", f"{a.health_max_s:.2f}",
             len(a.failed)] for a in attacks]
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *data, strict=True)]
    line = lambda xs: "| " + " | ".join(str(x).ljust(w) for x, w in zip(xs, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, data)])


def run(soak: Any, only: tuple[str, ...] = ()) -> BoundsRow:
    """Every attack (or those named in `only`), each on its own proxy; one summary row."""
    t0 = time.monotonic()
    attacks = []
    for attack in ATTACKS:
        if only and attack.__name__ not in only:
            continue
        try:
            attacks.append(attack(soak))
        except Exception as e:  # a crashed attack is a failed check, not a lost table
            attacks.append(Attack(attack.__name__, failed=[f"crashed: {type(e).__name__}: {e}"]))
    print(table(attacks), flush=True)
    for a in attacks:
        print(f"  {a.name}: {json.dumps(a.notes)}", flush=True)
    return BoundsRow(faults=len(attacks), survived=sum(a.alive and not a.failed for a in attacks),
                     requests=sum(a.requests for a in attacks),
                     memory_mb=max((a.growth_mb for a in attacks), default=0.0),
                     seconds=round(time.monotonic() - t0, 1),
                     failed=[f"{a.name}: {f}" for a in attacks for f in a.failed],
                     notes={"attacks": [asdict(a) for a in attacks], "table": table(attacks)})


def main() -> int:
    """`python -m bench.memory_bounds [attack ...]`: this class alone."""
    import shutil
    import sys

    from bench.reliability import Soak

    soak = Soak(1)
    try:
        row = run(soak, tuple(sys.argv[1:]))
    finally:
        soak.close()
        shutil.rmtree(soak.root, ignore_errors=True)
    for f in row.failed:
        print("FAILED", f)
    return 1 if row.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
