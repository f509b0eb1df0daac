"""The registry of benchmarked configurations, and how to stand each one up.

Every configuration gets a *fresh* llama-server (`-np 4`, 8K context per slot, server defaults otherwise),
so no KV cache or RAM prompt cache survives from the previous one, and (if proxied) a fresh mitmdump with
its own empty `slots_state_dir`. A new configuration is one `BenchConfig(...)` line in `CONFIGS`.

Whose server: `SERVER` (`python -m bench --llama-server PATH --model GGUF --ngl 99 --ctk q8_0`, set once by
`use_server`). With `--llama-url` every configuration runs on that one running server instead: its slots are
erased before each configuration, and the slot files a configuration wrote in its `--slot-save-path` are
removed after it (a RAM prompt cache, `--cache-ram`, does survive: start it with `--cache-ram 0`).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import report
from bench.real.llama_server import LlamaServer
from bench.real.mitmdump import MitmProxy

SLOTS = 4
CTX_PER_SLOT = 8192
# llama.cpp compute threads. 2 (one per core) is fastest on an idle machine. But when anything else is busy
# (another llama-server, tests), 2 threads on 2 cores stall llama.cpp's spinning thread barrier: 8 decode
# tokens measured 7.5 s instead of 0.24 s with 1 thread, and prefill 70 instead of 100 tokens/s. So the
# default follows the load at start-up; `--threads` pins it, and the run's JSON records the choice.
IDLE_LOAD = 0.7


def default_threads() -> int:
    return 2 if os.getloadavg()[0] < IDLE_LOAD else 1


@dataclass(frozen=True)
class Server:
    """The llama-server the bench runs on. Default: the embedded one with SmolLM2
    (bench/real/llama_server.py)."""

    binary: str | None = None        # a llama-server binary (LLAMA_SERVER_BIN), else the embedded xllamacpp
    model: str | None = None         # a GGUF, else SmolLM2
    extra: tuple[str, ...] = ()      # more server flags (-ngl N, -ctk/-ctv T)
    cache_type: str = "f16"          # its KV cache type (the proxy's slots_cache_type)
    ctx_per_slot: int = CTX_PER_SLOT
    url: str | None = None           # a running server instead: nothing is started
    save_dir: Path | None = None     # that server's --slot-save-path (configurations with a save dir need it)
    np_default: bool = False         # no -np: the server's own default slots on a unified KV cache

    @property
    def own(self) -> bool:
        """Not the default server: the user's binary, model or running server."""
        return self != Server()


SERVER = Server()


def use_server(server: Server) -> None:
    """Run every configuration on `server` from now on (`python -m bench`'s server flags)."""
    global SERVER
    SERVER = server
    if server.binary:
        # bench.real.llama_server reads it for every server it starts
        os.environ["LLAMA_SERVER_BIN"] = server.binary


def server_kw(slot_dir: Path | None, threads: int, slots: int, log_path: Path) -> dict[str, Any]:
    """LlamaServer's arguments for one of `SERVER`'s kind."""
    return {"slots": slots, "ctx_per_slot": SERVER.ctx_per_slot, "threads": threads,
            "slot_save_path": str(slot_dir) if slot_dir else None, "model": SERVER.model,
            "extra": list(SERVER.extra), "log_path": str(log_path), "np_default": SERVER.np_default}


@dataclass(frozen=True)
class BenchConfig:
    name: str
    proxy: bool  # False: the client talks to llama-server directly
    options: dict[str, object] = field(default_factory=dict)  # addon options (`--set key=value`)
    description: str = ""
    save_dir: bool = False  # the server gets a --slot-save-path and the proxy slots_save_dir = it
    checkpoints: bool = False  # prefix checkpoints on (they need save_dir)


