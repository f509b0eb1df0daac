"""`make test` on a fresh machine: the service step installs what the suite starts, or stops with one line that
says what to install; the Redis fixture fails (never skips) without a server; the run ends by saying what was
skipped and why.

The service step runs here on a PATH of its own (the real tools it calls, stand-ins for what it looks for, a
stand-in `id` for a user who is not root), so no test installs anything or depends on this machine's packages.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.real.redis_server import MISSING, RedisServer, redis_binary

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "test_services.sh"
TOOLS = ["bash", "env", "awk", "grep", "mktemp", "rm", "touch"]


def stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def fake_path(tmp_path: Path, present: list[str], uid: int) -> Path:
    """A PATH with the shell tools, `present` as stand-ins, node 20 and an `id` that reports `uid`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        real = shutil.which(tool)
        assert real, tool
        (bin_dir / tool).symlink_to(real)
    for name in present:
        stub(bin_dir, name, "exit 0")
    stub(bin_dir, "node", "echo 20")
    stub(bin_dir, "npm", "exit 0")
    stub(bin_dir, "id", f"echo {uid}")
    # apt-get is there (a Debian machine) but must never run for a user who may not install.
    stub(bin_dir, "apt-get", f"touch {tmp_path}/apt-ran; exit 99")
    stub(bin_dir, "apt-cache", "echo '  Candidate: 20.19.2+dfsg-1'")
    return bin_dir


def run_step(bin_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": str(bin_dir), "TMPDIR": str(bin_dir.parent), **env}  # the failed install's log stays in tmp
    return subprocess.run([str(bin_dir / "bash"), str(SCRIPT)], env=env,
                          capture_output=True, text=True, timeout=60)


def test_a_user_who_may_not_install_gets_one_line_naming_the_packages(tmp_path: Path) -> None:
    bin_dir = fake_path(tmp_path, present=["chromium"], uid=1000)
    done = run_step(bin_dir)
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "redis-server, chromium-driver missing" in lines[0]
    assert "sudo apt-get install redis-server chromium-driver" in lines[0]
    assert not (tmp_path / "apt-ran").exists()


def test_nothing_missing_is_silent_and_installs_nothing(tmp_path: Path) -> None:
    bin_dir = fake_path(tmp_path, present=["valkey-server", "chromium", "chromedriver"], uid=1000)
    done = run_step(bin_dir)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert not (tmp_path / "apt-ran").exists()


def test_root_installs_from_debian_and_a_failed_install_is_one_line_with_its_log(tmp_path: Path) -> None:
    bin_dir = fake_path(tmp_path, present=["redis-server", "chromium", "chromedriver"], uid=0)
    (bin_dir / "node").unlink()
    stub(bin_dir, "node", "echo 18")  # too old for pi: Debian's nodejs 20 is installed
    done = run_step(bin_dir)
    assert done.returncode == 1
    assert (tmp_path / "apt-ran").exists()
    lines = done.stderr.splitlines()
    assert lines[0] == "make test: installing nodejs npm from Debian's packages (the suite starts them for real)"
    assert len(lines) == 2
    assert lines[1].startswith(f"make test: apt-get install nodejs npm failed (its output: {tmp_path}/slotkeeper-apt.")


def test_a_redis_server_variable_that_names_no_program_stops_the_step(tmp_path: Path) -> None:
    bin_dir = fake_path(tmp_path, present=["redis-server", "chromium", "chromedriver"], uid=0)
    done = run_step(bin_dir, REDIS_SERVER=str(tmp_path / "nowhere" / "redis-server"))
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "is not an executable file" in done.stderr
    assert not (tmp_path / "apt-ran").exists()


def test_the_redis_binary_is_the_variable_else_redis_or_valkey_on_path(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub(bin_dir, "valkey-server", "exit 0")
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("REDIS_SERVER", raising=False)
    assert redis_binary() == str(bin_dir / "valkey-server")
    stub(bin_dir, "redis-server", "exit 0")
    assert redis_binary() == str(bin_dir / "redis-server")
    monkeypatch.setenv("REDIS_SERVER", str(bin_dir / "valkey-server"))
    assert redis_binary() == str(bin_dir / "valkey-server")
    monkeypatch.setenv("REDIS_SERVER", str(tmp_path / "none"))
    assert redis_binary() is None
    with pytest.raises(FileNotFoundError, match=r"REDIS_SERVER=.* is not an executable file"):
        RedisServer()
    monkeypatch.delenv("REDIS_SERVER")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError) as exc:
        RedisServer()
    assert str(exc.value) == MISSING


def pytest_run(tmp_path: Path, test_source: str, path: str) -> subprocess.CompletedProcess[str]:
    """A pytest run of one throw-away test file with this suite's conftest as its plugin."""
    test_file = tmp_path / "test_throwaway.py"
    test_file.write_text(test_source)
    env = {**os.environ, "PATH": path}
    env.pop("REDIS_SERVER", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                           "-c", os.devnull, "--rootdir", str(tmp_path), str(test_file)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_the_run_ends_with_the_count_of_skipped_tests_and_their_reasons(tmp_path: Path) -> None:
    done = pytest_run(tmp_path, """
import pytest

def test_runs():
    pass

@pytest.mark.skipif(True, reason="needs a GPU")
def test_gpu_a():
    pass

@pytest.mark.skipif(True, reason="needs a GPU")
def test_gpu_b():
    pass

def test_inline():
    pytest.skip("no such device here")
""", os.environ["PATH"])
    assert done.returncode == 0, done.stdout
    out = done.stdout.splitlines()
    at = out.index("not tested on this machine: 3 skipped, because:")
    assert out[at + 1:at + 3] == ["  2 × needs a GPU", "  1 × no such device here"]


def test_a_missing_redis_server_fails_the_store_tests_with_one_line(tmp_path: Path) -> None:
    done = pytest_run(tmp_path, """
def test_store(url):
    assert url.startswith("redis://")
""", str(tmp_path))  # no redis-server, no valkey-server on this PATH
    assert done.returncode == 1, done.stdout
    assert "1 error" in done.stdout
    assert MISSING in done.stdout and "Traceback" not in done.stdout
    assert "not tested on this machine: 0 skipped" in done.stdout
