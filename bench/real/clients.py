"""Drive the real agent clients (Claude Code, OpenCode, Codex CLI, Qwen Code, aider) headless and offline.

Why: slotkeeper must recognise each client's real sessions, prefixes and side calls, so tests and captures
need the genuine traffic, not an imitation. Each class here is one *session* of one client: it writes the
client's configuration into a throw-away home directory (never the real `~`), runs a turn non-interactively
with stdin closed, continues the same session on later turns (by an explicit session id, never "the most
recent one", so two sessions can share a project folder), and reports exit code, output tails and wall
time. Sessions that share a `home` behave like two windows of one user (same device id, same config).

Every environment variable that could leak the host's own client setup (`ANTHROPIC_*`, `CLAUDE_*`,
`OPENAI_*`, `CODEX_*`, `OPENCODE_*`, `QWEN_*`, `GEMINI_*`, proxies) is dropped, and each client gets the
switches that stop telemetry, update checks and other start-up network calls, so the only host a client
talks to is `base_url`.

The pinned versions live in `tools/<client>/package.json` (+ committed `package-lock.json`) and
`tools/aider/requirements.txt`; `ensure_installed()` installs them on first use. docs/clients.md records
what each one sends.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"

# Variables of the host's own agent setup that must never reach a client under test.
_DROP_PREFIXES = ("ANTHROPIC_", "CLAUDE_", "OPENAI_", "CODEX_", "OPENCODE_", "QWEN_", "GEMINI_", "AIDER_",
                  "LITELLM_", "OTEL_")
_DROP_NAMES = {"http_proxy", "https_proxy", "all_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY",
               "ALL_PROXY", "NO_PROXY", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_STATE_HOME"}


class ClientUnavailable(RuntimeError):
    """The client's runtime (node/npm or python venv) is missing or its pinned install failed."""


def node_available() -> bool:
    """True when `node` and `npm` are on PATH (every client except aider needs them to install)."""
    return shutil.which("node") is not None and shutil.which("npm") is not None


def base_root(url: str) -> str:
    """The server URL without a trailing `/v1` (Anthropic-style clients append `/v1/messages` themselves)."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def openai_base(url: str) -> str:
    """The server URL ending in `/v1` (OpenAI-style clients append `/chat/completions` or `/responses`)."""
    return base_root(url) + "/v1"


ERROR_CHARS = 300  # of a client's own error message, kept for the bench's log lines


def _tail(text: str, limit: int = 2000) -> str:
    return text[-limit:]


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


@dataclass
class TurnResult:
    """What one headless client invocation did.

    `error` is the error the client reported in its own output (Claude Code prints it on stdout, in its JSON
    result, and nothing on stderr), in the client's words and cut to ERROR_CHARS; `capped` says that error is
    the client giving up on answers cut at the answer cap, which a run with a tiny cap expects."""

    argv: list[str]
    returncode: int | None  # None: killed after the timeout
    seconds: float
    stdout_tail: str
    stderr_tail: str
    stdout: str = field(repr=False, default="")
    error: str | None = None
    capped: bool = False

    def outcome(self) -> str:
        """`exit N` (`killed` after the timeout) and the client's error, for a log line (no prompt text)."""
        head = "killed" if self.returncode is None else f"exit {self.returncode}"
        return f"{head}: {self.error}" if self.error else head