CONFIGS: dict[str, BenchConfig] = {c.name: c for c in [
    BenchConfig("stock", proxy=False, description="llama-server defaults, no proxy"),
    BenchConfig("off", proxy=True, options={"slots_policy": "off"}, description="proxy, observe only"),
    BenchConfig("seed", proxy=True, options={"slots_policy": "seed"}, description="proxy, seed ranking"),
    BenchConfig("defaults", proxy=True, description="proxy with the shipped defaults, the server without a save dir"),
    BenchConfig("auto-pin", proxy=True, options={"slots_policy": "auto", "slots_paging": "false"},
                description="proxy, auto policy, pinning only (no save dir: no paging, no checkpoints)"),
    BenchConfig("auto", proxy=True, options={"slots_policy": "auto", "slots_prefix_cache": "off"},
                description="proxy, auto policy with session paging (save dir, checkpoints off)", save_dir=True),
    BenchConfig("auto+ckpt", proxy=True, options={"slots_policy": "auto", "slots_prefix_cache": "disk"},
                description="proxy, auto policy, session paging and prefix checkpoints on disk", save_dir=True,
                checkpoints=True),
    # The cost model against always paging (docs/performance.md, "Page or recompute"): `auto+ckpt` with the start-up
    # probe, so the speeds are measured before the first move, and the same with `slots_cost_model=false`.
    BenchConfig("costs", proxy=True, options={"slots_policy": "auto", "slots_prefix_cache": "disk",
                                              "slots_throughput_probe": "true"},
                description="`auto+ckpt`, speeds measured at start: each move weighed by its cost", save_dir=True,
                checkpoints=True),
    BenchConfig("always-page", proxy=True, options={"slots_policy": "auto", "slots_prefix_cache": "disk",
                                                    "slots_throughput_probe": "true", "slots_cost_model": "false"},
                description="`costs` with the cost model off: every page and prefix move made", save_dir=True,
                checkpoints=True),
    BenchConfig("affinity", proxy=True, options={"slots_policy": "affinity"},
                description="proxy, pending then pinned: llama-server chooses a new session's slot (id_slot -1), "
                            "the proxy pins the slot it chose"),
]}
DEFAULT_CONFIGS = ["stock", "off", "seed", "auto", "auto+ckpt", "affinity"]


@dataclass(frozen=True)
class Stack:
    """Where the client sends requests (`url`), where the server itself is (`server_url`), and the proxy's
    JSON-lines log (its checkpoint warm-ups prefill tokens the clients never see; they are counted too)."""

    url: str
    server_url: str
    proxy_log: Path | None = None
    server: LlamaServer | None = None  # None: a running server (`--llama-url`) or several
    save_dir: Path | None = None       # the server's --slot-save-path (None: it has none)

    def _proxy_events(self, kind: str) -> list[dict[str, Any]]:
        if self.proxy_log is None or not self.proxy_log.exists():
            return []
        records = (json.loads(line) for line in self.proxy_log.read_text().splitlines())
        return [rec for rec in records if rec.get("kind") == kind]

    def proxy_prefills(self) -> list[int]:
        """Tokens the proxy itself made the server prefill, per call (checkpoint warm-ups and verification
        probes; each prefills a prefix from the start of an erased slot)."""
        return [rec.get("prompt_n") or 0 for rec in self._proxy_events("checkpoint")]

    def proxy_prefill(self) -> int:
        return sum(self.proxy_prefills())

    def checkpoint_steps(self) -> dict[str, int]:
        """The proxy's prefix-checkpoint steps by outcome (warmed-saved, restored, hit, ...)."""
        steps: dict[str, int] = {}
        for rec in self._proxy_events("checkpoint"):
            steps[str(rec.get("outcome"))] = steps.get(str(rec.get("outcome")), 0) + 1
        return steps

    def proxy_paging(self) -> dict[str, Any]:
        """What session paging did: page-ins and the tokens they restored (no prefill), page-outs, and the
        server's own time for the file writes and reads."""
        events = self._proxy_events("page")
        ins = [e["in_tokens"] for e in events if isinstance(e.get("in_tokens"), int)]
        return {"page_ins": len(ins), "paged_in_tokens": sum(ins),
                "page_outs": sum(1 for e in events if isinstance(e.get("out_tokens"), int)),
                "paging_ms": round(sum(e.get("server_ms") or 0.0 for e in events), 1),
                "cost_choices": cost_choices(self._proxy_events("cost"))}


