"""A real Redis server process for the tests and the bench (`redis-server` on PATH; Debian's package installs it)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from launch.llama_server import free_port


class RedisServer:
    """redis-server on a free loopback port, no persistence; a context manager. `stop`/`start` keep the port
    (the tests take the store away and bring it back)."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not on PATH (apt-get install redis-server)")
        self.binary = binary
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="slotkeeper-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--protected-mode", "yes"],
            stdout=open(Path(self.dir) / "redis.log", "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if redis.Redis(port=self.port, socket_timeout=0.5).ping():
                    return self
            except redis.RedisError:
                time.sleep(0.05)
        raise TimeoutError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
