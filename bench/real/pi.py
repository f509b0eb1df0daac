"""Drive the real pi coding agent (`@mariozechner/pi-coding-agent`, pinned in tools/pi) non-interactively.

Why: tests and the benchmark need genuine pi traffic (its real system prompt, tools array, continuation
layout and side calls), not a hand-written imitation of it. Each `PiSession` is one pi "window": its own
`PI_CODING_AGENT_DIR` (models.json + settings.json) and `--session-dir`, running in a throw-away project
directory so pi's tools (read/bash/edit/write) can only touch scratch files.

Facts measured with pi 0.73.1 against llama-server + SmolLM2-135M (see tools/pi/README.md):
- a turn is `pi --offline --provider llama --model smollm2 --session-dir DIR [-c] -p PROMPT`, stdin
  closed; later turns add `-c` and send the whole conversation again (prefix-extending prompt);
- one HTTP request per turn (`POST /v1/chat/completions`, streamed) unless the model emits tool calls;
- pi's auto-compaction fires after *every* turn when `contextWindow - reserveTokens (16384)` is below
  the prompt size, i.e. always for an 8192-token window: it sends a side call ("You are a context
  summarization assistant…", no tools, `max_completion_tokens` 13107) and `pi -p` does not exit until it
  finishes, which with a 135M model on 2 CPUs is minutes. So compaction is disabled by default
  (`settings.json: {"compaction": {"enabled": false}}`); pass `compaction=True` to get the side call.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PI_PROJECT = ROOT / "tools" / "pi"
PI_BIN = PI_PROJECT / "node_modules" / ".bin" / "pi"
PI_VERSION = "0.73.1"

# Flags that keep a run independent of whatever the host has in ~/.pi or ~/.agents. None of them changes
# the request pi sends when no extensions/skills/templates exist (the normal case on a clean machine).
HERMETIC_FLAGS = ("--no-extensions", "--no-skills", "--no-prompt-templates", "--no-themes")


class PiUnavailable(RuntimeError):
    """node/npm are missing or the pi package could not be installed."""


def node_available() -> bool:
    """True when both `node` and `npm` are on PATH (needed to install and run pi)."""
    return shutil.which("node") is not None and shutil.which("npm") is not None


def ensure_pi_installed(timeout: float = 900.0) -> Path:
    """Return the pi CLI path, installing tools/pi's locked dependencies first if it is missing."""
    if PI_BIN.exists():
        return PI_BIN
    if not node_available():
        raise PiUnavailable("pi needs node (>= 20.6) and npm on PATH; install Node.js to run pi traffic")
    # `npm ci` installs exactly the committed lock file; fall back to `npm install` if there is none.
    verb = "ci" if (PI_PROJECT / "package-lock.json").exists() else "install"
    argv = ["npm", verb, "--no-audit", "--no-fund", "--prefix", str(PI_PROJECT)]
    proc = subprocess.run(argv, cwd=PI_PROJECT, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0 or not PI_BIN.exists():
        raise PiUnavailable(f"`{' '.join(argv)}` failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return PI_BIN


def openai_base(url: str) -> str:
    """pi's `baseUrl` must end in /v1 (it appends /chat/completions); accept the bare server URL too."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


@dataclass
class TurnRecord:
    """What one `pi -p` invocation did, for timing reports."""

    prompt: str
    argv: list[str]
    seconds: float
    returncode: int | None
    stdout: str = ""
    stderr: str = ""


@dataclass
class PiSession:
    """One pi window: its own agent dir, session dir and (by default shared) project cwd under `workdir`.

    `cwd=None` puts every session of a `workdir` in `workdir/project`, like two windows of one project
    (their system prompts are then byte-identical); pass distinct `cwd`s for different projects.
    """

    base_url: str
    workdir: Path
    name: str
    cwd: Path | None = None
    model_id: str = "smollm2"
    context_window: int = 8192
    max_tokens: int = 64
    compaction: bool = False
    agents_md: str | None = None  # written to cwd/AGENTS.md: pi puts it in the system prompt
    settings: dict[str, Any] = field(default_factory=dict)  # merged into settings.json
    extra_args: Sequence[str] = ()
    hermetic: bool = True
    binary: Path | None = None
    turns: int = 0
    history: list[TurnRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workdir = Path(self.workdir)
        self.home = self.workdir / "pi" / self.name
        self.agent_dir = self.home / "agent"
        self.session_dir = self.home / "sessions"
        self.cwd = Path(self.cwd) if self.cwd is not None else self.workdir / "project"
        for d in (self.agent_dir, self.session_dir, self.cwd):
            d.mkdir(parents=True, exist_ok=True)
        if self.agents_md is not None:
            (self.cwd / "AGENTS.md").write_text(self.agents_md)
        self.write_config()

    def models_json(self) -> dict[str, Any]:
        return {"providers": {"llama": {
            "baseUrl": openai_base(self.base_url), "api": "openai-completions", "apiKey": "x",
            "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
            "models": [{"id": self.model_id, "contextWindow": self.context_window,
                        "maxTokens": self.max_tokens}],
        }}}

    def settings_json(self) -> dict[str, Any]:
        base: dict[str, Any] = {"compaction": {"enabled": self.compaction}}
        return {**base, **self.settings}

    def write_config(self) -> None:
        """(Re)write models.json and settings.json, e.g. after changing `base_url` to go via a proxy."""
        (self.agent_dir / "models.json").write_text(json.dumps(self.models_json(), indent=2))
        (self.agent_dir / "settings.json").write_text(json.dumps(self.settings_json(), indent=2))

    def argv(self, prompt: str) -> list[str]:
        """The exact pi command line for the next turn (`-c` once a turn has run)."""
        binary = self.binary or ensure_pi_installed()
        argv = [str(binary), "--offline", "--provider", "llama", "--model", self.model_id,
                "--session-dir", str(self.session_dir), *(HERMETIC_FLAGS if self.hermetic else ()),
                *self.extra_args]
        if self.turns > 0:
            argv.append("-c")
        return [*argv, "-p", prompt]

    def env(self) -> dict[str, str]:
        return {**os.environ, "PI_CODING_AGENT_DIR": str(self.agent_dir), "PI_OFFLINE": "1",
                "PI_TELEMETRY": "0", "PI_SKIP_VERSION_CHECK": "1", "NO_COLOR": "1"}

    def _finish(self, prompt: str, argv: list[str], started: float, rc: int | None,
                out: str, err: str) -> subprocess.CompletedProcess[str]:
        self.turns += 1
        self.history.append(TurnRecord(prompt, argv, time.monotonic() - started, rc, out, err))
        return subprocess.CompletedProcess(argv, rc if rc is not None else -1, out, err)

    def run_turn(self, prompt: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """Run one `pi -p` turn to completion. Raises `subprocess.TimeoutExpired` after killing pi's group."""
        argv = self.argv(prompt)
        started = time.monotonic()
        # New session so a timeout can also kill commands pi's bash tool started.
        proc = subprocess.Popen(argv, cwd=self.cwd, env=self.env(), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            out, err = proc.communicate()
            self._finish(prompt, argv, started, None, out, err)
            raise subprocess.TimeoutExpired(argv, timeout, out, err) from None
        return self._finish(prompt, argv, started, proc.returncode, out, err)

    def session_file(self) -> Path | None:
        """The newest session JSONL pi wrote for this window (None before the first turn)."""
        files = sorted(self.session_dir.glob("*.jsonl"), key=lambda p: p.stat().st_mtime)
        return files[-1] if files else None

    def entries(self) -> list[dict[str, Any]]:
        """pi's own session log (messages with usage, stopReason, errorMessage) for assertions."""
        path = self.session_file()
        if path is None:
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def assistant_usage(self) -> list[dict[str, Any]]:
        """Per-request usage from pi's log: `prompt_n` (= pi `input`), `cache_n` (= pi `cacheRead`).

        pi stores llama-server's `usage.prompt_tokens_details.cached_tokens` (which equals
        `timings.cache_n`) as `cacheRead` and `prompt_tokens - cached_tokens` (= `timings.prompt_n`) as
        `input`, so the cache reuse of every request is readable without a proxy.
        """
        rows = []
        for entry in self.entries():
            msg = entry.get("message") or {}
            if entry.get("type") == "message" and msg.get("role") == "assistant":
                usage = msg.get("usage") or {}
                rows.append({"prompt_n": usage.get("input"), "cache_n": usage.get("cacheRead"),
                             "completion": usage.get("output"), "stop": msg.get("stopReason"),
                             "error": msg.get("errorMessage")})
        return rows


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def run_sessions_concurrently(sessions: Sequence[PiSession], prompts: Sequence[str] | Sequence[Sequence[str]],
                              timeout: float = 300) -> dict[str, list[subprocess.CompletedProcess[str]]]:
    """Run every session through its prompts in order; sessions run in parallel threads (one pi each).

    `prompts` is one list shared by all sessions or one list per session (give windows distinct first
    messages: windows of one project share the system prompt, so only the first message tells them
    apart). A timed-out turn is recorded as returncode -1 and ends that session's run.
    """
    per_session: list[Sequence[str]] = (
        [prompts] * len(sessions) if not prompts or isinstance(prompts[0], str)  # type: ignore[list-item]
        else list(prompts))  # type: ignore[arg-type]

    def drive(session: PiSession, todo: Sequence[str]) -> list[subprocess.CompletedProcess[str]]:
        done: list[subprocess.CompletedProcess[str]] = []
        for prompt in todo:
            try:
                done.append(session.run_turn(prompt, timeout))
            except subprocess.TimeoutExpired as exc:
                done.append(subprocess.CompletedProcess(exc.cmd, -1, str(exc.output or ""), "timeout"))
                break
        return done

    with ThreadPoolExecutor(max_workers=max(1, len(sessions))) as pool:
        futures = {s.name: pool.submit(drive, s, todo) for s, todo in zip(sessions, per_session, strict=True)}
        return {name: fut.result() for name, fut in futures.items()}
