"""The server-number and per-request attacks of `make reliability`'s "memory bounds" class (reliability round 4:
items 1, 2, 8, 9, 11, 12, 16); `bench/memory_bounds.py` runs and measures them, each against a real mitmdump.

- props-slots (item 1): `/props` says `total_slots: 100000000`, `/slots` off. Before: RSS 101 MB -> 3,000 MB in
  47 s, the request dropped. Cap 100 MB; 20 new sessions pinned, the status lists at most 1,024 slots.
- infinite-speed (item 8): one answer with `prompt_per_second: 1e400`. Before: the status held NaN (not JSON)
  for good. The status must stay strict JSON, with a finite prefill speed, and the slot page must load.
- responses-items (item 2): three `/v1/responses` roots with an `input` of 1.5M `{}` (4.3 MB), then 40 more
  sessions. Before: +446 MB, the loop stalled 6.2-6.5 s each.
- body-items (item 9): a 20 MB body of 7M `{}` messages. Before: +582 MB, a 23.2 s stall.
- answer-nprobs (item 9): a 60 MB non-streamed answer of small objects (`n_probs`). Before: +517 MB, 2.9 s.
- marks-404 (item 11): 5,000 distinct `/v1/responses` requests answered 404 (each left a mark, never pruned;
  now at most 4,096). The marks are small: the figure is the growth, the count is `make test`'s.
- prompts-1mb (item 12): 512 distinct 1 MB `/completion` prompts remembered, then 10 more: the proxy's CPU
  seconds per request. Before: 0.37 s (488 MB hashed each).
- tool-input-deep (item 16): an Anthropic request whose `tool_use.input` is nested 900 deep. Before:
  RecursionError (sent untranslated). The proxy log must show no RecursionError.

The stub (`RequestStub`, a `bench.stub_llama.StubLlama`, run as a subprocess: `--serve`) answers without
parsing large bodies, so only the proxy pays for them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.memory_bounds import Attack, Sizes, Watch, cpu_seconds, measure
from bench.real.mitmdump import ROOT
from bench.stub_llama import StubLlama
from slotkeeper.launch.mitmdump import free_port

QUIET = {"slots_probe_interval": 0}
NPROBS_ITEM = b'{"id":1,"token":"a","logprob":-0.1,"bytes":[97]},'
OK_ANSWER = {"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],
             "timings": {"cache_n": 0, "prompt_n": 1, "prompt_per_second": 1000.0}}


@dataclass
class RequestStub(StubLlama):
    """A stub llama-server for these attacks: `kind` picks the fault (`infinite-speed`, `nprobs`, `404`);
    bodies over 1 MB are never parsed."""

    kind: str = ""
    mb: int = 60     # the `nprobs` answer's size

    async def _answer(self, method: str, target: str, headers: dict[str, str], body: bytes
                      ) -> tuple[int, str, bytes]:
        path = target.split("?", 1)[0]
        post = method == "POST" and not path.startswith("/slots")
        if post and self.kind == "404":
            return 404, "application/json", b'{"error":{"code":404,"type":"not_found_error"}}'
        if post and self.kind == "infinite-speed" and b"attack-speed" in body[:4096]:
            return 200, "application/json", (b'{"choices":[{"index":0,"finish_reason":"stop","message":{"role":'
                                              b'"assistant","content":"ok"}}],"timings":{"cache_n":0,"prompt_n":500,'
                                              b'"prompt_per_second":1e400}}')
        if post and self.kind == "nprobs" and b"attack-nprobs" in body[:4096]:
            n = (self.mb << 20) // len(NPROBS_ITEM)
            return 200, "application/json", (b'{"choices":[{"index":0,"finish_reason":"stop","message":{"content":'
                                              b'"ok"},"logprobs":{"content":[' + NPROBS_ITEM * n + b'{}]}}],'
                                              b'"timings":{"cache_n":0,"prompt_n":9,"prompt_per_second":1000.0}}')
        if post and (len(body) > 1 << 20 or path.endswith("/responses") or path == "/completion"):
            return 200, "application/json", json.dumps(OK_ANSWER).encode()
        return await super()._answer(method, target, headers, body)


def _full(sizes: Sizes) -> bool:
    """The issue's sizes (`make reliability`), else `Sizes.small()`'s (still past every bound)."""
    return sizes.json_mb >= Sizes().json_mb


def start_stub(soak: Any, kind: str = "", slots: int = 4, no_slots: bool = False, mb: int = 60) -> str:
    import subprocess

    port = free_port()
    argv = [sys.executable, "-m", "bench.memory_bounds_requests", "--serve", str(port), "--kind", kind,
            "--slots", str(slots), "--mb", str(mb)] + (["--no-slots"] if no_slots else [])
    proc = subprocess.Popen(argv, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    soak.procs.append(proc)
    assert proc.stdout is not None
    proc.stdout.readline()
    return f"http://127.0.0.1:{port}"


def _post(url: str, path: str, content: bytes, timeout: float = 120) -> tuple[int, float]:
    t0 = time.monotonic()
    try:
        r = httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=timeout)
        return r.status_code, time.monotonic() - t0
    except httpx.HTTPError:
        return 0, time.monotonic() - t0


def _chat(soak: Any, tag: str) -> bytes:
    return json.dumps({"messages": soak.messages(tag), "max_tokens": 1}).encode()


def props_slots(soak: Any, sizes: Sizes) -> Attack:
    row = Attack("props-slots", "r4-1", "/props slot count capped at 1024", cap_mb=100.0)
    upstream = start_stub(soak, slots=100_000_000, no_slots=True)

    def attack(px: Any, watch: Watch) -> str:
        pinned = 0
        for i in range(20):
            r = httpx.post(px.url + "/v1/chat/completions", content=_chat(soak, f"props {i}"), timeout=60,
                           headers={"content-type": "application/json"})
            pinned += r.status_code == 200 and isinstance(r.json().get("id_slot"), int)
        status = httpx.get(px.url + "/_slots/status", timeout=30).json()
        listed = len(next(iter(status.get("servers") or [{}]), {}).get("slots") or [])
        row.requests = 21
        row.notes |= {"pinned": pinned, "status_slots": listed}
        if pinned == 20 and listed <= 1024:
            return f"ok: 20 of 20 sessions served and pinned, the status lists {listed} slots"
        return f"wrong: {pinned} of 20 pinned, the status lists {listed} slots"

    return measure(soak, row, upstream, {**QUIET, "slots_state_dir": str(soak.dir("r4-props"))}, attack, 180)


def _strict(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def infinite_speed(soak: Any, sizes: Sizes) -> Attack:
    row = Attack("infinite-speed", "r4-8", "speeds finite at the door; status strict JSON")
    upstream = start_stub(soak, kind="infinite-speed")

    def attack(px: Any, watch: Watch) -> str:
        codes = [_post(px.url, "/v1/chat/completions", _chat(soak, "attack-speed"))[0]]
        codes += [_post(px.url, "/v1/chat/completions", _chat(soak, f"after {i}"))[0] for i in range(5)]
        status = httpx.get(px.url + "/_slots/status", timeout=30)
        page = httpx.get(px.url + "/_slots/", timeout=30).status_code
        row.requests = 8
        try:
            speed = next(iter(_strict(status.text).get("servers") or [{}]), {}).get("speeds", {}).get("prefill_tok_s")
        except ValueError as e:
            return f"wrong: the status is not JSON ({e})"
        row.notes |= {"codes": sorted(set(codes)), "prefill_tok_s": speed, "page": page}
        if set(codes) == {200} and status.status_code == 200 and page == 200 and speed is not None:
            return f"ok: the status is strict JSON, prefill {speed} tok/s, the page loads"
        return f"wrong: codes {sorted(set(codes))}, status {status.status_code}, page {page}, prefill {speed}"

    return measure(soak, row, upstream, {**QUIET, "slots_state_dir": str(soak.dir("r4-speed"))}, attack, 120)


def _stall_attack(row: Attack, sends: Callable[[Any], list[tuple[int, float]]]) -> Callable[[Any, Watch], str]:
    """An attack that sends big bodies: every request answered, and the health stalls the watch measures."""
    def attack(px: Any, watch: Watch) -> str:
        got = sends(px)
        row.requests = len(got)
        row.notes |= {"codes": sorted({c for c, _ in got}), "slowest_request_s": round(max(s for _, s in got), 2)}
        if all(c == 200 for c, _ in got):
            return f"ok: {len(got)} answered, slowest {row.notes['slowest_request_s']} s"
        return f"wrong: codes {row.notes['codes']}"
    return attack


def responses_items(soak: Any, sizes: Sizes) -> Attack:
    row = Attack("responses-items", "r4-2", "a body over 100k JSON items not parsed; 16 heads a conversation")
    upstream = start_stub(soak)

    def sends(px: Any) -> list[tuple[int, float]]:
        items = b",".join([b"{}"] * (1_500_000 if _full(sizes) else 200_000))
        got = [_post(px.url, "/v1/responses", b'{"model":"m","instructions":"root %d","input":[%s]}' % (i, items))
               for i in range(3)]
        return got + [_post(px.url, "/v1/chat/completions", _chat(soak, f"after {i}")) for i in range(40)]

    return measure(soak, row, upstream, {**QUIET, "slots_state_dir": str(soak.dir("r4-responses"))},
                   _stall_attack(row, sends), 300)


def body_items(soak: Any, sizes: Sizes) -> Attack:
    row = Attack("body-items", "r4-9", "a body over 100k JSON items not parsed")
    upstream = start_stub(soak)

    def sends(px: Any) -> list[tuple[int, float]]:
        body = b'{"model":"m","messages":[' + b",".join([b"{}"] * (7_000_000 if _full(sizes) else 200_000)) + b"]}"
        return [_post(px.url, "/v1/chat/completions", body), _post(px.url, "/v1/chat/completions", _chat(soak, "x"))]

    return measure(soak, row, upstream, {**QUIET, "slots_state_dir": str(soak.dir("r4-body"))},
                   _stall_attack(row, sends), 300)


def answer_nprobs(soak: Any, sizes: Sizes) -> Attack:
    row = Attack("answer-nprobs", "r4-9", "an answer past 1 MB read, not parsed")
    upstream = start_stub(soak, kind="nprobs", mb=60 if _full(sizes) else 8)

    def sends(px: Any) -> list[tuple[int, float]]:
        return [_post(px.url, "/v1/chat/completions", _chat(soak, "attack-nprobs")),
                _post(px.url, "/v1/chat/completions", _chat(soak, "after"))]

    return measure(soak, row, upstream, {**QUIET, "slots_state_dir": str(soak.dir("r4-nprobs"))},
                   _stall_attack(row, sends), 300)


def marks_404(soak: Any, sizes: Sizes) -> Attack:
    row = Attack("marks-404", "r4-11", "conversation marks: 4,096 at most")
    upstream = start_stub(soak, kind="404")
    n = 5_000 if _full(sizes) else 500

    def attack(px: Any, watch: Watch) -> str:
        codes: set[int] = set()
        with httpx.Client(timeout=30) as client:
            for i in range(n):
                body = {"model": "m", "instructions": f"agent {i}", "input": [{"role": "user", "content": "go"}]}
                with contextlib.suppress(httpx.HTTPError):
                    codes.add(client.post(px.url + "/v1/responses", json=body).status_code)
        row.requests = n
        row.notes["codes"] = sorted(codes)
        return f"ok: {n} answered 404 and passed on" if codes == {404} else f"wrong: codes {sorted(codes)}"

    return measure(soak, row, upstream, {**QUIET, "slots_state_dir": str(soak.dir("r4-marks"))}, attack, 600)


def prompts_1mb(soak: Any, sizes: Sizes) -> Attack:
    row = Attack("prompts-1mb", "r4-12", "a new prompt hashed once")
    upstream = start_stub(soak)
    remembered = 512 if _full(sizes) else 32

    def attack(px: Any, watch: Watch) -> str:
        text = "".join(f"line {i} of a long prompt\n" for i in range(40_000))[: 1 << 20]
        with httpx.Client(timeout=60) as client:
            for i in range(remembered):
                client.post(px.url + "/completion", json={"prompt": f"{i:04d} {text}"[: (1 << 20) - i],
                                                         "n_predict": 1})
            c0, t0 = cpu_seconds(px.proc.pid), time.monotonic()
            codes = {client.post(px.url + "/completion", json={"prompt": f"new {i} {text}", "n_predict": 1})
                     .status_code for i in range(10)}
            per = (cpu_seconds(px.proc.pid) - c0) / 10
        row.requests = remembered + 10
        row.notes |= {"remembered": remembered, "cpu_s_per_request": round(per, 3),
                      "wall_s_per_request": round((time.monotonic() - t0) / 10, 3)}
        if codes == {200} and per < 0.1:
            return f"ok: {per:.3f} s of CPU a request with {remembered} 1 MB prompts remembered"
        return f"wrong: codes {sorted(codes)}, {per:.3f} s of CPU a request"

    return measure(soak, row, upstream, {**QUIET, "slots_state_dir": str(soak.dir("r4-prompts"))}, attack, 400)


def tool_input_deep(soak: Any, sizes: Sizes) -> Attack:
    row = Attack("tool-input-deep", "r4-16", "nlohmann's dump without recursion")
    upstream = start_stub(soak)

    def attack(px: Any, watch: Watch) -> str:
        deep = '{"k":' * 900 + '{"n":1e15}' + "}" * 900
        body = ('{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"},{"role":"assistant",'
                '"content":[{"type":"tool_use","id":"t1","name":"f","input":' + deep + '}]},{"role":"user",'
                '"content":[{"type":"tool_result","tool_use_id":"t1","content":"ok"}]}]}').encode()
        code, _ = _post(px.url, "/v1/messages", body)
        row.requests = 1
        log = Path(px.log_path).read_text(errors="replace") if px.log_path else ""
        recursion = log.count("RecursionError")
        row.notes |= {"code": code, "recursion_errors_logged": recursion}
        if code == 200 and recursion == 0:
            return "ok: translated and answered, no RecursionError"
        return f"wrong: code {code}, {recursion} RecursionError(s) logged"

    return measure(soak, row, upstream, {**QUIET, "slots_state_dir": str(soak.dir("r4-deep"))}, attack, 120)


ATTACKS: list[Callable[[Any, Sizes], Attack | None]] = [
    props_slots, infinite_speed, responses_items, body_items, answer_nprobs, marks_404, prompts_1mb,
    tool_input_deep]
NAMES = ["props-slots", "infinite-speed", "responses-items", "body-items", "answer-nprobs", "marks-404",
         "prompts-1mb", "tool-input-deep"]


def main(argv: list[str] | None = None) -> int:
    """`--serve PORT --kind K`: the stub (internal); without it, these attacks alone."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", type=int)
    ap.add_argument("--kind", default="")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--no-slots", action="store_true")
    ap.add_argument("--mb", type=int, default=60)
    ap.add_argument("--only", nargs="*", default=[])
    a = ap.parse_args(argv)
    if a.serve:
        async def serve() -> None:
            stub = await RequestStub(port=a.serve, kind=a.kind, slots=a.slots, no_slots=a.no_slots,
                                     mb=a.mb).start()
            print(f"request stub listening on {stub.url}", flush=True)
            await asyncio.Event().wait()
        asyncio.run(serve())
        return 0
    from bench import memory_bounds

    return memory_bounds.run_alone(tuple(a.only or NAMES))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
