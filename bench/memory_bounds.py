"""The "memory bounds" class of `make reliability` (`python -m bench.memory_bounds [attack ...]` alone): every
place where one value, one client or one upstream stream could grow the proxy without bound (issue 20, items
1-6, 15, 16), each attack against a real mitmdump process of its own.

Attacks (one row each; `bench/memory_bounds_streams.py` has the stream and state ones and their stub):
- total_slots (item 1): a state file that says the server has 100,000,000 slots, the server down;
  `/_slots/status` is asked and new sessions are placed (only `/props` may size anything);
- swap_models (item 2): `slots_upstreams` in front of a llama-swap stand-in that lists one model; 1,000
  requests name 1,000 other models (only listed models get an upstream; their number is capped);
- fastpath_heads (item 3): 60 new sessions with 8 MB system prompts each, two turns (the fast path counts
  heads, tails and middles against its byte cap; a system message past 4 MB is not learned from);
- sse-no-blank, sse-long-line (item 4), anthropic-long-line (item 5), state-deep, redis-deep (item 6),
  state-sparse (item 15), json-large-chat, json-large-anthropic (item 16);
- the reliability round 4 attacks on a server's numbers and a request's cost (`bench/memory_bounds_requests.py`:
  props-slots, infinite-speed, responses-items, body-items, answer-nprobs, marks-404, prompts-1mb,
  tool-input-deep).

For each: the proxy's peak RSS growth over the attack (its VmHWM during the attack minus its VmRSS when the
attack starts, after one warm-up request) next to the cap, 300 MB; `/_slots/health` asked every 100 ms, each
answer within 1 s; `/_slots/status` within 1 s after it; the proxy alive; and what the client got. A proxy
that grows past `KILL_MB` is killed at once (the machine is shared): that row fails. `Sizes.small()` runs
every attack scaled down, past every cap still, for `tests/test_real_memory_bounds.py`.

`run(soak)` prints the per-attack table and returns one summary row for the soak's table (duck-typed like
`bench.reliability.Row`; its memory peak is the highest VmHWM of the attacked proxies, as in every other row).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from slotkeeper.drivers.store_file import state_file_name
from slotkeeper.launch.mitmdump import free_port

CAP_MB = 300.0        # every attack's bound on peak RSS growth (issue 20)
HEALTH_S = 1.0        # every health answer within this
HEALTH_EVERY = 0.1    # health is asked this often
KILL_MB = 1500.0      # a proxy that grows past this is killed (the attack is lost; never the machine)


@dataclass(frozen=True)
class Sizes:
    """How hard each attack pushes; the defaults are the issue's numbers."""

    swap_models: int = 1000
    fast_sessions: int = int(os.environ.get("BOUNDS_FAST_SESSIONS", "60"))
    fast_prompt: int = 8 << 20
    stream_mb: int = 200
    json_mb: int = 1024
    state_depth: int = 200_000
    redis_depth: int = 100_000
    sparse_bytes: int = 1 << 30

    @classmethod
    def small(cls) -> Sizes:
        """Every attack still past its cap (4 MB lines and events, 64 MB answers, 4 MB system messages)."""
        return cls(swap_models=40, fast_sessions=3, stream_mb=12, json_mb=72)


@dataclass
class Attack:
    name: str
    item: str = ""
    keeps: str = ""            # the bound the code keeps, which the attack tests
    cap_mb: float = CAP_MB
    growth_mb: float = 0.0     # VmHWM during the attack minus VmRSS at its start
    peak_mb: float = 0.0       # the proxy's VmHWM (the soak table's "memory peak" column)
    alive: bool = False
    health_max_s: float = 0.0
    health_late: int = 0       # health answers that failed or took longer than HEALTH_S
    requests: int = 0          # sent through the proxy by the attack (health and status aside)
    seconds: float = 0.0
    outcome: str = ""          # "ok: …" when the client got what it should
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


