"""The package as a user installs it: the wheel built from the sources, installed with its dependencies into a
fresh venv (no system site-packages, no path to this checkout), and its `slotkeeper` command in front of a
real embedded llama-server answering one chat request, all within a minute (issue 23).

The venv gets its dependencies from the index pip is configured with on this machine, as a user's
`pip install` would (no `.pth` link to this venv's packages: measured, the full install takes ~12 s here).
The wheel is built from a copy of only what it is made of (pyproject.toml, README.md, slotkeeper/, slotlogic/),
so a file it needs from elsewhere in the repository fails here, and the build writes nothing into the checkout.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.real.llama_server import LlamaServer
from slotkeeper.launch.mitmdump import free_port

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "slotkeeper", "slotlogic")
NOT_INSTALLED = ("drivers", "mitm", "launch", "bench", "tools", "tests", "addon.py")
BODY = {"model": "m", "messages": [{"role": "system", "content": "You are a coding agent."},
                                   {"role": "user", "content": "Say hi."}], "max_tokens": 4}


def quiet(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)  # type: ignore[call-overload]
    assert done.returncode == 0, f"{cmd[:3]} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done


def build_wheel(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    dist = tmp / "dist"
    quiet([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(src)])
    (wheel,) = dist.glob("slotkeeper-*.whl")
    return wheel


def site_packages(venv: Path) -> Path:
    (sp,) = venv.glob("lib/python3*/site-packages")
    return sp


def test_the_wheel_installs_into_a_fresh_venv_and_its_command_answers_through_a_real_server(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")  # the proxy's default state dir, kept out of $HOME
    with LlamaServer(slots=1, ctx_per_slot=2048, threads=1, log_path=str(tmp_path / "llama.log")) as srv:
        t0 = time.monotonic()
        wheel = build_wheel(tmp_path)
        t_built = time.monotonic()
        venv = tmp_path / "venv"
        quiet([sys.executable, "-m", "venv", str(venv)], env=env)
        quiet([str(venv / "bin" / "pip"), "install", "-q", str(wheel)], env=env, cwd=str(tmp_path))
        t_installed = time.monotonic()

        sp = site_packages(venv)
        assert sorted(p.name for p in sp.iterdir() if p.name in NOT_INSTALLED) == []
        assert sorted(p.name for p in (sp / "slotkeeper" / "launch").glob("*.py")) == ["__init__.py", "mitmdump.py"]
        assert (sp / "slotkeeper" / "mitm" / "page" / "slots.html").is_file()
        addon = quiet([str(venv / "bin" / "slotkeeper"), "--addon-path"], env=env, cwd=str(tmp_path)).stdout.strip()
        assert Path(addon) == sp / "slotkeeper" / "addon.py" and Path(addon).is_file()

        port = free_port()
        log = tmp_path / "slotkeeper.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([str(venv / "bin" / "slotkeeper"), "--upstream", srv.url,
                                     "--listen", f"127.0.0.1:{port}"],
                                    stdout=out, stderr=subprocess.STDOUT, env={**env, "PYTHONUNBUFFERED": "1"},
                                    cwd=str(tmp_path), start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            answer = None
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    answer = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=60)
                    break
                except httpx.TransportError:
                    time.sleep(0.1)
            t_answered = time.monotonic()
            assert answer is not None, f"slotkeeper exited with {proc.poll()}:\n{log.read_text()[-3000:]}"
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"] is not None
            assert answer.headers.get("x-slot-id") == "0"

            text = ""
            for _ in range(50):  # the line is written once the answer has been read
                text = log.read_text()
                if "slotkeeper: /v1/chat/completions session=" in text:
                    break
                time.sleep(0.1)
            assert "slotkeeper: /v1/chat/completions session=" in text, text
            first = text.splitlines()[0]
            assert first == f"slotkeeper proxy on {url} -> {srv.url}", text
            assert f"{venv}/bin/mitmdump -s {addon} --mode reverse:{srv.url}@127.0.0.1:{port}" in text
            assert "Say hi." not in text  # no prompt text in the log
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
    print(f"\nwheel built {t_built - t0:.1f} s, venv + install {t_installed - t_built:.1f} s, "
          f"first answer {t_answered - t_installed:.1f} s, total {t_answered - t0:.1f} s")
    assert t_answered - t0 < 60, "wheel build + install + first answered request took over a minute"
