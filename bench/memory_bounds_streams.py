"""The stream and state attacks of `make reliability`'s "memory bounds" class (`bench/memory_bounds.py` runs
and measures them): one upstream stream or one stored value must not be able to take the proxy's memory
(issue 20, items 4, 5, 6, 15, 16).

Each runs against a real mitmdump process with the addon, in front of a stub llama-server
(`bench.stub_llama`, run here as a subprocess with the attack injected: `--serve`), and says what the client
got: the stream passed byte for byte; the translated client got an Anthropic error event or 502; a damaged
state was moved aside and new sessions pinned; no Redis lock left.

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

from bench.memory_bounds import Attack, Sizes, Watch, measure
from bench.real.mitmdump import ROOT
from bench.stub_llama import StubLlama
from slotkeeper.drivers.store_file import state_file_name
from slotkeeper.launch.mitmdump import free_port

MB = 1 << 20
PIECE = 1 << 20            # the stub writes its body in pieces this large
QUIET = {"slots_probe_interval": 0}


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


def start_stub(soak: Any, kind: str = "", mb: int = 200) -> str:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.memory_bounds_streams", "--serve", str(port),
                             "--kind", kind, "--mb", str(mb)], cwd=str(ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    soak.procs.append(proc)
    assert proc.stdout is not None
    proc.stdout.readline()
    return f"http://127.0.0.1:{port}"


def read_stream(url: str, body: dict[str, Any], stop: threading.Event, path: str = "/v1/chat/completions"
                ) -> tuple[int, bytes, bytes]:
    """POST a request and read the whole answer: (bytes received, its first 4 KB, its last 4 KB)."""
    n, head, tail = 0, b"", b""
    with httpx.stream("POST", url + path, json=body, timeout=httpx.Timeout(60, read=60)) as r:
        for chunk in r.iter_raw(1 << 20):
            if stop.is_set():
                break
            n += len(chunk)
            head = head if len(head) >= 4096 else (head + chunk)[:4096]
            tail = (tail + chunk)[-4096:]
    return n, head, tail


# ------------------------------------------------------------------------------------------- the attacks


def sse_attack(soak: Any, sizes: Sizes, kind: str) -> Attack:
    row = Attack(kind, "4", "observer: 4 MB line, 4 MB event")
    upstream = start_stub(soak, kind, sizes.stream_mb)
    start, _, end, n = attack_body(kind, sizes.stream_mb)
    want = len(start) + n + len(end)

    def attack(px: Any, watch: Watch) -> str:
        row.requests = 1
        got, _, tail = read_stream(px.url, {"messages": soak.messages(f"attack-{kind}"), "stream": True},
                                   watch.ended)
        return "ok: passed byte for byte" if got == want and tail.endswith(b"[DONE]\n\n") else \
            f"wrong: {got} of {want} bytes"

    return measure(soak, row, upstream, {**QUIET, "slots_state_dir": str(soak.dir(f"mb-{kind}"))}, attack)


def anthropic_attack(soak: Any, sizes: Sizes) -> Attack:
    kind = "anthropic-long-line"
    row = Attack(kind, "5", "converter: one 4 MB line")
    upstream = start_stub(soak, kind, sizes.stream_mb)

    def attack(px: Any, watch: Watch) -> str:
        row.requests = 1
        body = {"model": "m", "max_tokens": 8, "stream": True,
                "messages": [{"role": "user", "content": f"{soak.sentinel} attack-anthropic"}]}
        _, head, tail = read_stream(px.url, body, watch.ended, "/v1/messages")
        if b"event: message_start" in head and tail.endswith(b"\n\n") and b"event: error" in tail \
                and b"message_stop" not in tail:
            return "ok: an Anthropic error event"
        return f"wrong: ends {tail[-160:]!r}"

    return measure(soak, row, upstream, {**QUIET, "slots_state_dir": str(soak.dir("mb-anthropic"))}, attack)


def json_attack(soak: Any, sizes: Sizes, translated: bool) -> Attack:
    kind = "json-large"
    row = Attack(f"{kind}-{'anthropic' if translated else 'chat'}", "16", "not buffered past slots_max_body_mb")
    upstream = start_stub(soak, kind, sizes.json_mb)
    start, _, end, n = attack_body(kind, sizes.json_mb)

    def attack(px: Any, watch: Watch) -> str:
        row.requests = 1
        if translated:
            body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "attack-json"}]}
            got, head, _ = read_stream(px.url, body, watch.ended, "/v1/messages")
            return "ok: an Anthropic error (502)" if b'"type":"error"' in head and got < 4096 else \
                f"wrong: {got} bytes, {head[:120]!r}"
        got, _, tail = read_stream(px.url, {"messages": soak.messages("attack-json")}, watch.ended)
        want = len(start) + n + len(end)
        return "ok: passed byte for byte" if got == want and tail.endswith(end) else f"wrong: {got} of {want} bytes"

    return measure(soak, row, upstream, {**QUIET, "slots_state_dir": str(soak.dir(f"mb-json-{translated}"))},
                   attack, 300)


def new_sessions(soak: Any, px: Any, tag: str, n: int = 5) -> tuple[bool, float]:
    """n new sessions through the proxy: all pinned, and the slowest one's seconds."""
    slowest, pinned = 0.0, True
    for i in range(n):
        t0 = time.monotonic()
        r = httpx.post(px.url + "/v1/chat/completions", timeout=60,
                       json={"messages": soak.messages(f"{tag} {i}"), "max_tokens": 1})
        slowest = max(slowest, time.monotonic() - t0)
        pinned = pinned and r.status_code == 200 and isinstance(r.json().get("id_slot"), int)
    return pinned, slowest


