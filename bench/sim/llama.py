"""A deterministic in-process model of llama-server's slot semantics (docs/simulator.md, docs/llama-server.md).

What it keeps per slot is a token list, as the real server does, and every rule that decides what a request
finds there: the longest common prefix with the slot's tokens is reused (`cache_n`, at most all but one token:
the server evaluates the last prompt token again), the rest is prefilled (`prompt_n`), a few generated tokens
are appended. A request pinned with `id_slot` waits for its slot (the server defers it); `id_slot` -1 or absent
takes the idle slot most similar to the prompt (share > `sps`), else the least recently used one (ties: the
highest id). Slot saves and restores wait for a busy slot too, and for the prompt batch in progress on any other
slot (the server takes new tasks only between two batches, of at most `n_batch` tokens); a failed restore
wipes the slot. A restart
empties every slot and fails what was in flight. With `unified_idle_clear` every idle slot is cleared when a
task starts on another (unified KV with `--cache-idle-slots`).

Prompts are rendered by a ChatML-like template and split into words and punctuation, each interned as an int,
so a request's tokens depend on its content only. Time is virtual (`asyncio.sleep` on the simulation's clock):
a prefill takes `prompt_n / prefill_speed` seconds, so requests overlap as they would. Every completion leaves a
`Done` record with the ground truth: what the requesting session's previous request left in its slot
(`left_before`) and how much of it this request could have reused (`expected`).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_WORD = re.compile(r"\w+|[^\w\s]")
_VOCAB: dict[str, int] = {}
SPECIAL = {"<|im_start|>", "<|im_end|>", "\n"}
GEN_WORDS = ("ok", "done", "next", "reading", "file", "patch", "test", "passes", "fixed", "run")


def token_id(piece: str) -> int:
    tid = _VOCAB.get(piece)
    if tid is None:
        tid = _VOCAB[piece] = len(_VOCAB)
    return tid


def tokenize(text: str) -> list[int]:
    return [token_id(p) for p in _WORD.findall(text)]


IM_START, IM_END, NL = token_id("<|im_start|>"), token_id("<|im_end|>"), token_id("\n")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "" if content is None else json.dumps(content, sort_keys=True)


def render_chat(body: dict[str, Any]) -> list[int]:
    """The prompt tokens of a chat body: each message as `<|im_start|>role\\ncontent<|im_end|>\\n`, tools in
    front of the first, then the generation prompt."""
    out: list[int] = []
    tools = body.get("tools")
    if tools:
        out += tokenize("tools " + json.dumps(tools, sort_keys=True))
    for m in body.get("messages") or []:
        if not isinstance(m, dict):
            continue
        out += [IM_START, *tokenize(str(m.get("role", "user"))), NL, *tokenize(_text(m.get("content"))), IM_END, NL]
    return [*out, IM_START, *tokenize("assistant"), NL]


def render_messages(body: dict[str, Any]) -> list[int]:
    """An Anthropic `/v1/messages` body as the server's converter renders it (system first)."""
    msgs = [{"role": "system", "content": _text(body["system"])}] if body.get("system") else []
    return render_chat({"messages": [*msgs, *(body.get("messages") or [])], "tools": body.get("tools")})


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Down(Exception):
    """The server restarted while the task waited or ran: the connection is gone."""


@dataclass
class Slot:
    id: int
    tokens: list[int] = field(default_factory=list)
    busy: bool = False
    t_last_used: float = 0.0
    id_task: int | None = None
    n_prompt: int = 0
    writer: str | None = None   # ground truth: the tag whose request or file last wrote these tokens
    prefill: tuple[float, float] | None = None  # (start, end) of the prefill running now


@dataclass
class Done:
    """One completion as the server ran it, with its ground truth."""

    task: int
    tag: str | None          # the session that sent it (None: the proxy's own request)
    slot: int
    n_tokens: int
    cache_n: int
    prompt_n: int
    expected: int            # tokens of the tag's previous left-over this prompt could have reused
    left_before: int         # how long that left-over was
    started: float
    ended: float
    generation: int          # the server process it ran on
    cache_prompt: bool = True
    tokens: list[int] = field(default_factory=list, repr=False)   # the prompt (the limit is computed from these)

    @property
    def lost(self) -> int:
        return max(0, min(self.expected, self.n_tokens - 1) - self.cache_n)