def proc_mb(pid: int, key: str) -> float:
    """A `/proc/<pid>/status` size (`VmRSS:`, `VmHWM:`) in MB; 0 when the process is gone."""
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
    """Samples the proxy's memory every 50 ms (killing it past `KILL_MB` growth) and asks its health every
    100 ms; `ended` is set when it was killed or the attack gave up, so a reading client stops. While `quiet` is
    set it asks nothing (an attack measuring the proxy's idle CPU would otherwise count the health answers)."""

    def __init__(self, pid: int, url: str) -> None:
        super().__init__(daemon=True)
        self.pid, self.url = pid, url
        self.base = proc_mb(pid, "VmRSS:")
        self.peak = proc_mb(pid, "VmHWM:")
        self.killed = False
        self.health_max = 0.0
        self.health_late = 0
        self.stopping = threading.Event()
        self.ended = threading.Event()
        self.quiet = threading.Event()

    def run(self) -> None:
        next_health = 0.0
        with httpx.Client(timeout=5) as client:
            while not self.stopping.is_set():
                self.peak = max(self.peak, proc_mb(self.pid, "VmHWM:"))
                if not self.killed and proc_mb(self.pid, "VmRSS:") - self.base > KILL_MB:
                    self.killed = True
                    self.ended.set()
                    os.kill(self.pid, signal.SIGKILL)
                if time.monotonic() >= next_health and not self.killed and not self.quiet.is_set():
                    t0 = time.monotonic()
                    next_health = t0 + HEALTH_EVERY
                    try:
                        ok = client.get(self.url + "/_slots/health").status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    took = time.monotonic() - t0
                    self.health_max = max(self.health_max, took)
                    self.health_late += not (ok and took <= HEALTH_S)
                self.stopping.wait(0.05)

    def finish(self) -> float:
        """Stop watching; the peak growth in MB."""
        self.stopping.set()
        self.join(10)
        self.peak = max(self.peak, proc_mb(self.pid, "VmHWM:"))
        return self.peak - self.base


def measure(soak: Any, row: Attack, upstream: str, opts: dict[str, Any], attack: Callable[[Any, Watch], str],
            limit_s: float = 240.0) -> Attack:
    """Start a proxy of its own, warm it with one request, run `attack(proxy, watch)` (its outcome) while the
    watch samples memory and health, and fill `row` in with the numbers and the checks."""
    t0 = time.monotonic()
    px = soak.proxy(upstream, opts, f"mb-{row.name}")
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(px.url + "/v1/chat/completions", timeout=30,
                   json={"model": "m0", "messages": soak.messages("warm"), "max_tokens": 1})
    watch = Watch(px.proc.pid, px.url)
    watch.start()
    box: dict[str, str] = {}
    worker = threading.Thread(target=lambda: box.setdefault("outcome", _safe(attack, px, watch)), daemon=True)
    worker.start()
    while worker.is_alive() and not watch.killed and time.monotonic() - t0 < limit_s:
        worker.join(0.2)
    watch.ended.set()
    finished = not worker.is_alive()
    if finished and not watch.killed:
        try:
            s0 = time.monotonic()
            ok = httpx.get(px.url + "/_slots/status", timeout=5).status_code == 200
            row.notes["status_s"] = round(time.monotonic() - s0, 3)
            row.check(ok and row.notes["status_s"] <= HEALTH_S, "status not answered within 1 s after the attack")
        except httpx.HTTPError:
            row.check(False, "status not answered after the attack")
    row.growth_mb = round(watch.finish(), 1)
    row.peak_mb = round(watch.peak, 1)
    row.health_max_s = round(watch.health_max, 3)
    row.health_late = watch.health_late
    row.alive = px.proc is not None and px.proc.poll() is None
    row.seconds = round(time.monotonic() - t0, 1)
    row.outcome = (f"killed: RSS grew past {KILL_MB:.0f} MB" if watch.killed else box.get("outcome", "") if finished
                   else f"stopped: still running after {limit_s:.0f} s")
    row.check(row.alive, "proxy died")
    row.check(row.growth_mb <= row.cap_mb, f"peak RSS growth {row.growth_mb} MB > cap {row.cap_mb:.0f} MB")
    row.check(row.health_late == 0, f"health: {row.health_late} answers late or failed, slowest "
                                    f"{row.health_max_s:.2f} s")
    row.check(row.outcome.startswith("ok"), row.outcome or "no outcome")
    if finished and row.alive:
        soak.stop(px)
    else:   # an attack may still be running inside: no graceful stop to wait for
        soak.sample(px)
        if px.proc is not None and px.proc.poll() is None:
            px.proc.kill()
            px.proc.wait(10)
    return row


def _safe(attack: Callable[[Any, Watch], str], px: Any, watch: Watch) -> str:
    try:
        return attack(px, watch)
    except Exception as e:
        return f"failed: {type(e).__name__}: {str(e)[:120]}"


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


