"""`make reliability`, class "memory bounds" (streams and state): one upstream stream or one stored value must
not be able to take the proxy's memory (issue 20, items 4, 5, 6, 15).

Each attack runs against a real mitmdump process with the addon, in front of a stub llama-server
(`bench.stub_llama`, run here as a subprocess with the attack injected: `--serve`), and measures:
- the proxy's peak RSS growth over the attack (VmHWM after minus VmHWM before, on a proxy of its own), next
  to the cap the code keeps (what it may hold) and the target, 300 MB;
- `GET /_slots/health`, asked every 100 ms throughout with a 1 s timeout: the slowest answer, and how many
  did not come within 1 s;
- that the proxy is alive afterwards and did the right thing (the stream passed byte for byte; the
  translated client got an Anthropic error event; a damaged state was moved aside and new sessions pinned).

A safety stop ends an attack whose growth passes 2 GB or that runs past its time limit (so the numbers
of the code before the fix can be taken on a shared machine without the kernel's OOM killer).

Attacks: `sse-no-blank` (item 4: 200 MB of `data: {}` lines, no blank line), `sse-long-line` (item 4: one
200 MB line), `anthropic-long-line` (item 5: a translated stream with one 200 MB line), `state-deep` (item 6:
a state file 200k levels deep), `redis-deep` (item 6: a Redis key 100k levels deep; skipped without
redis-server), `state-sparse` (item 15: a 1 GB sparse state file), `json-large-chat` and
`json-large-anthropic` (item 16: a 1 GB answer that is not a stream, plain and translated).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.reliability import Row, Soak, alive, timed, vm_hwm
from bench.stub_llama import StubLlama
from drivers.store_file import state_file_name
from launch.llama_server import free_port
from launch.mitmdump import ROOT

TARGET_MB = 300.0
STOP_MB = 2048.0           # the safety stop: an attack that grows the proxy this much is ended
MB = 1 << 20
PIECE = 1 << 20            # the stub writes its body in pieces this large


# ------------------------------------------------------------------------------------------- the stub


def sse_first_result() -> bytes:
    """The first partial of a chat stream as llama-server sends it with timings_per_token."""
    base = {"id": "chatcmpl-mb", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    role = {**base, "choices": [{"index": 0, "finish_reason": None, "delta": {"role": "assistant", "content": None}}]}
    tok = {**base, "choices": [{"index": 0, "finish_reason": None, "delta": {"content": "ok"}}],
           "timings": {"cache_n": 0, "prompt_n": 9, "predicted_n": 1}}
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in (role, tok))


SSE_END = (b'data: {"choices":[{"index":0,"finish_reason":"stop","delta":{}}],"timings":{"cache_n":0,'
           b'"prompt_n":9,"predicted_n":2}}\n\ndata: [DONE]\n\n')


def attack_body(kind: str, mb: int) -> tuple[bytes, Iterator[bytes], bytes, int]:
    """(head, pieces of the middle, tail, total length) of the streamed answer of `kind`."""
    size = mb * MB
    if kind == "sse-no-blank":
        line = b"data: {}\n"
        piece = line * (PIECE // len(line))
        n = size // len(piece)
        return sse_first_result(), (piece for _ in range(n)), SSE_END, n * len(piece)
    if kind in ("sse-long-line", "anthropic-long-line"):
        head = sse_first_result() + b'data: {"choices":[{"index":0,"delta":{"content":"'
        tail = b'"}}]}\n\n' + SSE_END
        piece = b"x" * PIECE
        n = size // PIECE
        return head, (piece for _ in range(n)), tail, n * PIECE
    if kind == "json-large":
        head = b'{"choices":[{"index":0,"finish_reason":"stop","message":{"role":"assistant","content":"'
        tail = b'"}}],"timings":{"cache_n":0,"prompt_n":9}}'
        piece = b"x" * PIECE
        n = size // PIECE
        return head, (piece for _ in range(n)), tail, n * PIECE
    raise ValueError(kind)


@dataclass
class AttackStub(StubLlama):
    """The stub llama-server whose streamed chat answers are the attack `kind` of `mb` megabytes."""

    kind: str = ""
    mb: int = 200
    sent: list[int] = field(default_factory=list)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
                body = await reader.readexactly(int(headers.get("content-length") or 0))
                if method == "POST" and self.kind and b"attack-" in body:  # the warm-up is answered as ever
                    start, middle, end, n = attack_body(self.kind, self.mb)
                    ctype = "application/json" if self.kind == "json-large" else "text/event-stream"
                    writer.write((f"HTTP/1.1 200 OK\r\nServer: llama.cpp\r\nContent-Type: {ctype}\r\n"
                                  f"Content-Length: {len(start) + n + len(end)}\r\n\r\n").encode() + start)
                    for piece in middle:
                        writer.write(piece)
                        await writer.drain()
                    writer.write(end)
                    await writer.drain()
                    continue
                status, ctype, payload = await self._answer(method, target, headers, body)
                writer.write((f"HTTP/1.1 {status} X\r\nServer: llama.cpp\r\nContent-Type: {ctype}\r\n"
                              f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, asyncio.LimitOverrunError,
                asyncio.CancelledError):
            pass
        finally:
            writer.close()


def start_stub(soak: Soak, kind: str = "", mb: int = 200) -> str:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.memory_bounds_streams", "--serve", str(port),
                             "--kind", kind, "--mb", str(mb)], cwd=str(ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    soak.procs.append(proc)
    assert proc.stdout is not None
    proc.stdout.readline()
    return f"http://127.0.0.1:{port}"


# ------------------------------------------------------------------------------------------- measuring


class Health(threading.Thread):
    """Asks `/_slots/health` every 100 ms (1 s timeout) and watches the proxy's peak RSS for the safety stop."""

    def __init__(self, url: str, pid: int, base_mb: float) -> None:
        super().__init__(daemon=True)
        self.url, self.pid, self.base_mb = url, pid, base_mb
        self.slowest = 0.0
        self.late = 0
        self.asked = 0
        self.stopped = threading.Event()
        self.over = threading.Event()   # the safety stop: growth past STOP_MB

    def run(self) -> None:
        with httpx.Client(timeout=1.0) as client:
            while not self.stopped.is_set():
                t0 = time.monotonic()
                try:
                    ok = client.get(self.url + "/_slots/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                took = time.monotonic() - t0
                self.asked += 1
                self.slowest = max(self.slowest, took)
                self.late += 0 if ok and took <= 1.0 else 1
                if vm_hwm(self.pid) - self.base_mb > STOP_MB:
                    self.over.set()
                self.stopped.wait(max(0.0, 0.1 - took))


@dataclass
class Result:
    attack: str
    item: str
    cap: str
    growth_mb: float = 0.0
    peak_mb: float = 0.0        # the proxy's VmHWM (the soak table's "memory peak" column)
    slowest_health_s: float = 0.0
    health_late: int = 0
    alive: bool = False
    outcome: str = ""
    ok: bool = False
    seconds: float = 0.0


def measured(soak: Soak, res: Result, upstream: str, opts: dict[str, Any], attack: Callable[[Any, Health], str],
             limit_s: float) -> Result:
    """Start a proxy of its own, warm it with one request, run `attack`, and fill `res` in."""
    px = soak.proxy(upstream, {"slots_probe_interval": 0, **opts}, f"mb-{res.attack}")
    assert px.proc is not None
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(px.url + "/v1/chat/completions", json={"messages": soak.messages("warm"), "max_tokens": 1},
                   timeout=30)
    base = vm_hwm(px.proc.pid)
    health = Health(px.url, px.proc.pid, base)
    health.start()
    t0 = time.monotonic()
    box: dict[str, str] = {}
    worker = threading.Thread(target=lambda: box.setdefault("outcome", _safe(attack, px, health)), daemon=True)
    worker.start()
    while worker.is_alive() and not health.over.is_set() and time.monotonic() - t0 < limit_s:
        worker.join(0.2)
    res.seconds = round(time.monotonic() - t0, 1)
    health.stopped.set()
    health.join(3)
    res.peak_mb = round(vm_hwm(px.proc.pid), 1)
    res.growth_mb = round(res.peak_mb - base, 1)
    res.slowest_health_s = round(health.slowest, 3)
    res.health_late = health.late
    res.alive = alive(px)
    if health.over.is_set():
        res.outcome = f"stopped: growth past {STOP_MB:.0f} MB"
    elif worker.is_alive():
        res.outcome = f"stopped: still running after {limit_s:.0f} s"
    else:
        res.outcome = box.get("outcome", "")
    res.ok = (res.alive and res.growth_mb <= TARGET_MB and res.health_late == 0 and not worker.is_alive()
              and not health.over.is_set() and res.outcome.startswith("ok"))
    soak.sample(px)
    if px.proc.poll() is None:
        px.proc.kill()   # an attack may still be running inside: no graceful stop to wait for
        px.proc.wait(10)
    return res


def _safe(attack: Callable[[Any, Health], str], px: Any, health: Health) -> str:
    try:
        return attack(px, health)
    except Exception as e:
        return f"failed: {type(e).__name__}: {str(e)[:120]}"


def read_stream(url: str, body: dict[str, Any], health: Health, path: str = "/v1/chat/completions"
                ) -> tuple[int, bytes, bytes]:
    """POST a streamed request and read the whole answer: (bytes received, its first 4 KB, its last 4 KB)."""
    n, head, tail = 0, b"", b""
    with httpx.stream("POST", url + path, json=body, timeout=httpx.Timeout(60, read=60)) as r:
        for chunk in r.iter_raw(1 << 20):
            if health.over.is_set():
                break
            n += len(chunk)
            head = head if len(head) >= 4096 else (head + chunk)[:4096]
            tail = (tail + chunk)[-4096:]
    return n, head, tail


# ------------------------------------------------------------------------------------------- the attacks


def sse_attack(soak: Soak, kind: str, mb: int) -> Result:
    res = Result(kind, "4", "observer: 4 MB line + 4 MB event")
    upstream = start_stub(soak, kind, mb)
    start, _, end, n = attack_body(kind, mb)
    want = len(start) + n + len(end)

    def attack(px: Any, health: Health) -> str:
        got, _, tail = read_stream(px.url, {"messages": soak.messages(f"attack-{kind}"), "stream": True}, health)
        return "ok: passed byte for byte" if got == want and tail.endswith(b"[DONE]\n\n") else \
            f"wrong: {got} of {want} bytes"

    return measured(soak, res, upstream, {"slots_state_dir": str(soak.dir(f"mb-{kind}"))}, attack, 240)


def anthropic_attack(soak: Soak, mb: int) -> Result:
    kind = "anthropic-long-line"
    res = Result(kind, "5", "converter: one 4 MB line")
    upstream = start_stub(soak, kind, mb)

    def attack(px: Any, health: Health) -> str:
        body = {"model": "m", "max_tokens": 8, "stream": True,
                "messages": [{"role": "user", "content": f"{soak.sentinel} attack-anthropic"}]}
        _, head, tail = read_stream(px.url, body, health, "/v1/messages")
        if b"event: message_start" in head and tail.endswith(b"\n\n") and b"event: error" in tail \
                and b"message_stop" not in tail:
            return "ok: an Anthropic error event"
        return f"wrong: ends {tail[-160:]!r}"

    return measured(soak, res, upstream, {"slots_state_dir": str(soak.dir("mb-anthropic"))}, attack, 240)


def json_attack(soak: Soak, mb: int, translated: bool) -> Result:
    kind = "json-large"
    res = Result(f"{kind}-{'anthropic' if translated else 'chat'}", "16", "not buffered past slots_max_body_mb")
    upstream = start_stub(soak, kind, mb)
    start, _, end, n = attack_body(kind, mb)

    def attack(px: Any, health: Health) -> str:
        if translated:
            body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "attack-json"}]}
            got, head, _ = read_stream(px.url, body, health, "/v1/messages")
            return "ok: an Anthropic error (502)" if b'"type":"error"' in head and got < 4096 else \
                f"wrong: {got} bytes, {head[:120]!r}"
        got, _, tail = read_stream(px.url, {"messages": soak.messages("attack-json")}, health)
        want = len(start) + n + len(end)
        return "ok: passed byte for byte" if got == want and tail.endswith(end) else f"wrong: {got} of {want} bytes"

    return measured(soak, res, upstream, {"slots_state_dir": str(soak.dir(f"mb-json-{translated}"))}, attack, 300)


