"""A failed client turn names its error next to its exit code (bench/real/clients.py), so a bench log line says why.

Claude Code exits 1 with an empty stderr: its error is the JSON result on stdout. Under the bench's 16-token cap
most failed turns are Claude Code giving up after three "Output token limit hit" resumes of answers cut at
`max_tokens` (bench mix-4: 2 of 4 turns on stock and 3 of 4 through the proxy exited 1 that way, every answer a
200 with `stop_reason: max_tokens`); such a turn is `capped`, not a failure of the server or the proxy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.real.clients import ClaudeCodeSession, CodexSession, TurnResult

# The result line Claude Code 2.1.197 printed (`-p --output-format json`) for a turn whose four answers all
# stopped at max_tokens 16, fields cut to the ones read here; stderr was empty and the exit code 1.
CAPPED = {"type": "result", "subtype": "success", "is_error": True, "api_error_status": None, "num_turns": 1,
          "stop_reason": "stop_sequence", "terminal_reason": "completed", "session_id": "s-1",
          "result": "API Error: Claude's response exceeded the 16 output token maximum. To configure this "
                    "behavior, set the CLAUDE_CODE_MAX_OUTPUT_TOKENS environment variable."}
ANSWERED = {**CAPPED, "is_error": False, "stop_reason": "end_turn", "result": "A map of keys to values."}


class ScriptedClaude(ClaudeCodeSession):
    """Claude Code's driver with the binary replaced by a script that prints `stdout` and exits `code` (the real
    binary needs a server and cannot be made to fail on demand); everything else is the driver's own path."""

    def __init__(self, tmp: Path, stdout: str, code: int) -> None:
        super().__init__("http://127.0.0.1:9", tmp / "project", tmp / "home")
        self.script = tmp / "claude.py"
        self.script.write_text(f"import sys\nsys.stdout.write({stdout!r})\nsys.exit({code})\n")

    def argv(self, prompt: str) -> list[str]:
        return [sys.executable, str(self.script)]


def run(tmp_path: Path, result: dict, code: int) -> TurnResult:
    return ScriptedClaude(tmp_path, json.dumps(result) + "\n", code).run_turn("a prompt", timeout=60)


def test_claude_code_exit_1_names_its_error_and_marks_the_answer_cap(tmp_path: Path):
    done = run(tmp_path, CAPPED, 1)
    assert (done.returncode, done.stderr_tail, done.capped) == (1, "", True)
    assert done.error is not None and done.error.startswith("API Error: Claude's response exceeded the 16 output")
    assert done.outcome() == "exit 1: " + done.error


def test_claude_code_other_errors_are_not_the_cap(tmp_path: Path):
    server = {**CAPPED, "result": 'API Error: 400 {"type":"error","error":{"type":"invalid_request_error",'
                                  '"message":"the request exceeds the available context size"}}'}
    done = run(tmp_path / "a", server, 1)
    assert done.error and done.error.startswith("API Error: 400") and not done.capped
    turns = {"type": "result", "subtype": "error_max_turns", "is_error": True, "num_turns": 2, "errors": []}
    assert run(tmp_path / "b", turns, 1).error == "error_max_turns"
    long = run(tmp_path / "c", {**CAPPED, "result": "API Error: " + "x" * 5000}, 1)
    assert long.error is not None and len(long.error) == 300  # a log line, not a dump


def test_a_good_turn_has_no_error_and_a_killed_one_says_so(tmp_path: Path):
    done = run(tmp_path, ANSWERED, 0)
    assert (done.error, done.capped, done.outcome()) == (None, False, "exit 0")
    killed = TurnResult([], None, 900.0, "", "")
    assert killed.outcome() == "killed"


def test_codex_names_the_failed_turn(tmp_path: Path):
    session = CodexSession("http://127.0.0.1:9", tmp_path / "project", tmp_path / "home")
    out = "\n".join(json.dumps(e) for e in [
        {"type": "thread.started", "thread_id": "t-1"}, {"type": "turn.started"},
        {"type": "error", "message": "stream disconnected before completion"},
        {"type": "turn.failed", "error": {"message": "stream disconnected before completion: retries exhausted"}}])
    assert session.reported_error(out) == "stream disconnected before completion: retries exhausted"
    assert session.reported_error(json.dumps({"type": "turn.completed", "usage": {}})) is None
    assert not session.is_capped("stream disconnected before completion")
