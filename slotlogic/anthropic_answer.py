"""llama-server chat completion answers → Anthropic Messages answers, as llama-server's `/v1/messages` sends them.

The way back of `slotlogic.anthropic`: the client must receive what the native route would have sent.
`from_chat` mirrors the final answer's `to_json_anthropic()`, `StreamConverter` (a state machine fed bytes)
the partial and final stream events with their SSE framing; errors pass in the OpenAI shape, as the native
route sends them. Pure; exceptions name keys and types, never text. docs/anthropic.md names the llama.cpp
functions and commits.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from slotlogic import numbers
from slotlogic.anthropic import TranslationError


class StopReason(Enum):
    END_TURN = "end_turn"
    MAX_TOKENS = "max_tokens"
    TOOL_USE = "tool_use"


# finish_reason of the chat route → stop_reason of the native route (both derive from the same stop type).
_STOP = {"length": StopReason.MAX_TOKENS, "stop": StopReason.END_TURN, "tool_calls": StopReason.TOOL_USE}


def _stop_reason(finish: Any, calls: bool) -> StopReason:
    """Only `length` is kept as it came; any other end is a tool use when the answer has calls."""
    reason = _STOP.get(finish, StopReason.MAX_TOKENS)
    if reason is StopReason.MAX_TOKENS:
        return reason
    return StopReason.TOOL_USE if calls else StopReason.END_TURN


@dataclass(frozen=True)
class PromptCounts:
    """What the slot cache did for this request: `cache_n` reused tokens, `prompt_n` prefilled ones."""

    cache_n: int
    prompt_n: int


# --------------------------------------------------------------------------------------------------------
# answer: chat completion → Anthropic message
# --------------------------------------------------------------------------------------------------------

def _reject_constant(name: str) -> Any:
    raise ValueError(name)


def _parse_input(arguments: Any) -> Any:
    """`json::parse(arguments)`, `{}` when it fails (the server's fallback). Strict like nlohmann: no NaN,
    no lone surrogate escapes."""
    if not isinstance(arguments, str):
        return {}
    try:
        value = json.loads(arguments, parse_constant=_reject_constant)
        if "\\u" in arguments:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        return value
    except (ValueError, UnicodeEncodeError, RecursionError):
        return {}


def _usage(answer: dict[str, Any]) -> tuple[int, int, int]:
    """(prompt tokens, of which cached, output tokens) of a chat answer."""
    usage, timings = _dict(answer.get("usage")), _dict(answer.get("timings"))
    details = _dict(usage.get("prompt_tokens_details"))
    cached = _n(details, "cached_tokens", _n(timings, "cache_n"))
    prompt = _n(usage, "prompt_tokens", _n(timings, "cache_n") + _n(timings, "prompt_n"))
    output = _n(usage, "completion_tokens", _n(timings, "predicted_n"))
    return prompt, min(cached, prompt), output


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _n(d: dict[str, Any], key: str, default: int = 0) -> int:
    """A token count of the server's answer, in range (`numbers.count`); `default` when absent or not one."""
    v = numbers.count(d.get(key))
    return default if v is None else v


def _stopping_word(obj: dict[str, Any]) -> str | None:
    verbose = obj.get("__verbose")
    if isinstance(verbose, dict):
        word = verbose.get("stopping_word")
        if isinstance(word, str) and word:
            return word
    return None


def _thinking_block(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}  # local models sign nothing


def _tool_use_block(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": _parse_input(arguments)}


def from_chat(answer: dict[str, Any], *, model: str | None = None) -> dict[str, Any]:
    """A non-streamed chat answer as the message `/v1/messages` returns. `model` overrides the answer's
    model (the native route reports the server's model, which is what the answer carries when the request
    named none, as `to_chat` ensures)."""
    try:
        return _from_chat(answer, model)
    except (KeyError, IndexError, TypeError, AttributeError, ValueError):
        raise TranslationError("answer is not a chat completion") from None


def _from_chat(answer: dict[str, Any], model: str | None) -> dict[str, Any]:
    choice = answer["choices"][0]
    message = choice.get("message") or {}
    finish = choice.get("finish_reason")
    if not isinstance(message, dict):
        raise TypeError("message")
    calls = message.get("tool_calls") or []
    blocks: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        blocks.append(_thinking_block(reasoning))
    text = message.get("content")
    if isinstance(text, str) and text:
        blocks.append({"type": "text", "text": text})
    for call in calls:
        fn = call.get("function") or {}
        blocks.append(_tool_use_block(call.get("id", ""), fn.get("name", ""), fn.get("arguments", "")))
    reason = _stop_reason(finish, bool(calls))
    prompt, cached, output = _usage(answer)
    return {
        "id": answer.get("id", ""),
        "type": "message",
        "role": "assistant",
        "content": blocks,
        "model": model if model is not None else answer.get("model", ""),
        "stop_reason": reason.value,
        "stop_sequence": _stopping_word(answer) if reason is not StopReason.MAX_TOKENS else None,
        "usage": {"cache_read_input_tokens": cached, "input_tokens": prompt - cached, "output_tokens": output},
    }


MAX_CALLS = 1 << 16  # a tool call's index in a chat stream: past this it is not one

TOO_LARGE_ANSWER = "slotkeeper: the server's answer was larger than slots_max_body_mb; not converted"
UNREADABLE = "slotkeeper: the server's answer could not be read as a chat completion"


def error_json(message: str, kind: str = "api_error") -> bytes:
    """Anthropic's error body, for an answer the proxy cannot give (an unreadable server answer)."""
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}},
                      separators=(",", ":")).encode()


