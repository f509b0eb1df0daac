"""Seeded agent traffic for the simulator: a `Shape` (what the deployment and the sessions look like) drawn
from a seed, or by hypothesis, and `play`, which sends it through a `Rig` with real concurrency.

What agents do to a slot server, and each is here: main sessions that share a long system prompt, with a known
marker (`<cwd>`) or without one and a per-session environment block after the shared part; subagents that run
their own conversation while their parent waits for them; side calls (a title generator) sent beside a turn;
sessions that start together (a burst) or staggered; think times, some past the proxy's TTL; server restarts
(some with a new build); two proxies on one state dir; two servers (`slots_upstreams`); 1-8 slots; paging on
or off (`slots_save_dir`); streamed and whole answers. Content is drawn from the seed only, and an assistant
turn is the simulated server's own answer, as a client would append it.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field, replace
from typing import Any

from bench.sim.harness import Rig, Setup

WORDS = ("read", "file", "src", "main", "py", "def", "return", "value", "test", "error", "line", "import", "module",
         "config", "path", "build", "run", "output", "assert", "class", "list", "dict", "key", "node", "slot",
         "cache", "token", "request", "server", "client", "state", "patch", "diff", "commit", "branch", "check")
SIDE_SYSTEM = "Generate a short title for this conversation. Reply with the title only."


@dataclass(frozen=True)
class SessionShape:
    turns: int                    # requests of the main conversation
    marker: bool                  # the system prompt carries a known marker (`<cwd>`)
    stream: bool
    start: float                  # seconds after the run starts
    think: tuple[float, ...]      # pause before each turn after the first (some past the TTL)
    subagent_at: int | None = None  # the turn after which a subagent runs while this session waits
    subagent_turns: int = 2
    side_calls: tuple[int, ...] = ()  # turns beside which a title call goes out
    proxy: int = 0


@dataclass(frozen=True)
class Shape:
    seed: int
    setup: Setup
    sessions: tuple[SessionShape, ...]
    system_words: int = 120
    output_words: tuple[int, int] = (20, 90)
    restarts: tuple[tuple[float, int, bool], ...] = ()  # (at, server, new build)
    # (at, seconds, server): its `/props` and `/slots` answer only after the proxy's time-out, as a
    # llama-server on a loaded machine did (bench mix-4 on 2 cores)
    stalls: tuple[tuple[float, float, int], ...] = ()

    def describe(self) -> str:
        s = self.setup
        return (f"seed={self.seed} servers={s.servers} slots={s.slots} paging={s.paging} proxies={s.proxies} "
                f"prefill={s.prefill_speed:.0f}tok/s {''.join(f'{k}={v} ' for k, v in s.options)}"
                f"unified={s.unified} ttl={s.ttl} sessions={len(self.sessions)} "
                f"requests={self.requests} restarts={len(self.restarts)} stalls={len(self.stalls)}")

    @property
    def requests(self) -> int:
        return sum(x.turns + (x.subagent_turns if x.subagent_at is not None else 0) + len(x.side_calls)
                   for x in self.sessions)


def shape_from_seed(seed: int, *, max_sessions: int = 6, load: bool = True, stalls: bool = True) -> Shape:
    """A workload's shape, drawn from `seed` alone (the sweep's seeds; a failing one is its reproduction).
    `load=False`: never a loaded server, `stalls=False`: no stall (the shapes as drawn before those draws
    existed, for older regressions)."""
    rng = random.Random(seed)
    servers = 2 if rng.random() < 0.2 else 1
    slots = rng.randint(1, 4 if servers == 2 else 8)
    setup = Setup(servers=servers, slots=slots, paging=rng.random() < 0.6,
                  proxies=2 if rng.random() < 0.2 else 1, unified=rng.random() < 0.05,
                  ttl=rng.choice((30, 60, 120)))
    burst = rng.random() < 0.4
    n = rng.randint(1, max_sessions)
    all_marker = rng.choice((True, False, None))
    sessions = []
    for _ in range(n):
        turns = rng.randint(1, 4)
        think = tuple(setup.ttl + rng.uniform(5, 60) if rng.random() < 0.1 else rng.uniform(0.1, 3.0)
                      for _ in range(turns - 1))
        sessions.append(SessionShape(
            turns=turns, marker=all_marker if all_marker is not None else rng.random() < 0.5,
            stream=rng.random() < 0.7, start=0.0 if burst else rng.uniform(0, 3), think=think,
            subagent_at=rng.randrange(turns) if rng.random() < 0.35 else None, subagent_turns=rng.randint(1, 3),
            side_calls=tuple(t for t in range(turns) if rng.random() < 0.15),
            proxy=rng.randrange(setup.proxies)))
    restarts = tuple((rng.uniform(0.5, 20), rng.randrange(servers), rng.random() < 0.3)
                     for _ in range(1 if rng.random() < 0.1 else 0))
    system_words = rng.randint(60, 200)
    if rng.random() < 0.15 and load:  # a loaded server: prefills outlast the bound (held requests, Rules 3-9)
        setup = replace(setup, prefill_speed=rng.uniform(60, 300),
                        options=(("slots_client_patience", 3 * rng.choice((1, 2, 5))),))
    # From a generator of their own, so the shapes drawn before stalls existed stay as they were.
    srng = random.Random(seed * 7 + 0x5A17)
    drawn = tuple((srng.uniform(0, 10), srng.uniform(3, 40), srng.randrange(servers))
                  for _ in range(srng.randint(1, 2))) if srng.random() < 0.25 else ()
    return Shape(seed, setup, tuple(sessions), system_words=system_words, restarts=restarts,
                 stalls=drawn if stalls else ())


def issue_shape(seed: int, servers: int = 1, slots: int = 4, prefill_speed: float = 150.0) -> Shape:
    """The traffic issue 19 measured: 6 agent sessions without a known marker (a per-session environment block
    after a long shared system prompt), each starting a 3-turn subagent it waits for, paging on, a slow server
    (prefill at SmolLM2's speed on 2 cores), on 1 server x 4 slots or 2 x 2."""
    rng = random.Random(seed)
    sessions = tuple(SessionShape(turns=3, marker=False, stream=True, start=rng.uniform(0, 1.0),
                                  think=(rng.uniform(0.5, 2), rng.uniform(0.5, 2)), subagent_at=rng.randrange(2),
                                  subagent_turns=3) for _ in range(6))
    return Shape(seed, Setup(servers=servers, slots=slots, paging=True, prefill_speed=prefill_speed), sessions,
                 system_words=500, output_words=(60, 200))


def crowd_shape(seed: int, *, stock: bool = False) -> Shape:
    """More sessions than slots and no save dir (most users start llama-server without `--slot-save-path`):
    2-3 slots, one or two sessions more, 4-8 turns each, prefill 100-1,000 tokens/s, think times 0-3 s.
    `stock`: the same traffic with the proxy observing only."""
    r = random.Random(seed)
    slots = r.choice([2, 2, 3])
    sessions = tuple(SessionShape(turns=r.randint(4, 8), marker=r.random() < 0.5, stream=r.random() < 0.5,
                                  start=r.uniform(0, 2), think=tuple(r.choice([0.0, 0.2, 1.0, 3.0]) for _ in range(10)))
                     for _ in range(slots + r.choice([1, 1, 2])))
    setup = Setup(slots=slots, paging=False, prefill_speed=r.choice([100.0, 300.0, 1000.0]), n_ctx=32768,
                  options=(("slots_policy", "off"),) if stock else ())
    return Shape(seed, setup, sessions, system_words=r.choice([120, 400]),
                 output_words=(r.randint(20, 60), r.randint(80, 200)))


def shape_for(seed: int, *, load: bool = True, stalls: bool = True) -> Shape:
    """The sweep's workload for `seed`: every tenth (seed % 10 == 9) the issue-19 traffic on 1 x 4 or 2 x 2
    slots, the others drawn by `shape_from_seed`."""
    if seed % 10 == 9:
        return issue_shape(seed, *((1, 4) if seed % 20 == 9 else (2, 2)))
    return shape_from_seed(seed, load=load, stalls=stalls)


# ----------------------------------------------------------------------------------------------- content

@dataclass
class Texts:
    """The seeded text of one workload: one shared system prompt, per-session parts."""

    rng: random.Random
    shared: str = ""

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def system(self, name: str, marker: bool) -> str:
        if marker:
            return f"{self.shared}\n<cwd>/home/dev/{name}</cwd>"
        return f"{self.shared}\n\n# Environment\nWorking directory: /home/dev/{name}\nToday's date: 2026-11-02"


@dataclass
class Conversation:
    tag: str
    system: str
    messages: list[dict[str, Any]] = field(default_factory=list)

    def body(self, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": "sim", "messages": [{"role": "system", "content": self.system},
                                                             *self.messages], "max_tokens": 4}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return body