def _chat(url: str, msgs: list[dict[str, str]], model: str = "m0", timeout: float = 60) -> int:
    body = {"model": model, "messages": msgs, "max_tokens": 1}
    try:
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout).status_code
    except httpx.HTTPError:
        return 0


def total_slots(soak: Any, sizes: Sizes) -> Attack:
    """A state file claiming 100,000,000 slots for a server that is down: status, then new sessions."""
    row = Attack("total_slots", "1", "state's slot count: 1024, sizes nothing")
    state = soak.dir("bounds-total")
    dead = f"http://127.0.0.1:{free_port()}"
    (state / state_file_name(dead)).write_text(json.dumps({"version": 1, "upstream": dead,
                                                           "total_slots": 100_000_000, "slots": {}, "sessions": {}}))
    os.chmod(state / state_file_name(dead), 0o600)

    def attack(px: Any, watch: Watch) -> str:
        chats, statuses = [], []
        for i in range(20):
            chats.append(_chat(px.url, [{"role": "system", "content": f"agent {i}"},
                                        {"role": "user", "content": "go"}], timeout=30))
            statuses.append(httpx.get(px.url + "/_slots/status", timeout=30).status_code)
        status = httpx.get(px.url + "/_slots/status", timeout=30).json()
        row.requests = len(chats) + len(statuses) + 1
        server = next(iter(status.get("servers") or [{}]), {})
        listed = len(server.get("slots") or [])
        row.notes |= {"status_slots": listed, "chat_codes": sorted(set(chats)), "status_codes": sorted(set(statuses))}
        if listed <= 1024 and set(statuses) == {200} and set(chats) == {502}:
            return f"ok: the status (200) lists {listed} slot(s); new sessions answered 502 (the server is down)"
        return f"wrong: the status lists {listed} slots, status {sorted(set(statuses))}, chats {sorted(set(chats))}"

    return measure(soak, row, dead, {"slots_state_dir": str(state)}, attack, 180)


def swap_models(soak: Any, sizes: Sizes) -> Attack:
    """1,000 requests naming 1,000 models llama-swap does not list."""
    row = Attack("swap_models", "2", "listed models only, 16 servers")
    swap = StandIn(models=("m0",))
    state = soak.dir("bounds-swap")

    def attack(px: Any, watch: Watch) -> str:
        with httpx.Client(timeout=30) as client:
            for i in range(sizes.swap_models):
                body = {"model": f"attack-{i:05d}", "max_tokens": 1,
                        "messages": [{"role": "system", "content": f"agent {i}"}, {"role": "user", "content": "go"}]}
                with contextlib.suppress(httpx.HTTPError):
                    client.post(px.url + "/v1/chat/completions", json=body)
        row.requests = sizes.swap_models + 1
        listed = _chat(px.url, [{"role": "system", "content": "real"}, {"role": "user", "content": "go"}])
        status = httpx.get(px.url + "/_slots/status", timeout=30)
        servers, files = len(status.json().get("servers") or []), len(list(state.iterdir()))
        watch.quiet.set()
        try:
            time.sleep(1)
            c0 = cpu_seconds(px.proc.pid)
            time.sleep(3)
            idle = round(100 * (cpu_seconds(px.proc.pid) - c0) / 3, 1)
        finally:
            watch.quiet.clear()
        row.notes |= {"listed_model": listed, "status_kb": round(len(status.content) / 1024, 1), "servers": servers,
                      "state_files": files, "idle_cpu_pct": idle}
        if listed == 200 and servers <= 8 and files <= 8 and idle < 5:
            return f"ok: the listed model answered, {servers} server(s), {files} state file(s), idle CPU {idle} %"
        return f"wrong: listed model {listed}, {servers} servers, {files} state files, idle CPU {idle} %"

    try:
        return measure(soak, row, swap.url, {"slots_state_dir": str(state), "slots_upstreams": [swap.url]}, attack,
                       300)
    finally:
        swap.close()


