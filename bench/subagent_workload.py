"""Agent traffic with subagents, drawn from a seed: the `subagents` and `subagents-2x2` workloads.

Why: the hand-shaped `agents` workload runs one subagent at a time, inlined in its parent's script, with a
known system prompt. Real agents (Claude Code's Task tool, OpenCode's subagents) start several subagents at
once and block until all report back, send a system prompt slotkeeper has no marker for, and end it with a
per-session environment block (working directory, date, git status) that differs per session. Every
shape knob comes from the seed (`shape`), so no run is tuned by hand; vary `--seed` to see others.

Knobs per seed: main sessions and how they start (bursts that start at the same instant), turns per main
session, subagent spawns (when, how many in parallel, their turns), whether subagents share the main
system prompt or have their own, environment block size and its position (last in the system prompt, or
followed by a shared closing section), think times and tool output sizes. Content is deterministic per
seed, like `bench.workload`.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass
from typing import Any

from bench.workload import (
    _GUIDELINES,
    _MODULES,
    _SUBTASKS,
    _TASKS,
    CHARS_PER_TOKEN,
    TOOLS,
    RequestSpec,
    SessionScript,
    Workload,
    _assistant_turn,
    _code_line,
    _fmt,
    _ident,
    _tool,
    generic_system_prompt,
    tool_output,
)

TASK_TOOL = _tool("task", "Start a subagent with its own context for a self-contained search or analysis task. "
                  "Several tasks may run at once; each returns a short report.",
                  {"description": ("string", "A short description of the task"),
                   "prompt": ("string", "The full instructions for the subagent")}, ["description", "prompt"])
SUB_ROLE = ("You are a read-only research subagent started by a coding agent. Search and read the repository to "
            "answer the question you are given, then reply with a short, factual report. Never edit files.")


@dataclass(frozen=True)
class Shape:
    """What a seed draws before any content: the knobs of one workload (ranges are inclusive)."""

    mains: int
    bursts: tuple[int, ...]  # main sessions per burst; a burst's sessions send their first request together
    burst_gap_s: tuple[float, float]
    main_turns: tuple[int, int]
    spawn_twice_p: float  # chance a main session spawns subagents a second time
    parallel: tuple[int, int]  # subagents per spawn
    sub_turns: tuple[int, int]
    sub_system: str  # "same": subagents send their parent's system prompt; "own": a shared subagent prompt
    system_tokens: int  # the shared part
    env_tokens: tuple[int, int]
    env_position: str  # "end": last in the system prompt; "before-tail": a shared closing section follows
    tail_tokens: int
    think_s: tuple[float, float]
    output_tokens: tuple[int, int]


def shape(name: str, seed: int) -> Shape:
    """The seed's knobs. Sizes keep one run at a few minutes of SmolLM2 prefill on 2 shared cores."""
    rng = random.Random(f"{name}:shape:{seed}")
    mains = rng.randint(3, 4)
    bursts: list[int] = []
    while sum(bursts) < mains:
        bursts.append(min(rng.randint(1, 3), mains - sum(bursts)))
    env_lo = rng.randint(30, 120)
    think_lo = rng.uniform(0.2, 1.0)
    return Shape(mains=mains, bursts=tuple(bursts), burst_gap_s=(0.5, rng.uniform(1.0, 6.0)),
                 main_turns=(2, rng.randint(3, 4)), spawn_twice_p=rng.choice([0.0, 0.25, 0.5]),
                 parallel=(1, rng.randint(2, 3)), sub_turns=(1, rng.randint(2, 3)),
                 sub_system=rng.choice(["same", "own"]), system_tokens=rng.randint(500, 850),
                 env_tokens=(env_lo, env_lo + rng.randint(20, 180)),
                 env_position=rng.choice(["end", "before-tail"]), tail_tokens=rng.randint(40, 160),
                 think_s=(round(think_lo, 2), round(think_lo + rng.uniform(0.5, 2.5), 2)),
                 output_tokens=(50, rng.randint(100, 200)))


def environment_block(rng: random.Random, session: int, tokens: int) -> str:
    """A session's environment: working directory, platform, date, branch, then git status and recent commits
    until about `tokens` tokens."""
    module = rng.choice(_MODULES)
    lines = ["# Environment", f"Working directory: /home/dev/work/{module}-{session}", "Platform: linux",
             f"OS version: Linux 6.{rng.randint(1, 12)}.{rng.randint(0, 40)}",
             f"Today's date: 2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
             "Is directory a git repo: yes", f"Current branch: fix/{module}-{rng.randint(100, 999)}", "Status:"]
    commits = ["Recent commits:"]
    while len("\n".join(lines + commits)) / CHARS_PER_TOKEN["code"] < tokens:
        if rng.random() < 0.6:
            lines.append(f"{rng.choice([' M', '??', ' D', 'A '])} src/orbit/{rng.choice(_MODULES)}/{_ident(rng)}.py")
        else:
            commits.append(f"{rng.randrange(16**7):07x} {_fmt(rng, rng.choice(_TASKS))[:60]}")
    return "\n".join(lines + commits)