def state_attack(soak: Any, sizes: Sizes, kind: str) -> Attack:
    item, keeps = ("6", "parse: corrupt is corrupt") if kind == "state-deep" else ("15", "read: 64 MB")
    row = Attack(kind, item, keeps)
    upstream = start_stub(soak)
    state = soak.dir(f"mb-{kind}")
    path = state / state_file_name(upstream)

    def attack(px: Any, watch: Watch) -> str:
        with open(path, "wb") as f:   # under the running proxy: its next new session reads it
            if kind == "state-deep":
                f.write(b'{"sessions":' + b"[" * sizes.state_depth + b"]" * sizes.state_depth + b"}")
            else:
                f.truncate(sizes.sparse_bytes)
        pinned, slowest = new_sessions(soak, px, kind)
        row.requests = 5
        status = httpx.get(px.url + "/_slots/status", timeout=10).status_code
        aside = any(".corrupt-" in p.name for p in state.iterdir())
        for p in state.iterdir():
            if ".corrupt-" in p.name:
                p.unlink()   # 1 GB of sparse file: not kept for the sentinel scan
        if pinned and status == 200 and aside and slowest < 2:
            return f"ok: moved aside, new sessions pinned (slowest {slowest:.2f} s)"
        return f"wrong: pinned={pinned} status={status} moved_aside={aside} slowest={slowest:.2f} s"

    return measure(soak, row, upstream, {**QUIET, "slots_state_dir": str(state)}, attack, 120)


def stuck_locks(r: Any, wait: float = 3.0) -> list[bytes]:
    """The Redis locks still held, by the same holder, `wait` seconds after a first look. A transaction holds
    its lock for milliseconds, and the proxy's background flush takes it again every `slots_flush_interval`: a
    lock seen once is no leak, one whose token (unique to each acquisition) stays is."""
    first = {k: r.get(k) for k in r.keys("*:lock")}
    deadline = time.monotonic() + wait
    while first and time.monotonic() < deadline:
        time.sleep(0.1)
        first = {k: v for k, v in first.items() if v is not None and r.get(k) == v}
    return list(first)


def redis_attack(soak: Any, sizes: Sizes) -> Attack | None:
    if shutil.which("redis-server") is None:
        return None
    import redis

    from bench.real.redis_server import RedisServer
    from slotkeeper.drivers.store_redis import state_key

    row = Attack("redis-deep", "6", "parse: corrupt, lock released")
    upstream = start_stub(soak)
    with RedisServer() as server:
        def attack(px: Any, watch: Watch) -> str:
            r = redis.Redis(port=server.port)
            keys = [k for k in r.keys("*") if not k.endswith(b":lock") and b"state" in k] or [state_key(upstream)]
            for key in keys:
                r.set(key, b"[" * sizes.redis_depth + b"]" * sizes.redis_depth)
            pinned, slowest = new_sessions(soak, px, "redis")
            row.requests = 5
            status = httpx.get(px.url + "/_slots/status", timeout=10).status_code
            held = stuck_locks(r)
            if pinned and status == 200 and slowest < 2 and not held:
                return f"ok: new sessions pinned (slowest {slowest:.2f} s), no lock left"
            return f"wrong: pinned={pinned} status={status} slowest={slowest:.2f} s locks={len(held)}"

        return measure(soak, row, upstream, {**QUIET, "slots_state_dir": str(soak.dir("mb-redis")),
                                             "slots_state_url": server.url}, attack, 120)


ATTACKS: list[Callable[[Any, Sizes], Attack | None]] = [
    lambda soak, sizes: sse_attack(soak, sizes, "sse-no-blank"),
    lambda soak, sizes: sse_attack(soak, sizes, "sse-long-line"),
    anthropic_attack,
    lambda soak, sizes: state_attack(soak, sizes, "state-deep"),
    redis_attack,
    lambda soak, sizes: state_attack(soak, sizes, "state-sparse"),
    lambda soak, sizes: json_attack(soak, sizes, translated=False),
    lambda soak, sizes: json_attack(soak, sizes, translated=True)]
NAMES = ["sse-no-blank", "sse-long-line", "anthropic-long-line", "state-deep", "redis-deep", "state-sparse",
         "json-large-chat", "json-large-anthropic"]


def main(argv: list[str] | None = None) -> int:
    """`--serve PORT --kind K --mb N`: the attack stub (internal); without it, these attacks alone."""
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
    from bench import memory_bounds

    return memory_bounds.run_alone(tuple(a.only or NAMES))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