@dataclass
class ClientSession:
    """One session of one client, run in `project` with its configuration under `home`.

    `base_url` is the proxy or the server (`http://127.0.0.1:8081`, with or without `/v1`). `max_tokens`
    caps every answer; `context_window` is what the client is told the model holds (keep it at or below
    the server's context per slot). `extra_env` is merged last, e.g. to flip a client switch in a test.
    """

    base_url: str
    project: Path
    home: Path
    model: str = "smollm2"
    max_tokens: int = 32
    context_window: int = 32768
    extra_env: dict[str, str] = field(default_factory=dict)
    extra_args: Sequence[str] = ()
    session_id: str | None = None
    turns: int = 0
    history: list[TurnResult] = field(default_factory=list)

    name: ClassVar[str] = ""
    package: ClassVar[str] = ""
    version: ClassVar[str] = ""
    bin_relpath: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.project = Path(self.project)
        self.home = Path(self.home)
        for d in (self.project, self.home):
            d.mkdir(parents=True, exist_ok=True)
        self.write_config()

    # --- install -----------------------------------------------------------------------------------
    @classmethod
    def tool_dir(cls) -> Path:
        return TOOLS / cls.name

    @classmethod
    def binary(cls) -> Path:
        return cls.tool_dir() / cls.bin_relpath

    @classmethod
    def ensure_installed(cls, timeout: float = 900.0) -> Path:
        """Return the client's executable, running `npm ci --prefix tools/<client>` first if it is missing."""
        if cls.binary().exists():
            return cls.binary()
        if not node_available():
            raise ClientUnavailable(f"{cls.name} needs node and npm on PATH to install {cls.package}")
        argv = ["npm", "ci", "--no-audit", "--no-fund", "--prefix", str(cls.tool_dir())]
        proc = subprocess.run(argv, cwd=cls.tool_dir(), capture_output=True, text=True, timeout=timeout,
                              check=False)
        if proc.returncode != 0:
            # `npm ci` refuses a lock whose optional per-platform packages the registry does not resolve
            # (opencode-ai, qwen-code); `npm install` honours the same lock and skips them.
            argv[1] = "install"
            proc = subprocess.run(argv, cwd=cls.tool_dir(), capture_output=True, text=True, timeout=timeout,
                                  check=False)
        if proc.returncode != 0 or not cls.binary().exists():
            raise ClientUnavailable(f"`{' '.join(argv)}` failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        return cls.binary()

    # --- per-client hooks --------------------------------------------------------------------------
    def write_config(self) -> None:
        """Write the client's configuration files under `home` (rerun after changing `base_url`)."""

    def client_env(self) -> dict[str, str]:
        return {}

    def argv(self, prompt: str) -> list[str]:
        raise NotImplementedError

    def after_turn(self, result: TurnResult) -> None:
        """Learn the session id from the first turn's output when the client picks it itself."""

    def reported_error(self, stdout: str) -> str | None:
        """The error this client reported in its own output for a turn, or None (none, or not one it reports)."""
        return None

    def is_capped(self, error: str) -> bool:
        """True when `error` is the client giving up because its answers stopped at the answer cap."""
        return False

    # --- running -----------------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(_DROP_PREFIXES) and k not in _DROP_NAMES}
        # PWD too: Bun-built clients (OpenCode) report $PWD, not the process's cwd, as the working directory.
        env.update({"HOME": str(self.home), "PWD": str(self.project), "XDG_CONFIG_HOME": str(self.home / ".config"),
                    "XDG_DATA_HOME": str(self.home / ".local" / "share"),
                    "XDG_CACHE_HOME": str(self.home / ".cache"), "XDG_STATE_HOME": str(self.home / ".local" / "state"),
                    "NO_COLOR": "1", "CI": "1", "DO_NOT_TRACK": "1"})
        env.update(self.client_env())
        env.update(self.extra_env)
        return env

    def _new_or_resume(self) -> list[str]:
        """`--session-id NEW` on the first turn, `--resume ID` after (Claude Code and Qwen Code share the flags)."""
        if self.session_id is None:
            self.session_id = str(uuid.uuid4())
            return ["--session-id", self.session_id]
        return ["--resume", self.session_id]

    def run_turn(self, prompt: str, timeout: float = 900.0) -> TurnResult:
        """Run one headless turn to completion (killing the client's process group after `timeout`)."""
        argv = self.argv(prompt)
        started = time.monotonic()
        proc = subprocess.Popen(argv, cwd=self.project, env=self.env(), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            out, err = proc.communicate()
            rc = None
        except BaseException:  # interrupted: never leave a client (or the tools it started) running
            _kill_group(proc.pid)
            raise
        error = self.reported_error(out)
        result = TurnResult(argv, rc, round(time.monotonic() - started, 2), _tail(out), _tail(err), out,
                            error[:ERROR_CHARS] if error else None, bool(error) and self.is_capped(error))
        self.history.append(result)
        self.turns += 1
        self.after_turn(result)
        return result

    def _mkdir(self, *parts: str) -> Path:
        path = self.home.joinpath(*parts)
        path.mkdir(parents=True, exist_ok=True)
        return path


def _json_events(stdout: str) -> list[dict[str, Any]]:
    events = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                events.append(json.loads(line))
    return events


@dataclass
class ClaudeCodeSession(ClientSession):
    """Claude Code (`@anthropic-ai/claude-code`, pinned 2.1.197): Anthropic Messages API, env-configured.

    Point it at a local server (or slotkeeper on :8081) with environment variables only:

        ANTHROPIC_BASE_URL=http://127.0.0.1:8081      # no /v1: it posts to /v1/messages?beta=true
        ANTHROPIC_API_KEY=x                           # any value; sent as `x-api-key`
        ANTHROPIC_MODEL=smollm2 ANTHROPIC_SMALL_FAST_MODEL=smollm2   # also ANTHROPIC_DEFAULT_{HAIKU,SONNET,OPUS}_MODEL
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_TELEMETRY=1 DISABLE_ERROR_REPORTING=1
        DISABLE_AUTOUPDATER=1 DISABLE_BUG_COMMAND=1
        CLAUDE_CODE_MAX_OUTPUT_TOKENS=32 CLAUDE_CODE_MAX_CONTEXT_TOKENS=32768 DISABLE_AUTO_COMPACT=1
        API_TIMEOUT_MS=900000                         # a cold 20K-token prefill on a CPU takes minutes
        CLAUDE_CONFIG_DIR=<dir>                       # instead of ~/.claude

    Turns: `claude -p --output-format json --model smollm2 --session-id <uuid> PROMPT`, later turns
    `--resume <uuid>`. `attribution_header=False` sets `CLAUDE_CODE_ATTRIBUTION_HEADER=0`, which removes the
    per-session billing line from the system prompt (see docs/clients.md).

    A failed turn exits 1 with an empty stderr: the error is the JSON result on stdout (`"is_error": true`,
    its `result` the message). When an answer stops at `max_tokens`, Claude Code resumes it up to three times;
    if the last one stops there too, the turn ends with "API Error: Claude's response exceeded the N output
    token maximum" (`is_capped`), which a tiny cap makes common and says nothing about the server.
    """

    CAP_ERROR: ClassVar[str] = "output token maximum"

    attribution_header: bool = True
    name: ClassVar[str] = "claude-code"
    package: ClassVar[str] = "@anthropic-ai/claude-code"
    version: ClassVar[str] = "2.1.197"
    bin_relpath: ClassVar[str] = "node_modules/.bin/claude"

    def client_env(self) -> dict[str, str]:
        env = {"ANTHROPIC_BASE_URL": base_root(self.base_url), "ANTHROPIC_API_KEY": "x",
               "ANTHROPIC_MODEL": self.model, "ANTHROPIC_SMALL_FAST_MODEL": self.model,
               "ANTHROPIC_DEFAULT_HAIKU_MODEL": self.model, "ANTHROPIC_DEFAULT_SONNET_MODEL": self.model,
               "ANTHROPIC_DEFAULT_OPUS_MODEL": self.model, "CLAUDE_CONFIG_DIR": str(self.home / ".claude"),
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
               "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_BUG_COMMAND": "1",
               "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(self.max_tokens),
               "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(self.context_window), "DISABLE_AUTO_COMPACT": "1",
               "API_TIMEOUT_MS": "900000"}
        if not self.attribution_header:
            env["CLAUDE_CODE_ATTRIBUTION_HEADER"] = "0"
        return env

    def argv(self, prompt: str) -> list[str]:
        argv = [str(self.ensure_installed()), "-p", "--output-format", "json", "--model", self.model]
        return [*argv, *self._new_or_resume(), *self.extra_args, prompt]

    def reported_error(self, stdout: str) -> str | None:
        """The last `result` event's error: its `result` text (an "API Error: ..." message) when the turn
        completed with an error, else its `subtype` (`error_max_turns`, `error_during_execution`) and `errors`."""
        results = [e for e in _json_events(stdout) if e.get("type") == "result"]
        if not results:
            return None
        last = results[-1]
        subtype = str(last.get("subtype") or "")
        if subtype == "success":
            return str(last.get("result") or "is_error") if last.get("is_error") else None
        return " ".join([subtype or "error", *(str(e) for e in last.get("errors") or [])])

    def is_capped(self, error: str) -> bool:
        return self.CAP_ERROR in error


@dataclass
class OpenCodeSession(ClientSession):
    """OpenCode (`opencode-ai`, pinned 1.18.33): OpenAI-compatible provider from its config file.

    Point it at a local server with `$XDG_CONFIG_HOME/opencode/opencode.json` (or `OPENCODE_CONFIG=<file>`):

        {"$schema": "https://opencode.ai/config.json",
         "provider": {"llama": {"npm": "@ai-sdk/openai-compatible", "name": "llama",
                                "options": {"baseURL": "http://127.0.0.1:8081/v1", "apiKey": "x"},
                                "models": {"smollm2": {"name": "smollm2",
                                                       "limit": {"context": 32768, "output": 32}}}}},
         "model": "llama/smollm2", "small_model": "llama/smollm2",
         "autoupdate": false, "share": "disabled"}

    plus `OPENCODE_DISABLE_AUTOUPDATE=1 OPENCODE_DISABLE_MODELS_FETCH=1 OPENCODE_DISABLE_LSP_DOWNLOAD=1
    OPENCODE_DISABLE_SHARE=1 OPENCODE_DISABLE_DEFAULT_PLUGINS=1` to keep it off the network. On every start
    it also installs `@opencode-ai/plugin` from the npm registry into the config dir, in the background and
    with no switch to stop it (a failure is only a logged warning); `npm_config_registry` pointing at a
    closed loopback port makes that fail at once, so runs stay hermetic on a connected machine. Turns:
    `opencode run --format json -m llama/smollm2 PROMPT`; the first turn's JSON events carry the
    `sessionID`, later turns add `--session <id>`.
    """

    name: ClassVar[str] = "opencode"
    package: ClassVar[str] = "opencode-ai"
    version: ClassVar[str] = "1.18.33"
    bin_relpath: ClassVar[str] = "node_modules/.bin/opencode"

    def config(self) -> dict[str, Any]:
        return {"$schema": "https://opencode.ai/config.json",
                "provider": {"llama": {
                    "npm": "@ai-sdk/openai-compatible", "name": "llama",
                    "options": {"baseURL": openai_base(self.base_url), "apiKey": "x"},
                    "models": {self.model: {"name": self.model,
                                            "limit": {"context": self.context_window,
                                                      "output": self.max_tokens}}}}},
                "model": f"llama/{self.model}", "small_model": f"llama/{self.model}",
                "autoupdate": False, "share": "disabled"}

    def write_config(self) -> None:
        path = self._mkdir(".config", "opencode") / "opencode.json"
        path.write_text(json.dumps(self.config(), indent=2))

    def client_env(self) -> dict[str, str]:
        return {"OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
                "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_SHARE": "1",
                "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1", "npm_config_registry": "http://127.0.0.1:9/"}

    def argv(self, prompt: str) -> list[str]:
        argv = [str(self.ensure_installed()), "run", "--format", "json", "-m", f"llama/{self.model}"]
        if self.session_id is not None:
            argv += ["--session", self.session_id]
        return [*argv, *self.extra_args, prompt]

    def after_turn(self, result: TurnResult) -> None:
        if self.session_id is None:
            for event in _json_events(result.stdout):
                sid = event.get("sessionID") or (event.get("part") or {}).get("sessionID")
                if sid:
                    self.session_id = sid
                    return


@dataclass
class CodexSession(ClientSession):
    """Codex CLI (`@openai/codex`, pinned 0.171.0): Responses API, configured by `$CODEX_HOME/config.toml`.

    Point it at a local server with this config.toml (`CODEX_HOME=<dir>`, default `~/.codex`):

        model = "smollm2"
        model_provider = "llama"
        model_context_window = 32768
        check_for_update_on_startup = false
        sandbox_mode = "read-only"
        [model_providers.llama]
        name = "llama"
        base_url = "http://127.0.0.1:8081/v1"   # it posts to /v1/responses
        wire_api = "responses"
        [analytics]
        enabled = false
        [feedback]
        enabled = false

    Codex has no setting that caps the answer (its requests carry no `max_output_tokens`), so give the
    server a default cap (`llama-server -n 32`, `ServerConfig(n_predict=32)`) or it generates until EOS.
    The provider's `request_max_retries`/`stream_max_retries` are 0 and `stream_idle_timeout_ms` is long so
    a slow CPU prefill is neither retried nor abandoned. Turns: `codex exec --json --skip-git-repo-check
    PROMPT` (stdin closed); the `thread.started` event names the thread, later turns run
    `codex exec resume <thread_id> --json --skip-git-repo-check PROMPT`.
    """

    name: ClassVar[str] = "codex"
    package: ClassVar[str] = "@openai/codex"
    version: ClassVar[str] = "0.171.0"
    bin_relpath: ClassVar[str] = "node_modules/.bin/codex"

    def config_toml(self) -> str:
        return "\n".join([
            f'model = "{self.model}"', 'model_provider = "llama"',
            f"model_context_window = {self.context_window}",
            "check_for_update_on_startup = false", 'sandbox_mode = "read-only"', "",
            "[model_providers.llama]", 'name = "llama"', f'base_url = "{openai_base(self.base_url)}"',
            'wire_api = "responses"', "request_max_retries = 0", "stream_max_retries = 0",
            "stream_idle_timeout_ms = 900000", "",
            "[analytics]", "enabled = false", "", "[feedback]", "enabled = false", ""])

    def write_config(self) -> None:
        (self._mkdir(".codex") / "config.toml").write_text(self.config_toml())

    def client_env(self) -> dict[str, str]:
        return {"CODEX_HOME": str(self.home / ".codex")}

    def argv(self, prompt: str) -> list[str]:
        binary = str(self.ensure_installed())
        if self.session_id is None:
            return [binary, "exec", "--json", "--skip-git-repo-check", *self.extra_args, prompt]
        return [binary, "exec", "resume", self.session_id, "--json", "--skip-git-repo-check", *self.extra_args,
                prompt]

    def after_turn(self, result: TurnResult) -> None:
        if self.session_id is None:
            for event in _json_events(result.stdout):
                if event.get("type") == "thread.started" and event.get("thread_id"):
                    self.session_id = event["thread_id"]
                    return

    def reported_error(self, stdout: str) -> str | None:
        """The last `turn.failed` event's `error.message`, else the last `error` event's `message`."""
        events = _json_events(stdout)
        failed = [e.get("error") for e in events if e.get("type") == "turn.failed"]
        if failed:
            return str(failed[-1].get("message") if isinstance(failed[-1], dict) else failed[-1] or "turn.failed")
        errors = [e.get("message") for e in events if e.get("type") == "error"]
        return str(errors[-1] or "error") if errors else None


@dataclass
class QwenCodeSession(ClientSession):
    """Qwen Code (`@qwen-code/qwen-code`, pinned 0.15.10): OpenAI chat completions, env + settings.json.

    Point it at a local server with environment variables

        OPENAI_BASE_URL=http://127.0.0.1:8081/v1 OPENAI_API_KEY=x OPENAI_MODEL=smollm2

    and `~/.qwen/settings.json` (here under the throw-away HOME):

        {"security": {"auth": {"selectedType": "openai"}},
         "model": {"name": "smollm2",
                   "generationConfig": {"timeout": 900000, "contextWindowSize": 32768,
                                        "samplingParams": {"max_tokens": 32}}},
         "general": {"enableAutoUpdate": false},
         "privacy": {"usageStatisticsEnabled": false},
         "telemetry": {"enabled": false}}

    (`generationConfig.timeout` matters: the default 120 s fires during a slow first prefill and the
    client retries the whole request). Turns: `qwen --session-id <uuid> -o json PROMPT`, later turns
    `qwen --resume <uuid> -o json PROMPT`.
    """

    name: ClassVar[str] = "qwen-code"
    package: ClassVar[str] = "@qwen-code/qwen-code"
    version: ClassVar[str] = "0.15.10"
    bin_relpath: ClassVar[str] = "node_modules/.bin/qwen"

    def settings(self) -> dict[str, Any]:
        return {"security": {"auth": {"selectedType": "openai"}},
                "model": {"name": self.model,
                          "generationConfig": {"timeout": 900_000, "contextWindowSize": self.context_window,
                                               "samplingParams": {"max_tokens": self.max_tokens}}},
                "general": {"enableAutoUpdate": False},
                "privacy": {"usageStatisticsEnabled": False},
                "telemetry": {"enabled": False}}

    def write_config(self) -> None:
        (self._mkdir(".qwen") / "settings.json").write_text(json.dumps(self.settings(), indent=2))

    def client_env(self) -> dict[str, str]:
        return {"OPENAI_BASE_URL": openai_base(self.base_url), "OPENAI_API_KEY": "x", "OPENAI_MODEL": self.model,
                "QWEN_CODE_MAX_OUTPUT_TOKENS": str(self.max_tokens), "QWEN_TELEMETRY_ENABLED": "false"}

    def argv(self, prompt: str) -> list[str]:
        argv = [str(self.ensure_installed()), "-o", "json"]
        return [*argv, *self._new_or_resume(), *self.extra_args, prompt]


@dataclass
class AiderSession(ClientSession):
    """aider (`aider-chat`, pinned 0.86.2 in tools/aider/requirements.txt, venv tools/aider/.venv).

    Point it at a local server with command-line flags (or the same keys in `.aider.conf.yml`):

        aider --model openai/smollm2 --openai-api-base http://127.0.0.1:8081/v1 --openai-api-key x \\
              --no-check-update --no-show-release-notes --analytics-disable --no-git --yes-always \\
              --no-auto-lint --no-auto-test --map-tokens 0 --message PROMPT

    with `LITELLM_LOCAL_MODEL_COST_MAP=True` so litellm does not download its price list, and a
    `--model-metadata-file` that names the model (`{"openai/smollm2": {"max_input_tokens": 32768, ...}}`):
    without it aider tries to fetch litellm's model list from GitHub on every start (offline it prints the
    resolver error and goes on with default limits). The answer cap goes in a `--model-settings-file`:
    `- name: openai/smollm2` with `extra_params: {max_tokens: 32}`. aider has no session id: a session is
    its chat-history file, restored on later turns with `--restore-chat-history`.
    """

    name: ClassVar[str] = "aider"
    package: ClassVar[str] = "aider-chat"
    version: ClassVar[str] = "0.86.2"
    bin_relpath: ClassVar[str] = ".venv/bin/aider"

    @classmethod
    def ensure_installed(cls, timeout: float = 900.0) -> Path:
        """Create tools/aider/.venv from the pinned requirements.txt when it is missing."""
        if cls.binary().exists():
            return cls.binary()
        venv = cls.tool_dir() / ".venv"
        python = shutil.which("python3.11") or shutil.which("python3.12") or sys.executable
        lock = cls.tool_dir() / "requirements.txt"
        steps = [[python, "-m", "venv", str(venv)],
                 [str(venv / "bin" / "pip"), "install", "-q", "--no-deps", "-r", str(lock)]]
        for argv in steps:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
            if proc.returncode != 0:
                raise ClientUnavailable(f"`{' '.join(argv)}` failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        return cls.binary()

    def write_config(self) -> None:
        settings = [{"name": f"openai/{self.model}", "extra_params": {"max_tokens": self.max_tokens}}]
        (self.home / "aider.model.settings.yml").write_text(json.dumps(settings))  # JSON is valid YAML
        metadata = {f"openai/{self.model}": {
            "max_input_tokens": self.context_window, "max_tokens": self.context_window,
            "max_output_tokens": self.max_tokens, "input_cost_per_token": 0.0, "output_cost_per_token": 0.0,
            "litellm_provider": "openai", "mode": "chat"}}
        (self.home / "aider.model.metadata.json").write_text(json.dumps(metadata))

    def client_env(self) -> dict[str, str]:
        return {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "AIDER_ANALYTICS": "false"}

    def argv(self, prompt: str) -> list[str]:
        if self.session_id is None:
            self.session_id = uuid.uuid4().hex
        history = self.home / f"aider-{self.session_id}.chat.history.md"
        argv = [str(self.ensure_installed()), "--model", f"openai/{self.model}",
                "--openai-api-base", openai_base(self.base_url), "--openai-api-key", "x",
                "--no-check-update", "--no-show-release-notes", "--analytics-disable", "--no-git", "--yes-always",
                "--no-auto-lint", "--no-auto-test", "--map-tokens", "0", "--no-pretty",
                "--chat-history-file", str(history), "--input-history-file", str(self.home / "aider.input"),
                "--max-chat-history-tokens", str(self.context_window),
                "--model-settings-file", str(self.home / "aider.model.settings.yml"),
                "--model-metadata-file", str(self.home / "aider.model.metadata.json")]
        if self.turns > 0:
            argv.append("--restore-chat-history")
        return [*argv, *self.extra_args, "--message", prompt]


CLIENTS: dict[str, type[ClientSession]] = {
    cls.name: cls for cls in (ClaudeCodeSession, OpenCodeSession, CodexSession, QwenCodeSession, AiderSession)}
