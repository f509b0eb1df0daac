"""Seeded, deterministic coding-agent conversations for the benchmark.

Why generated content: every configuration must send byte-identical conversations, otherwise the prefill
numbers are not comparable. So nothing here depends on model output: assistant turns (tool calls or short
text) and tool outputs (code/log-like text) are drawn from a `random.Random(seed)`, and a session's whole
request script is fixed before the first request is sent.

Shape (what a real agent does to a llama-server KV cache):
* every session shares one ~800-token system prompt that describes 4 tools (also sent as `tools`);
* each session's first user message differs (that is what tells sessions apart on the wire);
* each turn appends an assistant message and a 100-300-token tool output, so prompts only grow;
* optionally, halfway through, a subagent runs a fresh 3-turn conversation (same system prompt, a new
  first user message) while the parent waits; the parent then resumes its own, longer conversation.

Token sizes are estimated from characters (`CHARS_PER_TOKEN`, calibrated on SmolLM2's tokenizer for each
kind of text), so the generator needs no server.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass, field
from typing import Any

# Characters per token, measured with llama-server /tokenize (SmolLM2) on this generator's own output
# (log lines are digit-heavy, and SmolLM2 tokenizes digits one by one).
CHARS_PER_TOKEN = {"prose": 4.3, "code": 2.9, "log": 1.7, "test": 2.5}

TOOL_OUTPUT_TOKENS = (100, 300)
THINK_S = (0.5, 2.0)
START_STAGGER_S = (0.0, 1.0)
SYSTEM_PROMPT_TOKENS = 800


@dataclass(frozen=True)
class RequestSpec:
    """One request of a session script: the full message list to send, and the think time before it."""

    session: str
    index: int
    think_s: float
    messages: list[dict[str, Any]]


@dataclass
class SessionScript:
    """A session's requests, strictly sequential (a subagent's requests are inlined: the parent waits).

    `forks[i]`: child scripts (subagents) that start together before `requests[i]` and all finish before it
    is sent, as an agent that runs several subagents at once and waits for their reports."""

    id: str
    requests: list[RequestSpec] = field(default_factory=list)
    forks: dict[int, list[SessionScript]] = field(default_factory=dict)

    def all_requests(self) -> list[RequestSpec]:
        """This script's requests and its children's, depth first (children before the request they block)."""
        out: list[RequestSpec] = []
        for i, spec in enumerate(self.requests):
            for child in self.forks.get(i, []):
                out += child.all_requests()
            out.append(spec)
        return out


@dataclass
class Workload:
    name: str
    seed: int
    tools: list[dict[str, Any]]
    sessions: list[SessionScript]
    max_tokens: int
    route: str = "chat"  # "chat": /v1/chat/completions; "messages": Anthropic /v1/messages

    @property
    def path(self) -> str:
        return "/v1/messages" if self.route == "messages" else "/v1/chat/completions"

    def body(self, spec: RequestSpec, *, stream: bool = True) -> dict[str, Any]:
        """The request body for `spec`, as a streaming agent client (pi, OpenCode; Claude Code) sends it."""
        if self.route == "messages":
            return anthropic_body(spec.messages, self.tools, self.max_tokens, stream)
        body: dict[str, Any] = {"model": "smollm2", "messages": spec.messages, "tools": self.tools,
                                "max_tokens": self.max_tokens, "temperature": 0.0}
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    def requests(self) -> list[RequestSpec]:
        return [r for s in self.sessions for r in s.all_requests()]

    def by_key(self) -> dict[tuple[str, int], RequestSpec]:
        return {(r.session, r.index): r for r in self.requests()}


@dataclass(frozen=True)
class WorkloadSpec:
    """A registry entry: defaults for `generate`, or why the workload cannot run yet."""

    name: str
    sessions: int
    turns: int  # requests per main conversation (the subagent's come on top)
    subagents: bool
    description: str
    not_wired: str | None = None
    configs: tuple[str, ...] | None = None  # the configurations a default run gives it (None: all of them)
    servers: int = 1  # llama-servers behind the proxy (`slots_upstreams`); `stock` is then a round-robin balancer
    slots: int = 4  # slots per server


# Sizes are the time budget: `make bench` must finish in < 10 min on 2 cores, and SmolLM2 prefill runs at
# only ~100 tokens/s per llama.cpp thread there (measured). With 4 main turns and fits at 3, the full run
# took 17.6 min on 1 thread; 3 main turns (1 before the subagent, 2 after) keep the interesting request
# (the parent resuming after its subagent). `fits` is a no-pressure sanity check: 2 turns suffice.
WORKLOADS: dict[str, WorkloadSpec] = {w.name: w for w in [
    WorkloadSpec("agents", 6, 3, True, "6 concurrent agent sessions on 4 slots, each with a 3-turn subagent"),
    WorkloadSpec("fits", 3, 2, False, "3 concurrent agent sessions on 4 slots, no subagents"),
    # A newcomer's setup: one session more than slots and no --slot-save-path (most users start llama-server
    # without one), so nothing can be paged: what each placement writes over is lost.
    WorkloadSpec("crowd", 3, 6, False, "3 concurrent agent sessions on 2 slots, no subagents, no save dir",
                 configs=("stock", "defaults"), slots=2),
    WorkloadSpec("pi", 3, 2, False, "3 concurrent real pi sessions (bench/pi_workload.py)"),
    WorkloadSpec("anthropic", 6, 3, True, "the agents workload sent as Anthropic Messages requests "
                 "(/v1/messages, as Claude Code does)", configs=("stock", "auto", "auto+ckpt")),
    WorkloadSpec("generic", 6, 3, True, "like agents, but the system prompt has no known marker and each session "
                 "adds its own environment block (working directory, date) after the shared part",
                 configs=("stock", "auto", "auto+ckpt")),
    # Shapes drawn from the seed (bench/subagent_workload.py): sizes are per-seed, not the fields above.
    WorkloadSpec("subagents", 0, 0, True, "main sessions that start parallel subagents and wait for them, no known "
                 "marker, a per-session environment block; shapes from the seed (bench/subagent_workload.py)",
                 configs=("stock", "auto", "auto+ckpt")),
    WorkloadSpec("subagents-2x2", 0, 0, True, "the subagents traffic on 2 llama-servers x 2 slots behind one "
                 "proxy (`stock`: a round-robin balancer)", configs=("stock", "auto", "auto+ckpt"),
                 servers=2, slots=2),
    # Real agent clients (bench/client_workloads.py): 3 sessions x 2 turns each, on 2 slots of a long-context
    # server; `stock` there is the proxy observing only. Sizes and the default run: docs/performance.md.
    *(WorkloadSpec(f"client-{c}", 3, 2, False, f"3 sessions x 2 turns of the real {c} client in one project "
                   "on 2 slots (bench/client_workloads.py)", configs=("stock", "auto", "auto+ckpt"))
      for c in ("claude-code", "opencode", "codex", "qwen-code", "aider")),
    # Several real clients at once on fewer slots than sessions (bench/mix_workload.py: the mixes' shapes).
    WorkloadSpec("mix-4", 2, 2, False, "4 real clients x 2 sessions x 2 turns at once on 3 slots "
                 "(bench/mix_workload.py)", configs=("stock", "auto+ckpt")),
    WorkloadSpec("mix-3", 1, 2, False, "3 real clients x 1 session x 2 turns at once on 2 slots "
                 "(bench/mix_workload.py)", configs=("stock", "auto+ckpt")),
]}


# ------------------------------------------------------------------------------------------------ tools

def _tool(name: str, description: str, props: dict[str, tuple[str, str]], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description, "strict": False,
        "parameters": {"type": "object", "required": required,
                       "properties": {k: {"type": t, "description": d} for k, (t, d) in props.items()}}}}


TOOLS: list[dict[str, Any]] = [
    _tool("read", "Read the contents of a file. Output is truncated to 2000 lines; use offset and limit "
          "to page through large files. Images are returned as attachments.",
          {"path": ("string", "Path of the file to read, relative to the working directory or absolute"),
           "offset": ("number", "Line number to start reading from (1-indexed)"),
           "limit": ("number", "Maximum number of lines to read")}, ["path"]),
    _tool("bash", "Execute a bash command in the working directory. Returns stdout and stderr, truncated "
          "to the last 2000 lines or 50KB. Use it for builds, tests, git and file search.",
          {"command": ("string", "The bash command to execute"),
           "timeout": ("number", "Timeout in seconds (optional, no default timeout)")}, ["command"]),
    _tool("edit", "Edit a file by replacing exact text. The old text must match exactly, including "
          "whitespace, and must be unique in the file. Use it for precise, surgical edits.",
          {"path": ("string", "Path of the file to edit"),
           "oldText": ("string", "Exact text to find and replace (must match exactly)"),
           "newText": ("string", "New text to replace the old text with")}, ["path", "oldText", "newText"]),
    _tool("write", "Write content to a file. Creates the file if it does not exist, overwrites it if it "
          "does, and creates parent directories automatically.",
          {"path": ("string", "Path of the file to write"),
           "content": ("string", "Content to write to the file")}, ["path", "content"]),
]

_GUIDELINES = [
    "Use bash for file operations like ls, rg and find before reading whole directories.",
    "Use read to examine files before editing them; never guess at the contents of a file.",
    "Use edit for precise changes, where the old text must match exactly, including indentation.",
    "Use write only for new files or complete rewrites of small files.",
    "When summarizing your actions, output plain text directly; do not use cat or bash to display what you did.",
    "Be concise in your responses and show file paths clearly when working with files.",
    "Prefer small, verifiable steps: run the relevant tests after each change and read the failures carefully.",
    "Never commit, push or rewrite git history unless the user explicitly asks you to.",
    "Respect the existing code style of the project: naming, formatting, imports and error handling.",
    "If a command fails, read its output and fix the cause instead of retrying the same command blindly.",
    "Keep the user informed about what you are doing with short status updates between tool calls.",
    "Do not add dependencies without asking; check the lock file and the build configuration first.",
    "Ask for clarification when the request is ambiguous rather than making large assumptions.",
    "Long outputs are truncated; use head, tail or grep to narrow them down before reading them.",
    "When tests are slow, run only the affected test module first and the full suite at the end.",
    "Document non-obvious decisions in code comments that explain why, not what.",
    "Treat files under vendor/, node_modules/ and build/ as read-only unless told otherwise.",
    "Secrets must never be printed, logged or written to files; redact them in any output you show.",
    "Use absolute paths in tool calls when the working directory may have changed.",
    "When editing configuration, validate it with the project's own checker before finishing.",
]


def generic_system_prompt(rng: random.Random, target_tokens: int = SYSTEM_PROMPT_TOKENS) -> str:
    """The shared part of a coding agent's system prompt that uses no marker slotkeeper knows (role, tools,
    guidelines, conventions); `environment` adds the per-session part after it, as most clients do."""
    parts = ["You are an autonomous software engineering agent. You help the user with their repository by "
             "reading files, running commands, editing code and writing new files.", "", "# Tools"]
    for t in TOOLS:
        f = t["function"]
        parts.append(f"## {f['name']}")
        parts.append(f"{f['description']}")
        parts.append(f"Parameters: {json.dumps(f['parameters']['properties'], separators=(',', ':'))}")
    parts += ["", "# Rules"]
    parts += [f"- {g}" for g in _GUIDELINES[:12]]
    parts += ["", "# Conventions of this workspace"]
    text = "\n".join(parts)
    while len(text) / CHARS_PER_TOKEN["prose"] < target_tokens - 60:
        text += "\n" + _code_line(rng, "conventions")
    return text


def environment(session: int, rng: random.Random) -> str:
    """A session's own environment block: its working directory and the day it started."""
    return (f"\n\n# Environment\nWorking directory: /home/dev/projects/{rng.choice(_MODULES)}-{session}\n"
            f"Platform: linux\nToday's date: 2026-11-{rng.randint(1, 30):02d}\nIs a git repository: yes")


