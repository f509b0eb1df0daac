"""llama-server's router mode, the real binary (`LLAMA_SERVER_BIN`, else upstream b11434 where `make llama-server`
puts it): `--models-dir` with one GGUF per model name, `--models-max` models loaded at once. xllamacpp cannot
run it: it refuses `models_dir` ("xllamacpp disabled the router server feature")."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import httpx

from bench.real.llama_server import model_path
from slotkeeper.launch.mitmdump import free_port

DEFAULT_BIN = Path.home() / ".cache/slotkeeper/llama-server-b11434/llama-server"


def router_binary() -> str | None:
    """The llama-server binary with router mode, or None (xllamacpp's module has none)."""
    path = os.environ.get("LLAMA_SERVER_BIN") or str(DEFAULT_BIN)
    return path if os.access(path, os.X_OK) else None


class RouterServer:
    """A router over `names` (each a link to the SmolLM2 GGUF, so each is its own model file path)."""

    def __init__(self, root: Path, names: list[str], save: Path, *, models_max: int = 1, slots: int = 2,
                 ctx: int = 4096, threads: int = 1) -> None:
        self.dir = root / "models"
        self.dir.mkdir(exist_ok=True)
        for name in names:
            (self.dir / f"{name}.gguf").symlink_to(model_path())
        self.log = root / "router.log"
        self.port = free_port()
        self.argv = [router_binary() or "llama-server", "--host", "127.0.0.1", "--port", str(self.port),
                     "--models-dir", str(self.dir), "--models-max", str(models_max), "-np", str(slots),
                     "-c", str(ctx), "-t", str(threads), "--slot-save-path", str(save)]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def load_log(self) -> list[str]:
        """Each model load, in order (the router's own log line for each child it spawns)."""
        return re.findall(r"spawning server instance with name=(\S+)", self.log.read_text(errors="replace"))

    def load(self, name: str, timeout: float = 120) -> None:
        httpx.post(self.url + "/models/load", json={"model": name}, timeout=30)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = httpx.get(self.url + "/models", timeout=5).json()["data"]
            if any(r["id"] == name and r["status"]["value"] == "loaded" for r in rows):
                return
            time.sleep(0.2)
        raise RuntimeError(f"{name} did not load")

    def __enter__(self) -> RouterServer:
        out = open(self.log, "ab")  # the process writes it until it stops
        self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("the router did not start")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()  # the router stops its children
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