def _tail(rng: random.Random, tokens: int) -> str:
    """A shared closing section after the environment block (reminders, as some clients append)."""
    lines = ["# Reminders"] + [f"- {g}" for g in _GUIDELINES[12:]]
    text = "\n".join(lines)
    while len(text) / CHARS_PER_TOKEN["prose"] < tokens:
        text += "\n" + _code_line(rng, "conventions")
    return text


def _system(shared: str, env: str, tail: str) -> str:
    return shared + "\n\n" + env + ("\n\n" + tail if tail else "")


def _think(rng: random.Random, sh: Shape) -> float:
    return round(rng.uniform(*sh.think_s), 3)


def _subagent(rng: random.Random, sid: str, system: str, turns: int, first_think: float,
              sh: Shape) -> tuple[SessionScript, str]:
    """A subagent's own growing conversation, and the report its parent receives."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                      {"role": "user", "content": f"{_fmt(rng, rng.choice(_SUBTASKS))}. "
                                       f"Reply with a short report; do not edit files. (task {sid})"}]
    specs: list[RequestSpec] = []
    for k in range(turns):
        if k:
            messages += _assistant_turn(rng, sid, k, rng.randint(*sh.output_tokens))
        specs.append(RequestSpec(sid, k, first_think if k == 0 else _think(rng, sh), copy.deepcopy(messages)))
    report = f"Report of {sid}:\n" + tool_output(rng, rng.randint(40, 120))
    return SessionScript(sid, specs), report


def _main_session(rng: random.Random, i: int, sh: Shape, system: str, sub_system: str,
                  first_think: float) -> SessionScript:
    sid = f"m{i}"
    turns = rng.randint(*sh.main_turns)
    spawns = 2 if turns >= 3 and rng.random() < sh.spawn_twice_p else 1
    at = sorted(rng.sample(range(1, turns), spawns))  # a spawn blocks the request at this position
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": (
        f"{_fmt(rng, rng.choice(_TASKS))}. Ticket ORB-{1000 + i * 37 + rng.randint(0, 36)}; start by sending "
        "subagents to research the code, then make the change.")}]
    script = SessionScript(sid)
    n_sub = 0
    for k in range(turns):
        think = first_think if k == 0 else _think(rng, sh)
        if k in at:
            together = round(rng.uniform(0.1, 0.6), 3)  # parallel subagents start at the same instant
            children, calls, results = [], [], []
            for _ in range(rng.randint(*sh.parallel)):
                n_sub += 1
                child, report = _subagent(rng, f"{sid}.a{n_sub}", sub_system, rng.randint(*sh.sub_turns),
                                          together, sh)
                call_id = f"call_{sid}_task{n_sub}_{rng.randrange(16**8):08x}"
                calls.append({"id": call_id, "type": "function", "function": {"name": "task", "arguments":
                              json.dumps({"description": f"research {n_sub}", "prompt": child.requests[0]
                                          .messages[1]["content"]})}})
                results.append({"role": "tool", "tool_call_id": call_id, "content": report})
                children.append(child)
            script.forks[k] = children
            messages += [{"role": "assistant", "content": None, "tool_calls": calls}, *results]
        elif k:
            messages += _assistant_turn(rng, sid, k, rng.randint(*sh.output_tokens))
        script.requests.append(RequestSpec(sid, k, think, copy.deepcopy(messages)))
    return script


def generate(name: str, *, seed: int, max_tokens: int) -> Workload:
    """Workload `name` (`subagents`, `subagents-2x2`: the same traffic) for `seed`, deterministically."""
    sh = shape(name.split("-")[0], seed)
    rng = random.Random(f"{name.split('-')[0]}:{seed}")
    shared = generic_system_prompt(random.Random(f"system:{seed}"), sh.system_tokens)
    tail = _tail(random.Random(f"tail:{seed}"), sh.tail_tokens) if sh.env_position == "before-tail" else ""
    sub_shared = SUB_ROLE + "\n\n" + shared.split("\n", 1)[1] if sh.sub_system == "own" else shared
    starts: list[float] = []
    t = 0.0
    for b, size in enumerate(sh.bursts):
        t = 0.0 if b == 0 else round(t + rng.uniform(*sh.burst_gap_s), 3)
        starts += [t] * size
    sessions = []
    for i in range(sh.mains):
        srng = random.Random(f"{name.split('-')[0]}:{seed}:main:{i}")
        env = environment_block(srng, i, srng.randint(*sh.env_tokens))
        sessions.append(_main_session(srng, i, sh, _system(shared, env, tail), _system(sub_shared, env, tail),
                                      starts[i]))
    return Workload(name, seed, [*TOOLS, TASK_TOOL], sessions, max_tokens)