def system_prompt(rng: random.Random, target_tokens: int = SYSTEM_PROMPT_TOKENS) -> str:
    """An agent system prompt in pi's layout: role, tool list, guidelines, project context, cwd."""
    parts = ["You are an expert coding assistant operating inside pi, a coding agent harness. You help "
             "users by reading files, executing commands, editing code, and writing new files.",
             "", "<tools>"]
    for t in TOOLS:
        f = t["function"]
        parts.append(f"- {f['name']}: {f['description']}")
        parts.append(f"  parameters: {json.dumps(f['parameters']['properties'], separators=(',', ':'))}")
    parts += ["</tools>", "", "Guidelines:"]
    parts += [f"- {g}" for g in _GUIDELINES]
    parts += ["", "<project_context>"]
    text = "\n".join(parts)
    while len(text) / CHARS_PER_TOKEN["prose"] < target_tokens - 30:
        text += "\n" + _code_line(rng, "conventions")
    return text + "\n</project_context>\n<cwd>/home/dev/projects/orbit</cwd>"


# --------------------------------------------------------------------------------------- text generators

_MODULES = ["scheduler", "cache", "router", "storage", "auth", "parser", "metrics", "worker", "client",
            "config", "planner", "index", "session", "codec", "queue", "registry"]
_FUNCS = ["handle_request", "load_config", "flush", "resolve_path", "retry_with_backoff", "encode_batch",
          "validate", "acquire_lock", "evict_oldest", "parse_header", "compute_digest", "open_stream",
          "merge_ranges", "schedule_next", "serialize", "apply_patch"]