@dataclass
class SlotEvent:
    """What changed a slot's tokens (the reproduction of a loss is read from these)."""

    t: float
    slot: int
    kind: str                # request / save / restore / restore-failed / erase / restart / idle-clear
    tag: str | None          # the request's session, or the file's name
    before: int              # tokens before
    after: int               # tokens after
    reused: int = 0
    writer: str | None = None  # a save: whose tokens it wrote (the slot's last writer)


@dataclass
class SimFile:
    tokens: list[int]
    writer: str | None
    identity: str


@dataclass
class Task:
    id: int
    slot: int | None         # the slot asked for (None: the server chooses)
    kind: str                # completion / save / restore / erase
    payload: Any
    tag: str | None
    started: asyncio.Future[int]
    done: asyncio.Future[Any]
    generation: int


@dataclass(frozen=True)
class Disk:
    """A slot file's true costs on a modelled machine: KV bytes a token, the disk's bytes a second both ways, and a
    call's fixed time beyond the server's own (HTTP, queueing aside). Without one the simulator keeps its
    original small-CPU-model costs: 256 bytes a token, a microsecond a token, and every answer timed 1 ms."""

    bytes_per_token: int
    bps: float
    overhead_s: float = 0.002
    free_bytes: int = 2 << 40     # what the save dir's file system reports free (a 2 TiB NVMe disk)

    def size(self, tokens: int) -> int:
        return 4096 + self.bytes_per_token * tokens

    def seconds(self, n_bytes: int) -> float:
        """The server's own time for a file of `n_bytes` (its `save_ms`/`restore_ms`)."""
        return n_bytes / self.bps