def cost_choices(records: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per move, how often the cost model made it (`moved`) and how often it prefilled instead."""
    out = {move: {"moved": 0, "instead": 0} for move, _, _ in report.COST_MOVES}
    for rec in records:
        if rec.get("move") in out:
            out[rec["move"]]["moved" if rec.get("moved") else "instead"] += 1
    return out


@contextlib.contextmanager
def stand_up(cfg: BenchConfig, log_dir: Path, tag: str = "", threads: int = 2,
             extra: list[str] | None = None, servers: int = 1, slots: int = SLOTS) -> Iterator[Stack]:
    """A fresh llama-server (and proxy, if the config has one); logs go to `log_dir/<tag><name>.*.log`.
    `servers` > 1: that many servers of `slots` slots (one save dir shared), behind one proxy
    (`slots_upstreams`) or, for a configuration without a proxy, a round-robin balancer (bench/lb.py)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    if servers > 1:
        with _stand_up_many(cfg, log_dir, f"{tag}{cfg.name}", threads, servers, slots) as stack:
            yield stack
        return
    stem = f"{tag}{cfg.name}"
    if SERVER.url:
        with _running(cfg, log_dir, stem, extra) as stack:
            yield stack
        return
    with tempfile.TemporaryDirectory(prefix=f"slotkeeper-bench-{cfg.name}-") as tmp:
        slot_dir = Path(tmp) / "slots"
        slot_dir.mkdir()
        with LlamaServer(**server_kw(slot_dir if cfg.save_dir else None, threads, slots,
                                     log_dir / f"{stem}.llama.log")) as server:
            if not cfg.proxy:
                yield Stack(server.url, server.url, server=server, save_dir=slot_dir if cfg.save_dir else None)
                return
            with _proxy(cfg, server.url, Path(tmp), slot_dir if cfg.save_dir else None, log_dir, stem,
                        extra) as (url, jsonl):
                yield Stack(url, server.url, jsonl, server, slot_dir if cfg.save_dir else None)


def proxy_options(cfg: BenchConfig, state: Path, slot_dir: Path | None, jsonl: Path) -> dict[str, object]:
    """The configuration's addon options, with its own state dir, JSONL log, save dir and the KV type."""
    options: dict[str, object] = {**cfg.options, "slots_state_dir": str(state), "slots_log_file": str(jsonl)}
    if slot_dir is not None:
        options["slots_save_dir"] = str(slot_dir)
    if SERVER.cache_type != "f16":
        options["slots_cache_type"] = SERVER.cache_type
    return options


@contextlib.contextmanager
def _proxy(cfg: BenchConfig, server_url: str, tmp: Path, slot_dir: Path | None, log_dir: Path, stem: str,
           extra: list[str] | None) -> Iterator[tuple[str, Path]]:
    jsonl = log_dir / f"{stem}.requests.jsonl"
    with MitmProxy(server_url, proxy_options(cfg, tmp / "state", slot_dir, jsonl),
                   log_path=str(log_dir / f"{stem}.mitm.log"), extra=extra) as proxy:
        yield proxy.url, jsonl


@contextlib.contextmanager
def _running(cfg: BenchConfig, log_dir: Path, stem: str, extra: list[str] | None) -> Iterator[Stack]:
    """`cfg` on the running server `SERVER.url`: its slots erased first, the slot files written during the
    configuration removed after it."""
    import httpx

    url = SERVER.url or ""
    if cfg.save_dir and SERVER.save_dir is None:
        raise ValueError(f"{cfg.name} pages to the server's --slot-save-path: give it with --save-dir")
    erase_slots(url)
    slot_dir = SERVER.save_dir if cfg.save_dir else None
    before = set(os.listdir(slot_dir)) if slot_dir else set()
    try:
        with tempfile.TemporaryDirectory(prefix=f"slotkeeper-bench-{cfg.name}-") as tmp:
            if not cfg.proxy:
                yield Stack(url, url, save_dir=slot_dir)
                return
            with _proxy(cfg, url, Path(tmp), slot_dir, log_dir, stem, extra) as (proxy_url, jsonl):
                yield Stack(proxy_url, url, jsonl, save_dir=slot_dir)
    finally:
        if slot_dir:
            for name in set(os.listdir(slot_dir)) - before:
                with contextlib.suppress(OSError):
                    (slot_dir / name).unlink()
        with contextlib.suppress(httpx.HTTPError):
            erase_slots(url)


def erase_slots(url: str) -> None:
    """Empty every slot of the server at `url` (`GET /slots`, then `POST /slots/{id}?action=erase` each)."""
    import httpx

    with httpx.Client(base_url=url, timeout=60) as c:
        for slot in c.get("/slots").json():
            c.post(f"/slots/{slot['id']}?action=erase")


@contextlib.contextmanager
def _stand_up_many(cfg: BenchConfig, log_dir: Path, stem: str, threads: int, servers: int,
                   slots: int) -> Iterator[Stack]:
    from bench.scale import balancer  # local: scale imports the client and report modules

    with tempfile.TemporaryDirectory(prefix=f"slotkeeper-bench-{cfg.name}-") as tmp, contextlib.ExitStack() as st:
        slot_dir = Path(tmp) / "slots"
        slot_dir.mkdir()
        each = max(1, threads // servers)  # the servers share the machine's cores
        srvs = [st.enter_context(LlamaServer(**server_kw(slot_dir if cfg.save_dir else None, each, slots,
                                                         log_dir / f"{stem}-{i}.llama.log")))
                for i in range(servers)]
        urls = [s.url for s in srvs]
        if not cfg.proxy:
            yield Stack(st.enter_context(balancer("round-robin", urls, log_dir / f"{stem}.lb.log")), urls[0],
                        server=srvs[0])
            return
        options = {**proxy_options(cfg, Path(tmp) / "state", slot_dir if cfg.save_dir else None,
                                   log_dir / f"{stem}.requests.jsonl"), "slots_upstreams": urls[1:]}
        proxy = st.enter_context(MitmProxy(urls[0], options, log_path=str(log_dir / f"{stem}.mitm.log")))
        yield Stack(proxy.url, urls[0], Path(str(options["slots_log_file"])), srvs[0])
