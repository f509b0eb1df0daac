"""A real Redis server process for the tests and the bench: `$REDIS_SERVER`, else `redis-server` or
`valkey-server` on PATH (Debian's packages; `make test` installs redis-server when it may)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from slotkeeper.launch.mitmdump import free_port

MISSING = ("redis-server (or valkey-server) is not installed: `make test` installs it when it may "
           "(root or passwordless sudo), else sudo apt-get install redis-server")


def redis_binary() -> str | None:
    """The server binary to start: `$REDIS_SERVER` when set (None if it is not an executable file), else the
    first of redis-server, valkey-server on PATH (Valkey speaks the same protocol)."""
    explicit = os.environ.get("REDIS_SERVER")
    if explicit:
        return explicit if os.path.isfile(explicit) and os.access(explicit, os.X_OK) else None
    return shutil.which("redis-server") or shutil.which("valkey-server")


class RedisServer:
    """redis-server on a free loopback port, no persistence; a context manager. `stop`/`start` keep the port
    (the tests take the store away and bring it back)."""

    def __init__(self) -> None:
        binary = redis_binary()
        if binary is None:
            explicit = os.environ.get("REDIS_SERVER")
            raise FileNotFoundError(f"REDIS_SERVER={explicit} is not an executable file" if explicit else MISSING)
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