_WORDS = ["timeout", "buffer", "offset", "token", "slot", "prefix", "handle", "request", "payload", "entry",
          "record", "result", "limit", "window", "counter", "state", "owner", "digest", "chunk", "item"]
_LEVELS = ["INFO", "INFO", "INFO", "DEBUG", "WARN", "ERROR"]
_TASKS = ["Fix the flaky test in tests/test_{m}.py that fails about one run in ten",
          "Add a --dry-run flag to the {m} command and document it",
          "The {m} module leaks file handles under load; find and fix the leak",
          "Refactor {m}.{f} so it no longer mutates its argument",
          "Add type hints to src/orbit/{m}.py and make mypy pass",
          "Port the {m} retry logic to asyncio without changing its behaviour",
          "Write unit tests for {m}.{f}, covering the error paths",
          "Investigate why {m} is slow on large inputs and propose a fix"]
_SUBTASKS = ["Search the codebase for every caller of {m}.{f} and summarise how each uses the result",
             "Read tests/test_{m}.py and list which behaviours of {f} are not covered",
             "Find where {m} reads its configuration and report the defaults"]


def _ident(rng: random.Random) -> str:
    return f"{rng.choice(_WORDS)}_{rng.choice(_WORDS)}"


def _code_line(rng: random.Random, kind: str) -> str:
    m, f, w = rng.choice(_MODULES), rng.choice(_FUNCS), _ident(rng)
    n = rng.randint(1, 999)
    if kind == "log":
        return (f"2026-11-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:"
                f"{rng.randint(0, 59):02d}.{rng.randint(0, 999):03d}Z {rng.choice(_LEVELS):5} {m}[{n}] "
                f"{f}: {w}={rng.randint(0, 4096)} elapsed={rng.uniform(0, 900):.1f}ms")
    if kind == "test":
        status = rng.choice(["PASSED", "PASSED", "PASSED", "FAILED", "SKIPPED"])
        return f"tests/test_{m}.py::test_{f}_{w} {status} [{rng.randint(1, 100):3d}%]"
    if kind == "conventions":
        return f"- src/orbit/{m}.py: {f}() owns the {w}; callers must not cache it (see issue #{n})."
    indent = " " * (4 * rng.randint(0, 3))
    templates = [f"{indent}def {f}(self, {w}: int = {n}) -> {rng.choice(['int', 'str', 'bool', 'None'])}:",
                 f"{indent}{w} = self._{rng.choice(_WORDS)}.get({w!r}, {n})",
                 f"{indent}if {w} > {n}:",
                 f"{indent}    raise ValueError(f\"{m}: {w} out of range: {{{w}}}\")",
                 f"{indent}return {m}.{f}({w}, timeout={rng.randint(1, 60)})",
                 f"{indent}for {rng.choice(_WORDS)} in self.{w}[:{n}]:",
                 f"{indent}# {rng.choice(_WORDS)} must stay below {n} or the {m} stalls"]
    return rng.choice(templates)