def new_sessions(soak: Soak, px: Any, tag: str, n: int = 5) -> tuple[bool, float]:
    """n new sessions through the proxy: all pinned, and the slowest one's seconds."""
    slowest, pinned = 0.0, True
    for i in range(n):
        t0 = time.monotonic()
        r = httpx.post(px.url + "/v1/chat/completions", timeout=60,
                       json={"messages": soak.messages(f"{tag} {i}"), "max_tokens": 1})
        slowest = max(slowest, time.monotonic() - t0)
        pinned = pinned and r.status_code == 200 and isinstance(r.json().get("id_slot"), int)
    return pinned, slowest


def state_attack(soak: Soak, kind: str) -> Result:
    item, cap = ("6", "parse: corrupt") if kind == "state-deep" else ("15", "read: 64 MB")
    res = Result(kind, item, cap)
    upstream = start_stub(soak)
    state = soak.dir(f"mb-{kind}")
    path = state / state_file_name(upstream)

    def attack(px: Any, health: Health) -> str:
        with open(path, "wb") as f:   # under the running proxy: its next new session reads it
            if kind == "state-deep":
                f.write(b'{"sessions":' + b"[" * 200_000 + b"]" * 200_000 + b"}")
            else:
                f.truncate(1 << 30)
        pinned, slowest = new_sessions(soak, px, kind)
        status = httpx.get(px.url + "/_slots/status", timeout=10).status_code
        aside = any(".corrupt-" in p.name for p in state.iterdir())
        for p in state.iterdir():
            if ".corrupt-" in p.name:
                p.unlink()   # 1 GB of sparse file: not kept for the sentinel scan
        if pinned and status == 200 and aside and slowest < 2:
            return f"ok: moved aside, new sessions pinned (slowest {slowest:.2f} s)"
        return f"wrong: pinned={pinned} status={status} moved_aside={aside} slowest={slowest:.2f} s"

    return measured(soak, res, upstream, {"slots_state_dir": str(state)}, attack, 120)