def error_body(status: int, upstream_body: bytes) -> bytes:
    """An upstream error as the native route sends it. llama-server answers `/v1/messages` errors with the
    same `{"error": {"code", "message", "type"}}` body and status as the chat route (`res->error()` in
    server-context.cpp), so the body passes unchanged; `status` is kept by the caller."""
    del status
    return upstream_body


# --------------------------------------------------------------------------------------------------------
# streamed answer: chat-completions SSE → Anthropic SSE
# --------------------------------------------------------------------------------------------------------

MAX_PENDING = 64   # chunks held for one result at most
UNTIMED_AFTER = 4  # chunks without timings before a stream counts as untimed (a result is role + 1-3 diffs)
TOO_LARGE = "slotkeeper: an upstream event was larger than 4 MB; the answer is incomplete"
TRUNCATED = "slotkeeper: the server's answer ended before its end; the answer is incomplete"


def error_event(message: str, kind: str = "api_error") -> bytes:
    """Anthropic's error event, for an answer the proxy cannot pass on whole."""
    return _sse("error", {"type": "error", "error": {"type": kind, "message": message}})


def _sse(event: str, data: dict[str, Any]) -> bytes:
    """`format_anthropic_sse()`: one event, compact JSON (nlohmann's dump of these shapes)."""
    return b"event: " + event.encode() + b"\ndata: " + json.dumps(
        data, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


@dataclass
class _Call:
    id: str = ""
    name: str = ""


@dataclass
class _Diff:
    """One chat delta chunk: a `common_chat_msg_diff` as the chat route serialised it."""

    reasoning: str = ""
    content: str = ""
    index: int | None = None
    call_id: str = ""
    name: str = ""
    arguments: str = ""


def _diff(delta: dict[str, Any]) -> _Diff:
    d = _Diff(reasoning=delta.get("reasoning_content") or "", content=delta.get("content") or "")
    calls = delta.get("tool_calls")
    if calls:
        call = calls[0]
        fn = call.get("function") or {}
        d.index = numbers.count(call.get("index", 0), MAX_CALLS) or 0  # the server's, checked (`numbers`)
        d.call_id = call.get("id") or ""
        d.name = fn.get("name") or ""
        d.arguments = fn.get("arguments") or ""
    return d


@dataclass
class StreamConverter:
    """Feeds on the chat route's SSE bytes, returns the native route's SSE bytes.

    The chat route writes one server result (a partial per token, then the final) as consecutive
    `data:` chunks; with `timings_per_token` the last chunk of each partial carries `timings`, and the final
    ends with the `finish_reason` chunk and the usage chunk. A result is converted as soon as its last chunk
    is in (the same write on the wire), because the native formatter needs the whole result: message_start
    needs the prompt counts, a partial's block indices depend on whether the message has reasoning yet,
    and the final result is formatted with its own fresh block bookkeeping (quirks included).
    """

    model: str | None = None
    prompt: PromptCounts | None = None        # known from the first partial (or the final), for the log
    output_tokens: int | None = None
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    finished: bool = False                    # message_stop (or an error event) was sent
    max_line: int = 4 << 20                   # a longer upstream line ends the stream with an error event
    failed: str | None = None                 # why the converter ended the stream with its own error event
    _buf: bytearray = field(default_factory=bytearray)
    _pending: list[dict[str, Any]] = field(default_factory=list)
    _reasoning: bool = False                  # the message has reasoning (only whether is read, not the text)
    _content: bool = False
    _calls: dict[int, _Call] = field(default_factory=dict)
    _thinking_started: bool = False
    _text_started: bool = False
    _awaiting_usage: bool = False
    _timed: bool = False                      # a partial carried timings: results end where they do
    _untimed: bool = False                    # none did in the first UNTIMED_AFTER chunks: every chunk is one

    @property
    def cache_n(self) -> int | None:
        return self.prompt.cache_n if self.prompt else None

    @property
    def prompt_n(self) -> int | None:
        return self.prompt.prompt_n if self.prompt else None

    @property
    def held(self) -> int:
        """Bytes of the upstream stream held between chunks (the unfinished line)."""
        return len(self._buf)

    def feed(self, chunk: bytes) -> bytes:
        if self.finished:  # after message_stop or an error event nothing more is sent, nor held
            return b""
        self._buf += chunk
        out: list[bytes] = []
        while not self.finished:
            nl = self._buf.find(b"\n")
            if nl < 0:
                break
            line = bytes(self._buf[:nl]).rstrip(b"\r")
            del self._buf[: nl + 1]
            if len(line) > self.max_line:
                return b"".join(out) + self.fail(TOO_LARGE)
            if line.startswith(b"data:"):
                out.append(self._data(line[5:].strip()))
        if self.finished:
            self._buf.clear()
        elif len(self._buf) > self.max_line:
            return b"".join(out) + self.fail(TOO_LARGE)
        return b"".join(out)

    def close(self) -> bytes:
        """End of the upstream body: a complete trailing line without newline still counts."""
        out = []
        line = bytes(self._buf).rstrip(b"\r")
        self._buf.clear()
        if line.startswith(b"data:") and not self.finished:
            out.append(self._data(line[5:].strip()))
        if self._awaiting_usage and not self.finished:
            out.append(self._message_end())
        elif not self.finished:  # a clean end before the answer's end (or an empty body): say so
            out.append(self._flush_partial())
            out.append(self.fail(TRUNCATED, why="truncated"))
        return b"".join(out)

    def fail(self, message: str, kind: str = "api_error", *, why: str = "too-large") -> bytes:
        """End the client's stream with Anthropic's error event: the answer cannot be given whole (also the
        proxy's own end of a request, the watchdog's deadline)."""
        self.finished = True
        self.failed = why
        self._buf.clear()
        self._pending.clear()
        return error_event(message, kind)

    # -- one data line ---------------------------------------------------------------------------------

    def _data(self, payload: bytes) -> bytes:
        if not payload or payload == b"[DONE]" or self.finished:
            return b""
        try:
            obj = json.loads(payload)
        except (ValueError, RecursionError):
            return b""
        if not isinstance(obj, dict):
            return b""
        if "error" in obj and "choices" not in obj:
            out = self._flush_partial()
            self.finished = True
            err = obj["error"]
            if isinstance(err, dict):  # llama-server's error object, as its native route sends it
                return out + _sse("error", err)
            self.failed = "upstream-error"  # a bare value (`"error":"boom"`): Anthropic's shape, never `data: "boom"`
            return out + error_event(err if isinstance(err, str) else json.dumps(err)[:300])
        word = _stopping_word(obj)
        if word is not None:
            self.stop_sequence = word
        choices = obj.get("choices")
        if choices == [] and "usage" in obj:  # include_usage chunk: ends the final result
            prompt, cached, output = _usage(obj)
            self.prompt = self.prompt or PromptCounts(cached, prompt - cached)
            self.output_tokens = output
            return self._message_end() if self._awaiting_usage else b""
        if not choices:
            return b""
        self._pending.append(obj)
        choice = choices[0]
        if choice.get("finish_reason") is not None:
            return self._final(obj)
        if "timings" in obj:
            self._timed = True
            return self._flush_partial()
        if not self._timed and len(self._pending) > UNTIMED_AFTER:
            self._untimed = True  # a server without timings_per_token: a result's end cannot be seen
        # a result is a few chunks: more pending than MAX_PENDING (timings that stopped coming) go out now
        return self._flush_partial() if self._untimed or len(self._pending) > MAX_PENDING else b""

    # -- a partial result: server_task_result_cmpl_partial::to_json_anthropic ---------------------------

    def _flush_partial(self) -> bytes:
        if not self._pending:
            return b""
        group, self._pending = self._pending, []
        out: list[bytes] = []
        last = group[-1]
        timings = _dict(last.get("timings"))
        if self.prompt is None and "cache_n" in timings:
            self.prompt = PromptCounts(_n(timings, "cache_n"), _n(timings, "prompt_n"))
        diffs: list[_Diff] = []
        first = False
        for obj in group:
            delta = obj["choices"][0].get("delta") or {}
            if "role" in delta:
                first = True
                continue
            diffs.append(_diff(delta))
        if first:
            p = self.prompt or PromptCounts(0, 0)
            out.append(_sse("message_start", {"type": "message_start", "message": {
                "id": last.get("id", ""), "type": "message", "role": "assistant", "content": [],
                "model": self.model if self.model is not None else last.get("model", ""),
                "stop_reason": None, "stop_sequence": None,
                "usage": {"cache_read_input_tokens": p.cache_n, "input_tokens": p.prompt_n, "output_tokens": 0}}}))
        self._accumulate(diffs)
        has_reasoning = bool(self._reasoning)  # the message after this result, as update() records it
        text_index = 1 if has_reasoning else 0
        opened = _Opened(self._thinking_started, self._text_started)
        for d in diffs:
            _reasoning_and_text(d, text_index, opened, out)
            if d.index is not None:
                idx = (1 if has_reasoning else 0) + (1 if opened.text else 0) + d.index
                if d.name:
                    out.append(_block_start(idx, {"type": "tool_use", "id": d.call_id, "name": d.name}))
                if d.arguments:
                    out.append(_block_delta(idx, {"type": "input_json_delta", "partial_json": d.arguments}))
        self._thinking_started |= any(d.reasoning for d in diffs)
        self._text_started |= any(d.content for d in diffs)
        return b"".join(out)

    def _accumulate(self, diffs: Iterable[_Diff]) -> None:
        for d in diffs:
            self._reasoning = self._reasoning or bool(d.reasoning)
            self._content = self._content or bool(d.content)
            if d.index is not None:
                call = self._calls.setdefault(d.index, _Call())
                call.id = call.id or d.call_id
                call.name = call.name or d.name

    # -- the final result: server_task_result_cmpl_final::to_json_anthropic_stream ----------------------

    def _final(self, finish_obj: dict[str, Any]) -> bytes:
        group, self._pending = self._pending, []
        diffs = [_diff(o["choices"][0].get("delta") or {}) for o in group[:-1]]
        self._accumulate(diffs)
        out: list[bytes] = []
        has_thinking, has_text = bool(self._reasoning), bool(self._content)
        n_calls = (max(self._calls) + 1) if self._calls else 0
        text_index = 1 if has_thinking else 0
        opened = _Opened(False, False)  # fresh, as in the server's final formatter
        calls_started: set[int] = set()
        for d in diffs:
            _reasoning_and_text(d, text_index, opened, out)
            if d.index is not None:
                idx = (1 if has_thinking else 0) + (1 if has_text else 0) + d.index
                if d.index not in calls_started:
                    call = self._calls.get(d.index, _Call())
                    out.append(_block_start(idx, {"type": "tool_use", "id": call.id, "name": call.name}))
                    calls_started.add(d.index)
                if d.arguments:
                    out.append(_block_delta(idx, {"type": "input_json_delta", "partial_json": d.arguments}))
        if has_thinking:
            out.append(_block_delta(0, {"type": "signature_delta", "signature": ""}))
            out.append(_block_stop(0))
        if has_text:
            out.append(_block_stop(text_index))
        base = (1 if has_thinking else 0) + (1 if has_text else 0)
        out.extend(_block_stop(base + i) for i in range(n_calls))
        reason = _stop_reason(finish_obj["choices"][0]["finish_reason"], bool(self._calls))
        self.stop_reason = reason
        if reason is StopReason.MAX_TOKENS:
            self.stop_sequence = None
        self._awaiting_usage = True
        timings = finish_obj.get("timings")
        if timings is not None:  # no usage chunk follows (include_usage off): predicted_n is n_decoded
            timings = _dict(timings)
            self.output_tokens = _n(timings, "predicted_n")
            if self.prompt is None and "cache_n" in timings:
                self.prompt = PromptCounts(_n(timings, "cache_n"), _n(timings, "prompt_n"))
            out.append(self._message_end())
        return b"".join(out)

    def _message_end(self) -> bytes:
        self._awaiting_usage = False
        self.finished = True
        reason = self.stop_reason or StopReason.MAX_TOKENS
        return _sse("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": reason.value, "stop_sequence": self.stop_sequence},
            "usage": {"output_tokens": self.output_tokens or 0}}) + _sse("message_stop", {"type": "message_stop"})


@dataclass
class _Opened:
    """Which of the thinking (index 0) and text blocks have their `content_block_start` out."""

    thinking: bool
    text: bool


def _reasoning_and_text(d: _Diff, text_index: int, opened: _Opened, out: list[bytes]) -> None:
    """One diff's thinking and text deltas, each block started the first time it gets text."""
    if d.reasoning:
        if not opened.thinking:
            out.append(_block_start(0, {"type": "thinking", "thinking": ""}))
            opened.thinking = True
        out.append(_block_delta(0, {"type": "thinking_delta", "thinking": d.reasoning}))
    if d.content:
        if not opened.text:
            out.append(_block_start(text_index, {"type": "text", "text": ""}))
            opened.text = True
        out.append(_block_delta(text_index, {"type": "text_delta", "text": d.content}))


def _block_start(index: int, block: dict[str, Any]) -> bytes:
    return _sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": block})


def _block_delta(index: int, delta: dict[str, Any]) -> bytes:
    return _sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})


def _block_stop(index: int) -> bytes:
    return _sse("content_block_stop", {"type": "content_block_stop", "index": index})