def tool_output(rng: random.Random, tokens: int) -> str:
    """Code, log or test-run text of about `tokens` tokens (estimated by characters)."""
    kind = rng.choice(["code", "log", "test"])
    lines: list[str] = []
    if kind == "code":
        lines.append(f"src/orbit/{rng.choice(_MODULES)}.py")
    while len("\n".join(lines)) / CHARS_PER_TOKEN[kind] < tokens:
        prefix = f"{len(lines) + rng.randint(1, 400):5d}\t" if kind == "code" else ""
        lines.append(prefix + _code_line(rng, kind))
    return "\n".join(lines)


def _fmt(rng: random.Random, template: str) -> str:
    return template.format(m=rng.choice(_MODULES), f=rng.choice(_FUNCS))


def _assistant_turn(rng: random.Random, session: str, turn: int,
                    output_tokens: int) -> list[dict[str, Any]]:
    """An assistant message (tool call, or text) followed by the matching tool or user output."""
    out = tool_output(rng, output_tokens)
    if rng.random() < 0.75:
        name = rng.choice(["read", "bash", "bash", "edit"])
        args = {"read": {"path": f"src/orbit/{rng.choice(_MODULES)}.py"},
                "bash": {"command": rng.choice(["pytest -x -q", "rg -n " + rng.choice(_FUNCS),
                                                "git diff --stat", "make lint"])},
                "edit": {"path": f"src/orbit/{rng.choice(_MODULES)}.py", "oldText": _ident(rng),
                         "newText": _ident(rng)}}[name]
        call_id = f"call_{session}_{turn}_{rng.randrange(16**8):08x}"
        return [{"role": "assistant", "content": None, "tool_calls": [
                    {"id": call_id, "type": "function",
                     "function": {"name": name, "arguments": json.dumps(args)}}]},
                {"role": "tool", "tool_call_id": call_id, "content": out}]
    text = f"I checked {rng.choice(_MODULES)}.{rng.choice(_FUNCS)}; next I will look at the {_ident(rng)}."
    return [{"role": "assistant", "content": text},
            {"role": "user", "content": "Here is the output you asked for:\n" + out}]