def redis_attack(soak: Soak) -> Result | None:
    if shutil.which("redis-server") is None:
        return None
    import redis

    from drivers.store_redis import state_key
    from launch.redis_server import RedisServer

    res = Result("redis-deep", "6", "parse: corrupt, lock released")
    upstream = start_stub(soak)
    with RedisServer() as server:
        def attack(px: Any, health: Health) -> str:
            r = redis.Redis(port=server.port)
            keys = [k for k in r.keys("*") if not k.endswith(b":lock") and b"state" in k] or [state_key(upstream)]
            for key in keys:
                r.set(key, b"[" * 100_000 + b"]" * 100_000)
            pinned, slowest = new_sessions(soak, px, "redis")
            status = httpx.get(px.url + "/_slots/status", timeout=10).status_code
            held = [k for k in r.keys("*:lock")]
            if pinned and status == 200 and slowest < 2 and not held:
                return f"ok: new sessions pinned (slowest {slowest:.2f} s), no lock left"
            return f"wrong: pinned={pinned} status={status} slowest={slowest:.2f} s locks={len(held)}"

        return measured(soak, res, upstream, {"slots_state_dir": str(soak.dir("mb-redis")),
                                              "slots_state_url": server.url}, attack, 120)


# ------------------------------------------------------------------------------------------- the class


