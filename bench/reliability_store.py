"""The soak's "store & doors" class (`make reliability`, or `python -m bench.reliability_store`): a hostile
shared store, and the proxy's own doors (its API's host check, a client's key, an IPv6 server, the console
script), each against real processes: a real redis-server, real mitmdump proxies, the stub llama-server.

One row per attack, measured as the memory-bounds class measures (`bench.memory_bounds.measure`: the proxy's
peak RSS growth during the attack next to its cap, health every 100 ms within 1 s, alive after), with the
attack's own figure in its outcome:

- redis-200mb: a 200 MB value in the state key (made inside redis-server), then new sessions: refused by its
  size (the script answers the size, never the value), written over; cap 50 MB.
- redis-600k: 20 real sessions, then a 31 MB document of 600,000 fake sessions stamped `last_used: 1e300`,
  then new sessions: no real session evicted, no fake kept; cap 50 MB.
- redis-stamps: 12 real sessions; fakes stamped 1e300, Infinity and an hour ahead and a page record of
  `bytes: -2**62` added next to them (under every size cap): no real session evicted, no fake kept.
- redis-lock: the state's lock key set without expiry: new sessions' slowest placement, store reachable.
- host-rebinding: `/_slots/` and `/_slots/status` asked with `Host: attacker.example` from loopback: 403.
- client-keys: three clients with their own keys (one wrong) in front of an `--api-key` stub: no call the
  proxy makes itself carries a client's key.
- ipv6: `--mode reverse:http://[::1]:PORT`: the proxy starts and pins.
- console-script: `--listen` with a second address, `--web-port 0`, a save dir a shell would split: refused or
  quoted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

from bench.memory_bounds import Attack, BoundsRow, StandIn, Watch, measure, run_attacks
from bench.real.mitmdump import ROOT
from bench.stub_llama import StubLlama
from slotkeeper.launch.mitmdump import free_port

REDIS_CAP_MB = 50.0  # the acceptance figure: what a hostile value may cost the proxy
QUIET = {"slots_log_requests": "off"}


def _chat(url: str, tag: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": "m0", "max_tokens": 1, "messages": [{"role": "system", "content": f"agent {tag}"},
                                                         {"role": "user", "content": "go"}]}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=60)


def _sessions(px: Any, tag: str, n: int) -> tuple[int, float]:
    """`n` new sessions: how many were pinned, and the slowest."""
    pinned, slowest = 0, 0.0
    for i in range(n):
        t0 = time.monotonic()
        r = _chat(px.url, f"{tag} {i}")
        slowest = max(slowest, time.monotonic() - t0)
        pinned += r.status_code == 200 and r.headers.get("x-slot-id") is not None
    return pinned, slowest


def _doc(r: Any, key: str) -> dict[str, Any]:
    raw = r.get(key) if r.type(key) == b"string" and r.strlen(key) < 8 << 20 else None
    return json.loads(raw) if raw else {}


def _redis_attack(soak: Any, name: str, keeps: str, plant: Any, real: int, opts: dict[str, Any] | None = None
                  ) -> Attack | None:
    """One attack on the state key of a proxy placing sessions on `StandIn` through a real redis-server: `real`
    sessions placed first, then `plant(redis, key)`, then five new sessions; every real session still there."""
    if shutil.which("redis-server") is None:
        return None
    import redis

    from bench.real.redis_server import RedisServer
    from slotkeeper.drivers.store_redis import state_key

    row = Attack(name, "5", keeps, cap_mb=REDIS_CAP_MB)
    upstream = StandIn()
    try:
        with RedisServer() as server:
            r = redis.Redis(port=server.port)
            key = state_key(upstream.url)

            def attack(px: Any, watch: Watch) -> str:
                _sessions(px, f"{name}-real", real)
                time.sleep(1.0)  # the touches flushed
                mine = set(_doc(r, key).get("sessions", {}))
                planted = plant(r, key)
                pinned, slowest = _sessions(px, f"{name}-new", 5)
                row.requests = real + 5
                after = _doc(r, key).get("sessions", {})
                lost = mine - set(after)
                fakes = [k for k in after if k.startswith("fake")]
                row.notes |= {"planted": planted, "real": len(mine), "lost": len(lost), "fakes_kept": len(fakes),
                              "slowest_s": round(slowest, 2)}
                if pinned == 5 and not lost and not fakes and slowest < 3:
                    return (f"ok: {planted}; {len(mine)} real sessions all kept, no fake kept, 5 new pinned "
                            f"(slowest {slowest:.2f} s)")
                return f"wrong: {planted}; pinned {pinned}/5, lost {len(lost)}, fakes kept {len(fakes)}"

            return measure(soak, row, upstream.url, {**QUIET, "slots_state_dir": str(soak.dir(f"st-{name}")),
                                                     "slots_state_url": server.url, **(opts or {})}, attack, 180)
    finally:
        upstream.close()


def redis_200mb(soak: Any) -> Attack | None:
    def plant(r: Any, key: str) -> str:
        r.setrange(key, 200 * (1 << 20) - 1, b"x")
        return "200 MB value"
    return _redis_attack(soak, "redis-200mb", "read by size: 1 MB", plant, 10)


def redis_600k(soak: Any) -> Attack | None:
    def plant(r: Any, key: str) -> str:
        r.set(key, '{"version":1,"sessions":{')
        for start in range(0, 600_000, 20_000):
            r.append(key, ",".join(f'"fake{i}":{{"slot":0,"last_used":1e300,"requests":1}}'
                                   for i in range(start, start + 20_000)) + ("," if start < 580_000 else "}}"))
        return f"{r.strlen(key) / 1e6:.0f} MB of 600,000 fake sessions"
    return _redis_attack(soak, "redis-600k", "read by size: 1 MB", plant, 20)


def redis_stamps(soak: Any) -> Attack | None:
    def plant(r: Any, key: str) -> str:
        doc = json.loads(r.get(key))
        now = time.time()
        for i in range(600):
            doc["sessions"][f"fake{i}"] = {"slot": i % 4, "last_used": (1e300, float("inf"), now + 3600)[i % 3],
                                           "requests": 1}
        doc["pages"]["fakepage"] = {"file": "page-99999999999999999999.bin", "n_tokens": 1, "saved": now,
                                    "bytes": -2 ** 62, "model": "m"}
        r.set(key, json.dumps(doc))
        return "600 fakes from the future, a page of -2**62 bytes"
    return _redis_attack(soak, "redis-stamps", "stamps ≤ now + 10 min, sizes ≥ 0", plant, 10,
                         {"slots_state_max_sessions": 16})


def redis_lock(soak: Any) -> Attack | None:
    def plant(r: Any, key: str) -> str:
        r.set(key + ":lock", "squat")
        return "lock key squatted without expiry"
    return _redis_attack(soak, "redis-lock", "lock: ours or taken over", plant, 4)


def host_rebinding(soak: Any) -> Attack:
    row = Attack("host-rebinding", "15", "Host: IP, localhost, listen host")
    upstream = StandIn()

    def attack(px: Any, watch: Watch) -> str:
        codes = {}
        for host in ("attacker.example", "localhost"):
            for path in ("/_slots/", "/_slots/status"):
                with httpx.Client() as c:
                    resp = c.get(px.url + path, headers={"host": f"{host}:{px.port}"}, timeout=10)
                codes[f"{host} {path}"] = resp.status_code
                row.check(resp.headers.get("x-content-type-options") == "nosniff"
                          and "frame-ancestors 'none'" in resp.headers.get("content-security-policy", ""),
                          f"security headers missing on {path}")
        row.requests = len(codes)
        row.notes["codes"] = codes
        want = {"attacker.example /_slots/": 403, "attacker.example /_slots/status": 403,
                "localhost /_slots/": 200, "localhost /_slots/status": 200}
        return f"ok: {codes}" if codes == want else f"wrong: {codes}"

    try:
        return measure(soak, row, upstream.url, {**QUIET, "slots_state_dir": str(soak.dir("st-host"))}, attack, 60)
    finally:
        upstream.close()


class _ThreadStub:
    """The stub llama-server on a loop of its own (its `seen` list read by the soak)."""

    def __init__(self, **kw: Any) -> None:
        self.stub = StubLlama(**kw)
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.stub.start())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        ready.wait(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.stub.close(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def client_keys(soak: Any) -> Attack:
    row = Attack("client-keys", "13", "own calls: slots_api_key only")
    key = "sk-soak-right"
    stub = _ThreadStub(api_key=key)

    def attack(px: Any, watch: Watch) -> str:
        for who, k in (("a", key), ("b", "sk-soak-wrong"), ("c", key)):
            _chat(px.url, f"keys {who}", {"authorization": f"Bearer {k}"})
        row.requests = 3
        own = [s for s in stub.stub.seen if s.path in ("/props", "/slots")]
        carried = sum(1 for s in own if "authorization" in s.headers or "x-api-key" in s.headers)
        row.notes |= {"own_calls": len(own), "with_a_clients_key": carried}
        if own and not carried:
            return f"ok: {len(own)} calls of the proxy's own, none with a client's key"
        return f"wrong: {carried} of {len(own)} own calls carried a client's key"

    try:
        return measure(soak, row, stub.stub.url, {**QUIET, "slots_state_dir": str(soak.dir("st-keys"))}, attack, 60)
    finally:
        stub.close()


def ipv6(soak: Any) -> Attack:
    row = Attack("ipv6", "10", "origins keep their brackets")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.stub_llama", "--host", "::1", "--port", str(port)],
                            cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    soak.procs.append(proc)
    assert proc.stdout is not None
    proc.stdout.readline()

    def attack(px: Any, watch: Watch) -> str:
        resp = _chat(px.url, "ipv6")
        row.requests = 1
        if resp.status_code == 200 and resp.headers.get("x-slot-id") is not None:
            return f"ok: served and pinned on slot {resp.headers['x-slot-id']}"
        return f"wrong: {resp.status_code}, slot {resp.headers.get('x-slot-id')}"

    try:
        return measure(soak, row, f"http://[::1]:{port}", {**QUIET, "slots_state_dir": str(soak.dir("st-v6"))},
                       attack, 60)
    except RuntimeError as e:  # mitmdump exited at start (the bug)
        row.check(False, str(e))
        row.outcome = "mitmdump exited at start"
        return row
    finally:
        proc.kill()


def console_script(soak: Any) -> Attack:
    """No proxy of its own: the command line checks, timed; alive/health are the command's exit statuses."""
    row = Attack("console-script", "17", "listen: address or name; ports 1..65535; argv quoted")
    t0 = time.monotonic()
    base = [sys.executable, "-m", "slotkeeper.cli", "--upstream", "http://127.0.0.1:9", "--dry-run"]
    refused = {}
    for args in (["--listen", "127.0.0.1:8081@0.0.0.0:9999"], ["--web", "--web-port", "0"], ["--listen", "::1:8081"]):
        done = subprocess.run([*base, *args], cwd=str(ROOT), capture_output=True, text=True, timeout=60)
        refused[" ".join(args)] = done.returncode
    save = soak.dir("save dir; touch x")
    done = subprocess.run([*base, "--save-dir", str(save)], cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    round_trip = f"slots_save_dir={save.resolve()}" in shlex.split(done.stdout)
    row.notes |= {"exit_statuses": refused, "dry_run_round_trips": round_trip}
    row.requests = len(refused) + 1
    row.alive, row.seconds = True, round(time.monotonic() - t0, 1)
    row.outcome = (f"ok: {len(refused)} malformed arguments refused (exit 2), the dry run splits back to its argv"
                   if set(refused.values()) == {2} and round_trip else f"wrong: {refused}, round trip {round_trip}")
    row.check(row.outcome.startswith("ok"), row.outcome)
    return row


ATTACKS = [redis_200mb, redis_600k, redis_stamps, redis_lock, host_rebinding, client_keys, ipv6, console_script]


def run(soak: Any) -> BoundsRow:
    """Every attack, each on its own proxy; one summary row (its table printed, and kept in its notes)."""
    return run_attacks(soak, [(attack.__name__, attack) for attack in ATTACKS], "store & doors")


def main() -> int:
    from bench.reliability import Soak

    soak = Soak(1)
    try:
        row = run(soak)
    finally:
        soak.close()
        with contextlib.suppress(OSError):
            shutil.rmtree(soak.root, ignore_errors=True)
    for f in row.failed:
        print("FAILED", f)
    return 1 if row.failed else 0


if __name__ == "__main__":
    sys.exit(main())