def _conversation(rng: random.Random, sid: str, system: str, first_user: str, turns: int,
                  start_index: int, first_think: float) -> list[RequestSpec]:
    """`turns` growing requests of one conversation; request k carries k assistant/output pairs."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                      {"role": "user", "content": first_user}]
    specs: list[RequestSpec] = []
    for k in range(turns):
        if k:
            messages += _assistant_turn(rng, sid, k, rng.randint(*TOOL_OUTPUT_TOKENS))
        think = first_think if k == 0 else rng.uniform(*THINK_S)
        specs.append(RequestSpec(sid, start_index + k, round(think, 3), copy.deepcopy(messages)))
    return specs


def generate(name: str, *, seed: int, sessions: int, turns: int, subagent_turns: int,
             max_tokens: int) -> Workload:
    """Build workload `name` deterministically from `seed`; `subagent_turns=0` means no subagents."""
    rng = random.Random(f"{name}:{seed}")
    shared = (generic_system_prompt if name == "generic" else system_prompt)(random.Random(f"system:{seed}"))
    scripts: list[SessionScript] = []
    for i in range(sessions):
        srng = random.Random(f"{name}:{seed}:session:{i}")
        sid = f"s{i}"
        system = shared + environment(i, srng) if name == "generic" else shared
        first_user = (f"{_fmt(srng, srng.choice(_TASKS))}. Ticket ORB-{1000 + i * 37 + srng.randint(0, 36)}; "
                      f"the relevant code is under src/orbit/. Keep the change minimal.")
        specs = _conversation(srng, sid, system, first_user, turns, 0, round(rng.uniform(*START_STAGGER_S), 3))
        if subagent_turns > 0 and turns >= 2:
            half = turns // 2
            sub_user = (f"You are a subagent of session {sid}. {_fmt(srng, srng.choice(_SUBTASKS))}. "
                        f"Reply with a short report; do not edit files.")
            sub = _conversation(srng, f"{sid}.sub", system, sub_user, subagent_turns, 0,
                                round(srng.uniform(*THINK_S), 3))
            specs = specs[:half] + sub + specs[half:]
        scripts.append(SessionScript(sid, specs))
    return Workload(name, seed, TOOLS, scripts, max_tokens, route="messages" if name == "anthropic" else "chat")


def anthropic_body(messages: list[dict[str, Any]], tools: list[dict[str, Any]], max_tokens: int,
                   stream: bool) -> dict[str, Any]:
    """A chat conversation as the Anthropic Messages request that carries it: the system message as `system`,
    tool calls as `tool_use` blocks, tool outputs as `tool_result` blocks in a user turn."""
    out: list[dict[str, Any]] = []
    for m in messages[1:]:
        if m["role"] == "assistant" and m.get("tool_calls"):
            out.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": json.loads(c["function"]["arguments"])} for c in m["tool_calls"]]})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": m["tool_call_id"],
                                                     "content": m["content"]}]})
        else:
            out.append({"role": m["role"], "content": [{"type": "text", "text": m["content"]}]})
    return {"model": "smollm2", "max_tokens": max_tokens, "temperature": 0.0, "stream": stream,
            "system": [{"type": "text", "text": messages[0]["content"]}], "messages": out,
            "tools": [{"name": t["function"]["name"], "description": t["function"]["description"],
                       "input_schema": t["function"]["parameters"]} for t in tools]}


def approx_tokens(text: str, kind: str = "prose") -> float:
    """Token estimate from characters, for tests and sanity checks without a server."""
    return len(text) / CHARS_PER_TOKEN[kind]