def table(results: list[Result]) -> str:
    cols = ["attack", "item", "cap kept", "peak RSS growth MB", "target MB", "slowest health s", "health > 1 s",
            "alive", "outcome"]
    data = [[r.attack, r.item, r.cap, f"{r.growth_mb:.0f}", f"{TARGET_MB:.0f}", f"{r.slowest_health_s:.2f}",
             r.health_late, "yes" if r.alive else "NO", r.outcome] for r in results]
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *data, strict=True)]
    line = lambda xs: "| " + " | ".join(str(x).ljust(w) for x, w in zip(xs, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, data)])


def run(soak: Soak, mb: int = 200, only: list[str] | None = None) -> Row:
    """The class's row of the reliability table (its memory peak: the highest VmHWM of the attacked proxies);
    the per-attack table, with each attack's growth next to its cap, is printed and kept in the row's notes."""
    row = Row("memory bounds: streams, state")
    results: list[Result] = []
    attacks: list[tuple[str, Callable[[], Result | None]]] = [
        ("sse-no-blank", lambda: sse_attack(soak, "sse-no-blank", mb)),
        ("sse-long-line", lambda: sse_attack(soak, "sse-long-line", mb)),
        ("anthropic-long-line", lambda: anthropic_attack(soak, mb)),
        ("state-deep", lambda: state_attack(soak, "state-deep")),
        ("redis-deep", lambda: redis_attack(soak)),
        ("state-sparse", lambda: state_attack(soak, "state-sparse")),
        ("json-large-chat", lambda: json_attack(soak, 1024, translated=False)),
        ("json-large-anthropic", lambda: json_attack(soak, 1024, translated=True))]
    with timed(row):
        for name, attack in attacks:
            if only and name not in only:
                continue
            res = attack()
            if res is None:
                row.notes[name] = "skipped: redis-server not installed"
                continue
            results.append(res)
            row.faults += 1
            row.requests += 1
            row.survived += res.alive
            row.memory_mb = max(row.memory_mb, res.peak_mb)
            row.check(res.ok, f"{res.attack}: growth {res.growth_mb:.0f} MB (target {TARGET_MB:.0f}), slowest "
                              f"health {res.slowest_health_s:.2f} s, {res.health_late} late, alive={res.alive}, "
                              f"{res.outcome}")
        row.notes["attacks"] = [vars(r) for r in results]
        row.notes["table"] = table(results)
        print(table(results), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", type=int, help="run the attack stub on this port (internal)")
    ap.add_argument("--kind", default="")
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--only", nargs="*", default=[])
    a = ap.parse_args(argv)
    if a.serve:
        async def serve() -> None:
            stub = await AttackStub(port=a.serve, kind=a.kind, mb=a.mb).start()
            print(f"attack stub listening on {stub.url}", flush=True)
            await asyncio.Event().wait()
        asyncio.run(serve())
        return 0
    soak = Soak(1)
    try:
        row = run(soak, a.mb, a.only)
    finally:
        soak.close()
        shutil.rmtree(soak.root, ignore_errors=True)
    for f in row.failed:
        print("FAILED", f)
    return 1 if row.failed else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