class SimServer:
    def __init__(self, n_slots: int = 4, n_ctx: int = 8192, *, save_dir: str | Path | None = None,
                 prefill_speed: float = 2000.0, decode_speed: float = 100.0, sps: float = 0.1,
                 unified_idle_clear: bool = False, model_path: str = "/models/sim.gguf", build: str = "b1-sim",
                 honour_messages_slot: bool = False, name: str = "sim", n_batch: int = 2048,
                 disk: Disk | None = None, prefill_depth: float | None = None,
                 restores_keep_nothing: bool = False) -> None:
        self.n_slots, self.n_ctx, self.n_batch = n_slots, n_ctx, n_batch
        self.disk = disk
        self.prefill_depth = prefill_depth  # the context depth at which a token costs twice (None: never slower)
        self.save_dir = Path(save_dir) if save_dir else None
        self.prefill_speed, self.decode_speed, self.sps = prefill_speed, decode_speed, sps
        self.unified_idle_clear = unified_idle_clear
        self.model_path, self.build, self.name = model_path, build, name
        self.honour_messages_slot = honour_messages_slot
        # a build whose restores answer the file's counts and leave the slot empty (llama.cpp #26676)
        self.restores_keep_nothing = restores_keep_nothing
        self.slots = [Slot(i) for i in range(n_slots)]
        self.files: dict[str, SimFile] = {}
        self.queue: deque[Task] = deque()
        self.generation = 0
        self.next_task = 0
        self.prefill_tokens = 0
        self.done: list[Done] = []
        self.events: list[SlotEvent] = []
        self.left: dict[str, list[int]] = {}   # tag -> what its last completed request left in its slot
        self.left_before: dict[int, list[int]] = {}  # task -> its tag's left-over when it started
        self.restarts: list[float] = []
        self.meta_stalled_until = 0.0  # loop time until which `/props` and `/slots` time out (Rig.stall)

    # ------------------------------------------------------------------------------------------- clock

    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    # ------------------------------------------------------------------------------------------- facts

    @property
    def media_marker(self) -> str:
        return f"<__media_{self.name}_{self.generation}__>"

    def props(self) -> dict[str, Any]:
        return {"total_slots": self.n_slots, "media_marker": self.media_marker, "build_info": self.build,
                "model_path": self.model_path, "model_alias": "sim", "is_sleeping": False,
                "default_generation_settings": {"n_ctx": self.n_ctx}}

    def slots_view(self) -> list[dict[str, Any]]:
        out = []
        for s in self.slots:
            e: dict[str, Any] = {"id": s.id, "n_ctx": self.n_ctx, "speculative": False, "is_processing": s.busy}
            if s.id_task is not None:
                e |= {"id_task": s.id_task, "n_prompt_tokens": len(s.tokens) if not s.busy else s.n_prompt,
                      "n_prompt_tokens_processed": 0, "next_token": [{"n_decoded": 0}]}
            out.append(e)
        return out

    # ------------------------------------------------------------------------------------------- lifecycle

    def restart(self, *, build: str | None = None, model_path: str | None = None) -> None:
        """A new server process: every slot empty, queued and running tasks fail, files stay."""
        self.generation += 1
        if build is not None:
            self.build = build
        if model_path is not None:
            self.model_path = model_path
        t = self.now()
        self.restarts.append(t)
        for s in self.slots:
            self.events.append(SlotEvent(t, s.id, "restart", None, len(s.tokens), 0))
        self.slots = [Slot(i) for i in range(self.n_slots)]
        while self.queue:
            task = self.queue.popleft()
            for fut in (task.started, task.done):
                if not fut.done():
                    fut.set_exception(Down())
                    fut.exception()  # marked as retrieved: nobody may be waiting for `started`

    # ------------------------------------------------------------------------------------------- tasks

    def submit(self, kind: str, slot: int | None, payload: Any, tag: str | None = None) -> Task:
        loop = asyncio.get_running_loop()
        self.next_task += 1
        task = Task(self.next_task, slot, kind, payload, tag, loop.create_future(), loop.create_future(),
                    self.generation)
        self.queue.append(task)
        self._dispatch()
        return task

    def _dispatch(self) -> None:
        """Start every queued task whose slot is idle (FIFO; a task for a busy slot waits, as the server
        defers it)."""
        waiting: deque[Task] = deque()
        while self.queue:
            task = self.queue.popleft()
            slot = self._choose(task)
            if slot is None:
                waiting.append(task)
                continue
            slot.busy = True
            slot.id_task = task.id
            asyncio.get_running_loop().create_task(self._run(task, slot))
        self.queue = waiting

    def _choose(self, task: Task) -> Slot | None:
        if task.slot is not None:
            s = self.slots[task.slot % self.n_slots]
            return None if s.busy else s
        idle = [s for s in self.slots if not s.busy]
        if not idle:
            return None
        tokens = task.payload["tokens"]
        if self.sps > 0 and tokens:
            best, best_sim = None, self.sps
            for s in idle:
                if s.tokens:
                    sim = common_prefix(s.tokens, tokens) / len(tokens)
                    if sim > best_sim:
                        best, best_sim = s, sim
            if best is not None:
                return best
        lru = idle[0]
        for s in idle:
            if s.t_last_used <= lru.t_last_used:
                lru = s
        return lru

    async def _run(self, task: Task, slot: Slot) -> None:
        gen = self.generation
        try:
            task.started.set_result(slot.id)
            if task.kind == "completion":
                result: Any = await self._complete(task, slot)
            else:
                result = await self._action(task, slot)
            if gen != self.generation:
                raise Down()
            task.done.set_result(result)
        except Down as e:
            if not task.done.done():
                task.done.set_exception(e)
        finally:
            if gen == self.generation:
                slot.busy = False
                slot.t_last_used = self.now()
                self._dispatch()

    async def _complete(self, task: Task, slot: Slot) -> dict[str, Any]:
        p = task.payload
        tokens: list[int] = p["tokens"]
        tag, gen = task.tag, self.generation
        if len(tokens) + p["n_predict"] > self.n_ctx:
            return {"error": {"code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": len(tokens),
                              "n_ctx": self.n_ctx, "message": "the request exceeds the available context size"}}
        if self.unified_idle_clear:
            t = self.now()
            for other in self.slots:
                if other is not slot and not other.busy and other.tokens:
                    self.events.append(SlotEvent(t, other.id, "idle-clear", None, len(other.tokens), 0))
                    other.tokens, other.writer = [], None
        before = len(slot.tokens)
        lcp = common_prefix(slot.tokens, tokens) if p["cache_prompt"] else 0
        cache_n = min(lcp, len(tokens) - 1)
        prompt_n = len(tokens) - cache_n
        left_before = self.left.get(tag) if tag is not None else None
        expected = common_prefix(left_before, tokens) if left_before is not None else 0
        if left_before is not None:
            self.left_before[task.id] = left_before
        started = self.now()
        slot.tokens, slot.n_prompt, slot.writer = tokens[:cache_n], len(tokens), tag
        self.events.append(SlotEvent(started, slot.id, "request", tag, before, len(tokens), cache_n))
        self.prefill_tokens += prompt_n
        prefill_s = self.prefill_seconds(prompt_n, cache_n)
        slot.prefill = (started, started + prefill_s)
        try:
            await asyncio.sleep(prefill_s)
        finally:
            slot.prefill = None
        if gen != self.generation:
            raise Down()
        slot.tokens = list(tokens)
        n_gen = max(1, min(p["n_predict"], 8))
        words = [GEN_WORDS[(len(tokens) * 7 + i * 3 + (sum(tokens[-8:]) if tokens else 0)) % len(GEN_WORDS)]
                 for i in range(n_gen)]
        await asyncio.sleep(n_gen / self.decode_speed)
        if gen != self.generation:
            raise Down()
        text = " ".join(words)
        slot.tokens = tokens + tokenize(text)
        if tag is not None:
            self.left[tag] = list(slot.tokens)
        done = Done(task.id, tag, slot.id, len(tokens), cache_n, prompt_n, expected,
                    len(left_before) if left_before is not None else 0, started, self.now(), gen,
                    bool(p["cache_prompt"]), tokens)
        self.done.append(done)
        prompt_ms = prefill_s * 1000
        tok_s = prompt_n / prefill_s if self.prefill_depth else self.prefill_speed
        return {"content": text, "id_slot": slot.id, "tokens_cached": cache_n, "n_prompt": len(tokens),
                "n_gen": n_gen, "timings": {
                    "cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
                    "prompt_per_token_ms": 1000 / tok_s, "prompt_per_second": tok_s,
                    "predicted_n": n_gen, "predicted_ms": n_gen / self.decode_speed * 1000,
                    "predicted_per_token_ms": 1000 / self.decode_speed, "predicted_per_second": self.decode_speed}}

    def prefill_seconds(self, prompt_n: int, cache_n: int = 0) -> float:
        """Prefilling `prompt_n` tokens after `cache_n` in the slot: each token's cost grows with its depth
        (attention reads every token before it), doubling at `prefill_depth`."""
        deeper = (cache_n + prompt_n / 2) / self.prefill_depth if self.prefill_depth else 0.0
        return prompt_n / self.prefill_speed * (1 + deeper)

    def batch_left(self) -> float:
        """Seconds until the prompt batch in progress ends: the server's loop takes queued tasks (slot saves,
        restores, erases) only between two `update_slots` calls, and each call prefills at most `n_batch` prompt
        tokens (llama.cpp tools/server/server-queue.cpp, `server_queue::start_loop`)."""
        now, left = self.now(), 0.0
        batch = self.n_batch / self.prefill_speed
        for s in self.slots:
            if s.prefill is not None:
                start, end = s.prefill
                done = int((now - start) / batch) + 1
                left = max(left, min(end, start + done * batch) - now)
        return left

    async def _action(self, task: Task, slot: Slot) -> tuple[int, dict[str, Any]]:
        kind, name = task.kind, task.payload
        if (wait := self.batch_left()) > 0:
            await asyncio.sleep(wait)
        t = self.now()
        if kind == "erase":
            n = len(slot.tokens)
            self.events.append(SlotEvent(t, slot.id, "erase", None, n, 0))
            slot.tokens, slot.writer = [], None
            return 200, {"id_slot": slot.id, "n_erased": n}
        if self.save_dir is None:
            return 501, {"error": {"code": 501, "type": "not_supported_error",
                                   "message": "This server does not support slots action. Please start it "
                                              "with --slot-save-path"}}
        if not isinstance(name, str) or not name or "/" in name or ".." in name:
            return 400, {"error": {"code": 400, "type": "invalid_request_error", "message": "Invalid filename"}}
        path = self.save_dir / name
        n = len(slot.tokens)
        if self.disk is not None:
            return await self._file_action(kind, name, slot)
        await asyncio.sleep(0.001 + n / 1_000_000)
        if kind == "save":
            size = 4096 + 256 * n
            self.files[name] = SimFile(list(slot.tokens), slot.writer, self.identity)
            with open(path, "wb") as f:
                f.truncate(size)
            wall = time.time()  # the virtual clock's: the pagers' orphan sweep compares file ages with it
            os.utime(path, (wall, wall))
            self.events.append(SlotEvent(t, slot.id, "save", name, n, n, writer=slot.writer))
            return 200, {"id_slot": slot.id, "filename": name, "n_saved": n, "n_written": size,
                         "timings": {"save_ms": 1.0}}
        if kind == "restore":
            f = self.files.get(name)
            if f is None or not path.exists() or f.identity != self.identity:
                self.events.append(SlotEvent(t, slot.id, "restore-failed", name, n, 0))
                slot.tokens, slot.writer = [], None
                return 400, {"error": {"code": 400, "type": "invalid_request_error",
                                       "message": "failed to restore slot state from file"}}
            slot.tokens, slot.writer = ([], None) if self.restores_keep_nothing else (list(f.tokens), f.writer)
            self.events.append(SlotEvent(t, slot.id, "restore", name, n, len(slot.tokens)))
            return 200, {"id_slot": slot.id, "filename": name, "n_restored": len(f.tokens),
                         "n_read": 4096 + 256 * len(f.tokens), "timings": {"restore_ms": 1.0}}
        return 400, {"error": {"code": 400, "type": "invalid_request_error", "message": "Invalid action"}}

    async def _file_action(self, kind: str, name: str, slot: Slot) -> tuple[int, dict[str, Any]]:
        """A save or restore on a modelled disk (`Disk`): it takes the file's bytes at the disk's speed, and the
        answer's timing says so."""
        assert self.disk is not None and self.save_dir is not None
        path, n = self.save_dir / name, len(slot.tokens)
        f = self.files.get(name) if kind == "restore" else None
        size = self.disk.size(n if kind == "save" else len(f.tokens) if f is not None else 0)
        await asyncio.sleep(self.disk.overhead_s + self.disk.seconds(size))
        t, ms = self.now(), self.disk.seconds(size) * 1000
        if kind == "save":
            self.files[name] = SimFile(list(slot.tokens), slot.writer, self.identity)
            with open(path, "wb") as out:
                out.truncate(size)
            wall = time.time()
            os.utime(path, (wall, wall))
            self.events.append(SlotEvent(t, slot.id, "save", name, n, n, writer=slot.writer))
            return 200, {"id_slot": slot.id, "filename": name, "n_saved": n, "n_written": size,
                         "timings": {"save_ms": ms}}
        if kind == "restore":
            if f is None or not path.exists() or f.identity != self.identity:
                self.events.append(SlotEvent(t, slot.id, "restore-failed", name, n, 0))
                slot.tokens, slot.writer = [], None
                return 400, {"error": {"code": 400, "type": "invalid_request_error",
                                       "message": "failed to restore slot state from file"}}
            slot.tokens, slot.writer = ([], None) if self.restores_keep_nothing else (list(f.tokens), f.writer)
            self.events.append(SlotEvent(t, slot.id, "restore", name, n, len(f.tokens)))
            return 200, {"id_slot": slot.id, "filename": name, "n_restored": len(f.tokens), "n_read": size,
                         "timings": {"restore_ms": ms}}
        return 400, {"error": {"code": 400, "type": "invalid_request_error", "message": "Invalid action"}}

    @property
    def identity(self) -> str:
        return f"{self.model_path}|{self.build}|{self.n_ctx}"

    # ------------------------------------------------------------------------------------------- requests

    def completion(self, path: str, body: dict[str, Any], tag: str | None = None) -> Task:
        """Queue a completion as the server's HTTP handler would (the route decides rendering and `id_slot`)."""
        route = path.split("?", 1)[0]
        if route in ("/completion", "/completions", "/v1/completions"):
            prompt = body.get("prompt")
            tokens = tokenize(prompt) if isinstance(prompt, str) else [t for t in prompt or [] if isinstance(t, int)]
        elif route == "/v1/messages":
            tokens = render_messages(body)
        else:
            tokens = render_chat(body)
        if not tokens:
            tokens = [IM_START]
        id_slot = body.get("id_slot", -1)
        if route == "/v1/messages" and not self.honour_messages_slot:
            id_slot = -1
        slot = id_slot if isinstance(id_slot, int) and not isinstance(id_slot, bool) and id_slot >= 0 else None
        n_predict = next((body[k] for k in ("n_predict", "max_completion_tokens", "max_tokens", "max_output_tokens")
                          if isinstance(body.get(k), int)), 8)
        cache_prompt = body.get("cache_prompt", True)
        return self.submit("completion", slot, {"tokens": tokens, "n_predict": n_predict if n_predict >= 0 else 8,
                                                "cache_prompt": cache_prompt is not False}, tag)

    def action(self, slot: int, action: str, filename: str | None) -> Task:
        return self.submit(action, slot, filename)