async def _turns(rig: Rig, conv: Conversation, texts: Texts, shape: Shape, x: SessionShape, n: int,
                 proxy: int) -> None:
    for i in range(n):
        out = await rig.send(conv.tag, conv.body(x.stream), proxy=proxy)
        reply = out.content.strip() or "ok"
        output = "tool output: " + texts.words(texts.rng.randint(*shape.output_words))
        conv.messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": output}]
        if i + 1 < n:
            await asyncio.sleep(0.3)


async def _side(rig: Rig, tag: str, conv: Conversation, proxy: int) -> None:
    first = conv.messages[0]["content"] if conv.messages else ""
    body = {"model": "sim", "max_tokens": 4, "messages": [{"role": "system", "content": SIDE_SYSTEM},
                                                          {"role": "user", "content": first}]}
    await rig.send(tag, body, proxy=proxy)


async def _session(rig: Rig, shape: Shape, texts: Texts, idx: int, x: SessionShape, side: list[asyncio.Task[Any]]
                   ) -> None:
    name = f"m{idx}"
    conv = Conversation(name, texts.system(f"proj{idx}", x.marker),
                        [{"role": "user", "content": f"task {idx}: " + texts.words(12)}])
    await asyncio.sleep(x.start)
    for turn in range(x.turns):
        if turn:
            await asyncio.sleep(x.think[turn - 1])
        if turn in x.side_calls:
            side.append(asyncio.ensure_future(_side(rig, f"{name}.title{turn}", conv, x.proxy)))
        await _turns(rig, conv, texts, shape, x, 1, x.proxy)
        if x.subagent_at == turn:
            sub = Conversation(f"{name}.sub", texts.system(f"proj{idx}", x.marker),
                               [{"role": "user", "content": f"subtask of {idx}: " + texts.words(10)}])
            await _turns(rig, sub, texts, shape, x, x.subagent_turns, x.proxy)
            conv.messages[-1]["content"] += " subagent result: " + texts.words(8)


async def play(rig: Rig, shape: Shape) -> None:
    """Send the whole workload: every session concurrently from its start time, restarts at theirs."""
    texts = Texts(random.Random(shape.seed * 7919 + 1))
    texts.shared = "You are a coding agent . " + texts.words(shape.system_words)
    side: list[asyncio.Task[Any]] = []

    async def restart(at: float, server: int, new_build: bool) -> None:
        await asyncio.sleep(at)
        rig.restart(server, new_build=new_build)

    async def stall(at: float, seconds: float, server: int) -> None:
        await asyncio.sleep(at)
        rig.stall(server, seconds)

    jobs = [_session(rig, shape, texts, i, x, side) for i, x in enumerate(shape.sessions)]
    jobs += [restart(*r) for r in shape.restarts]
    jobs += [stall(*x) for x in shape.stalls]
    await asyncio.gather(*jobs)
    await asyncio.gather(*side)
    await rig.settle()