def fastpath_heads(soak: Any, sizes: Sizes) -> Attack:
    """60 new sessions, each with its own 8 MB system prompt (two turns, so the fast path learns and matches)."""
    row = Attack("fastpath_heads", "3", "fast path 32 MB; no prefix past 4 MB")
    server = StandIn()

    def attack(px: Any, watch: Watch) -> str:
        ok = 0
        for i in range(sizes.fast_sessions):
            if watch.ended.is_set():
                break
            system = f"session {i:03d} " + "x" * sizes.fast_prompt
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": "first question please"}]
            ok += _chat(px.url, msgs) == 200
            msgs += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "second"}]
            ok += _chat(px.url, msgs) == 200
            del system, msgs
        row.requests = 2 * sizes.fast_sessions
        row.notes["requests_ok"] = ok
        return f"{'ok' if ok == row.requests else 'wrong'}: {ok} of {row.requests} answered"

    try:
        return measure(soak, row, server.url, {"slots_state_dir": str(soak.dir("bounds-fast"))}, attack, 400)
    finally:
        server.close()


def attacks() -> list[Callable[[Any, Sizes], Attack | None]]:
    """Every attack of the class, in the issue's order."""
    from bench import memory_bounds_requests as requests
    from bench import memory_bounds_streams as streams

    return [total_slots, swap_models, fastpath_heads, *streams.ATTACKS, *requests.ATTACKS]


def attack_names() -> list[str]:
    from bench import memory_bounds_requests as requests
    from bench import memory_bounds_streams as streams

    return ["total_slots", "swap_models", "fastpath_heads", *streams.NAMES, *requests.NAMES]


def table(rows: list[Attack]) -> str:
    cols = ["attack", "item", "bound kept", "peak RSS growth MB", "cap MB", "alive", "slowest health s",
            "health > 1 s", "outcome", "failed checks"]
    data = [[a.name, a.item, a.keeps, f"{a.growth_mb:.0f}", f"{a.cap_mb:.0f}", "yes" if a.alive else "NO",
             f"{a.health_max_s:.2f}", a.health_late, a.outcome, len(a.failed)] for a in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *data, strict=True)]
    line = lambda xs: "| " + " | ".join(str(x).ljust(w) for x, w in zip(xs, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, data)])


def run(soak: Any, only: tuple[str, ...] = (), sizes: Sizes | None = None) -> BoundsRow:
    """Every attack (or those named in `only`), each on its own proxy; one summary row."""
    sizes = sizes or Sizes()
    named = [(name, lambda soak, a=attack: a(soak, sizes)) for name, attack in zip(attack_names(), attacks(),
                                                                                   strict=True)
             if not only or name in only]
    return run_attacks(soak, named)


def run_attacks(soak: Any, named: list[tuple[str, Callable[[Any], Attack | None]]], name: str | None = None
                ) -> BoundsRow:
    """Each attack of a class on the soak (None: skipped, redis-server missing; an exception: a failed check,
    not a lost table); its table printed and kept in the row's notes."""
    t0 = time.monotonic()
    rows: list[Attack] = []
    skipped: list[str] = []
    for attack_name, attack in named:
        try:
            got = attack(soak)
        except Exception as e:  # a crashed attack is a failed check, not a lost table
            got = Attack(attack_name, failed=[f"crashed: {type(e).__name__}: {e}"], outcome="crashed")
        if got is None:
            skipped.append(attack_name)
            continue
        rows.append(got)
    print(table(rows), flush=True)
    for skip in skipped:
        print(f"  {skip}: skipped (redis-server not installed)", flush=True)
    for a in rows:
        print(f"  {a.name}: {json.dumps(a.notes)}", flush=True)
    row = BoundsRow(faults=len(rows), survived=sum(a.alive and not a.failed for a in rows),
                    requests=sum(a.requests for a in rows), memory_mb=max((a.peak_mb for a in rows), default=0.0),
                    seconds=round(time.monotonic() - t0, 1), failed=[f"{a.name}: {f}" for a in rows for f in a.failed],
                    notes={"attacks": [asdict(a) for a in rows], "skipped": skipped, "table": table(rows)})
    return row if name is None else replace(row, name=name)


def run_alone(names: tuple[str, ...]) -> int:
    """The attacks `names` of this class alone, on a soak of their own: 1 when a check failed (a module's main)."""
    import shutil

    from bench.reliability import Soak

    soak = Soak(1)
    try:
        row = run(soak, names)
    finally:
        soak.close()
        shutil.rmtree(soak.root, ignore_errors=True)
    for f in row.failed:
        print("FAILED", f)
    return 1 if row.failed else 0


def main() -> int:
    """`python -m bench.memory_bounds [attack ...]`: this class alone."""
    import sys

    return run_alone(tuple(sys.argv[1:]))


if __name__ == "__main__":
    raise SystemExit(main())