# ----------------------------------------------------------------------------------------------- answers

def chat_answer(result: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed OAI chat answer (`timings` is llama.cpp's extension; `__verbose` only when asked)."""
    t = result["timings"]
    out: dict[str, Any] = {
        "id": f"chatcmpl-{result['id_slot']}", "object": "chat.completion", "model": "sim",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant",
                                                                     "content": result["content"]}}],
        "usage": {"prompt_tokens": result["n_prompt"], "completion_tokens": result["n_gen"],
                  "total_tokens": result["n_prompt"] + result["n_gen"],
                  "prompt_tokens_details": {"cached_tokens": t["cache_n"]}},
        "timings": t}
    if body.get("verbose"):
        out["__verbose"] = {"id_slot": result["id_slot"], "tokens_cached": result["tokens_cached"], "timings": t}
    return out


def chat_stream(result: dict[str, Any], body: dict[str, Any]) -> list[bytes]:
    """The SSE events of a streamed chat answer: deltas, the final chunk with timings, usage when asked, [DONE]."""
    t = result["timings"]
    base = {"id": f"chatcmpl-{result['id_slot']}", "object": "chat.completion.chunk", "model": "sim"}
    events = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]}]
    events += [{**base, "choices": [{"index": 0, "delta": {"content": w + " "}}]}
               for w in result["content"].split(" ")]
    final: dict[str, Any] = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "timings": t}
    if body.get("verbose"):
        final["__verbose"] = {"id_slot": result["id_slot"], "timings": t}
    events.append(final)
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append({**base, "choices": [], "timings": t, "usage": chat_answer(result, {})["usage"]})
    return [b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


def native_answer(result: dict[str, Any]) -> dict[str, Any]:
    return {"content": result["content"], "id_slot": result["id_slot"], "tokens_cached": result["tokens_cached"],
            "stop": True, "timings": result["timings"]}


def messages_answer(result: dict[str, Any]) -> dict[str, Any]:
    t = result["timings"]
    return {"id": "msg_sim", "type": "message", "role": "assistant", "model": "sim",
            "content": [{"type": "text", "text": result["content"]}], "stop_reason": "end_turn",
            "usage": {"input_tokens": t["prompt_n"], "cache_read_input_tokens": t["cache_n"],
                      "output_tokens": result["n_gen"]}}


def answer_body(path: str, result: dict[str, Any], body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The status and JSON of a non-streamed completion on `path`."""
    if "error" in result:
        return result["error"]["code"], result
    route = path.split("?", 1)[0]
    if route in ("/completion", "/completions"):
        return 200, native_answer(result)
    if route == "/v1/messages":
        return 200, messages_answer(result)
    return 200, chat_answer(result, body)
