"""Anthropic Messages → llama-server chat completions, exactly as llama-server's own `/v1/messages` does it.

Why: llama-server's `/v1/messages` drops `id_slot`, so Claude Code traffic cannot be pinned there. The proxy
sends such a request to `/v1/chat/completions`, built as llama-server's converter would build it (so it
renders the same prompt tokens and hits the same cache) plus the pinning keys, and converts the answer back
(`slotlogic.anthropic_answer`). Never guess: input the server would reject, or that cannot be reproduced
exactly, raises `TranslationError` (naming keys and types, never text) and the request goes to `/v1/messages`
untouched. docs/anthropic.md names the llama.cpp functions mirrored and the commits read.
"""

from __future__ import annotations

import json
import math
from decimal import Decimal
from typing import Any

DEFAULT_MAX_TOKENS = 4096          # the converter's default when `max_tokens` is absent
DEFAULT_THINKING_BUDGET = 10000    # `thinking.budget_tokens` default for `thinking.type == "enabled"`
BILLING_PREFIX = "x-anthropic-billing-header:"
_CCH_LEN = 5
_PASSTHROUGH = ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs")
_INT32 = (-(2**31), 2**31 - 1)
_JSON_INT = (-(2**63), 2**64 - 1)  # nlohmann parses integers outside this range as floats


class TranslationError(ValueError):
    """The request cannot be translated exactly; send it to `/v1/messages` unchanged."""


# --------------------------------------------------------------------------------------------------------
# request: Anthropic → chat completions
# --------------------------------------------------------------------------------------------------------

def _str(obj: Any, key: str) -> str:
    """`json_value(obj, key, std::string())`: the string, or "" when absent, null or not a string."""
    if isinstance(obj, dict):
        v = obj.get(key)
        if isinstance(v, str):
            return v
    return ""


def _int(obj: Any, key: str, default: int) -> int:
    """`json_value(obj, key, int)`: numbers and booleans convert (floats truncate), anything else → default."""
    if not isinstance(obj, dict):
        return default
    v = obj.get(key)
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        if not _INT32[0] <= v <= _INT32[1]:
            raise TranslationError(f"'{key}' out of int range")
        return v
    if isinstance(v, float):
        if not math.isfinite(v) or not _INT32[0] <= v <= _INT32[1]:
            raise TranslationError(f"'{key}' out of int range")
        return int(v)
    return default


def normalize_billing_header(text: str) -> str:
    """Claude Code's first system line carries a per-request `cch=xxxxx;` stamp; the server overwrites the
    five characters with `fffff` so the prefix cache gets past it (PR #21793). Same byte rule as the server."""
    if not text.startswith(BILLING_PREFIX):
        return text
    i = text.find("cch=", len(BILLING_PREFIX))
    if i < 0:
        return text
    j = i + 4
    if not text.isascii():
        # the server counts bytes; only an ASCII head keeps byte and character offsets equal
        head = text[: j + _CCH_LEN + 1]
        if not head.isascii():
            raise TranslationError("non-ASCII billing header")
    if j + _CCH_LEN < len(text) and text[j + _CCH_LEN] == ";":
        return text[:j] + "f" * _CCH_LEN + text[j + _CCH_LEN:]
    return text


def strip_billing(body: dict[str, Any]) -> dict[str, Any] | None:
    """The request without Claude Code's billing block (a `system` text block, or first line of a string
    system, that starts with `x-anthropic-billing-header:`): metadata for the vendor's billing whose
    `cc_version` suffix changes per session, so two sessions' prompts differ from its 47th character and
    llama-server can share almost nothing between them. None when there is no such block."""
    system = body.get("system")
    if isinstance(system, str) and system.startswith(BILLING_PREFIX):
        rest = system.split("\n", 1)[1] if "\n" in system else ""
        return {**body, "system": rest}
    if isinstance(system, list):
        kept = [b for b in system if not (_str(b, "type") == "text" and _str(b, "text").startswith(BILLING_PREFIX))]
        if len(kept) != len(system):
            return {**body, "system": kept}
    return None


def _image_url(source: Any) -> str | None:
    """An image block's `source` as the URL the server builds; None for source types it drops."""
    kind = _str(source, "type")
    if kind == "base64":
        media = source.get("media_type")
        media = media if isinstance(media, str) else "image/jpeg"
        return f"data:{media};base64,{_str(source, 'data')}"
    if kind == "url":
        return _str(source, "url")
    return None


def _tool_result(block: dict[str, Any]) -> dict[str, Any]:
    """A `tool_result` block as a role-`tool` message. `is_error` is not read by the server: dropped."""
    tool_use_id = _str(block, "tool_use_id")
    content = block.get("content")
    if isinstance(content, str):
        return {"role": "tool", "tool_call_id": tool_use_id, "content": content}
    if isinstance(content, list):
        text, parts, images = [], [], False
        for c in content:
            kind = _str(c, "type")
            if kind == "text":
                t = _str(c, "text")
                text.append(t)
                parts.append({"type": "text", "text": t})
            elif kind == "image":
                images = True
                url = _image_url(c.get("source") if isinstance(c, dict) else None)
                if url is not None:
                    parts.append({"type": "image_url", "image_url": {"url": url}})
        # text only: one plain string (what the server calls "maximum compatibility")
        return {"role": "tool", "tool_call_id": tool_use_id, "content": parts if images else "".join(text)}
    return {"role": "tool", "tool_call_id": tool_use_id, "content": ""}


def _message(msg: Any, out: list[Any]) -> None:
    """One Anthropic message → zero or more chat messages, appended to `out` (server order)."""
    if not isinstance(msg, dict) or "content" not in msg:
        if isinstance(msg, dict) and _str(msg, "role") == "assistant":
            return
        out.append(msg)
        return
    content = msg["content"]
    if not isinstance(content, list):
        out.append(msg)  # a string (or anything else) goes through untouched, like the server does
        return
    tool_calls: list[dict[str, Any]] = []
    converted: list[Any] = []
    results: list[dict[str, Any]] = []
    reasoning = ""
    for block in content:
        kind = _str(block, "type")
        if kind == "text":
            converted.append(block)  # the whole block, as the server copies it (the chat parser reads type/text)
        elif kind == "thinking":
            reasoning += _str(block, "thinking")
        elif kind == "image":
            url = _image_url(block.get("source"))
            if url is not None:
                converted.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "tool_use":
            inp = block.get("input")
            tool_calls.append({
                "id": _str(block, "id"),
                "type": "function",
                "function": {"name": _str(block, "name"), "arguments": nl_dump({} if inp is None else inp)},
            })
        elif kind == "tool_result":
            results.append(_tool_result(block))
        # redacted_thinking, document, server tool blocks, …: the server has no branch for them → dropped
    if converted or tool_calls or reasoning:
        new: dict[str, Any] = {"role": _str(msg, "role")}
        new["content"] = converted if converted else ""
        if tool_calls:
            new["tool_calls"] = tool_calls
        if reasoning:
            new["reasoning_content"] = reasoning
        out.append(new)
    out.extend(results)


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The Anthropic request as the chat-completions body llama-server's converter builds, plus the keys the
    translated route needs to rebuild the native answer. The caller adds `id_slot`/`cache_prompt`."""
    if not isinstance(body, dict) or "messages" not in body:
        raise TranslationError("'messages' is required")
    messages: list[Any] = []
    if "system" in body and body["system"] is not None:
        system = body["system"]
        if isinstance(system, str):
            text = normalize_billing_header(system)
        elif isinstance(system, list):
            text = "".join(normalize_billing_header(_str(b, "text")) for b in system if _str(b, "type") == "text")
        else:
            text = ""
        messages.append({"role": "system", "content": text})
    if isinstance(body["messages"], list):
        for msg in body["messages"]:
            _message(msg, messages)
    out: dict[str, Any] = {"messages": messages}

    tools = body.get("tools")
    if isinstance(tools, list):
        out["tools"] = [{"type": "function", "function": {
            "name": _str(t, "name"),
            "description": _str(t, "description"),
            "parameters": t["input_schema"] if isinstance(t, dict) and "input_schema" in t else {},
        }} for t in tools]
    tc = body.get("tool_choice")
    if isinstance(tc, dict):
        kind = _str(tc, "type")
        if kind == "auto":
            out["tool_choice"] = "auto"
        elif kind in ("any", "tool"):
            out["tool_choice"] = "required"
    if "stop_sequences" in body:
        out["stop"] = body["stop_sequences"]
    out["max_tokens"] = body.get("max_tokens", DEFAULT_MAX_TOKENS)  # present-but-null stays null
    for key in _PASSTHROUGH:
        if key in body:
            out[key] = body[key]
    if "thinking" in body:
        thinking = body["thinking"]
        if _str(thinking, "type") == "enabled":
            out["thinking_budget_tokens"] = _int(thinking, "budget_tokens", DEFAULT_THINKING_BUDGET)
    if "metadata" in body:
        user_id = _str(body["metadata"], "user_id")
        if user_id:
            out["__metadata_user_id"] = user_id

    # what the translated route needs; none of it changes the prompt or the sampling
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise TranslationError("'stream' is not a boolean")
    if stream:
        out["stream_options"] = {"include_usage": True}
        out["timings_per_token"] = True  # prompt counts on the first chunk, for message_start
    if body.get("stop_sequences"):
        out["verbose"] = True  # the chat answer names no stopping word; `__verbose.stopping_word` does
    return out


def encode(chat: dict[str, Any]) -> bytes:
    """The chat body as UTF-8 JSON; rejects what llama-server's parser would (lone surrogates, NaN)."""
    try:
        return json.dumps(chat, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except (ValueError, UnicodeEncodeError) as e:
        raise TranslationError(f"body not encodable as strict JSON ({type(e).__name__})") from None


# --------------------------------------------------------------------------------------------------------
# nlohmann::json::dump(), for tool_use `input` → `arguments` (the string the chat template renders)
# --------------------------------------------------------------------------------------------------------

def _nl_float(x: float) -> str:
    """nlohmann's float text: shortest digits, fixed notation while the decimal point sits in -3..15,
    otherwise d.ddde±XX. Python's repr differs only for 1e15 <= |x| < 1e16; digits are taken from repr."""
    if not math.isfinite(x):
        raise TranslationError("non-finite number")
    if x == 0.0:
        return "-0.0" if math.copysign(1.0, x) < 0 else "0.0"
    sign, digits_t, exp = Decimal(repr(x)).as_tuple()
    digits = "".join(map(str, digits_t)).rstrip("0") or "0"
    assert isinstance(exp, int)
    exp += len(digits_t) - len(digits)  # trailing zeros stripped into the exponent
    k, n = len(digits), len(digits) + exp
    s = "-" if sign else ""
    if k <= n <= 15:
        return s + digits + "0" * (n - k) + ".0"
    if 0 < n <= 15:
        return s + digits[:n] + "." + digits[n:]
    if -4 < n <= 0:
        return s + "0." + "0" * (-n) + digits
    e = n - 1
    mant = digits if k == 1 else digits[0] + "." + digits[1:]
    return f"{s}{mant}e{'-' if e < 0 else '+'}{abs(e):02d}"


def _plain(v: Any) -> bool:
    """True when json.dumps already prints `v` as nlohmann does (no float in 1e15..1e16, no huge int)."""
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, float):
            if not math.isfinite(x) or 1e15 <= abs(x) < 1e16:
                return False
        elif isinstance(x, int) and not isinstance(x, bool) and not _JSON_INT[0] <= x <= _JSON_INT[1]:
            return False
    return True


class _Text(str):
    """Output text already made (a bracket, a key), next to the values still to write on `_nl_dump_slow`'s stack."""


def _nl_scalar(v: Any) -> str:
    if v is None or isinstance(v, (bool, str)):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, int):
        return str(v) if _JSON_INT[0] <= v <= _JSON_INT[1] else _nl_float(float(v))
    if isinstance(v, float):
        return _nl_float(v)
    raise TranslationError(f"unsupported JSON value {type(v).__name__}")


def _nl_dump_slow(v: Any) -> str:
    """nlohmann's dump without recursion: a tool input nested as deep as the client likes (900 levels raised
    RecursionError) is written with a stack of its own."""
    out: list[str] = []
    stack: list[Any] = [v]
    while stack:
        x = stack.pop()
        if type(x) is _Text:
            out.append(x)
        elif isinstance(x, dict):
            stack.append(_Text("}"))
            items = list(x.items())
            for i in range(len(items) - 1, -1, -1):
                stack += [items[i][1], _Text(("," if i else "") + json.dumps(items[i][0], ensure_ascii=False) + ":")]
            stack.append(_Text("{"))
        elif isinstance(x, list):
            stack.append(_Text("]"))
            for i in range(len(x) - 1, -1, -1):
                stack += [x[i], _Text(",")] if i else [x[i]]
            stack.append(_Text("["))
        else:
            out.append(_nl_scalar(x))
    return "".join(out)


def nl_dump(v: Any) -> str:
    """`json.dump()` of nlohmann::json (compact, UTF-8 as is, its own float format)."""
    try:
        if _plain(v):
            try:
                return json.dumps(v, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
            except RecursionError:  # deeper than the C encoder goes: the same text, without recursion
                pass
        return _nl_dump_slow(v)
    except (ValueError, OverflowError) as e:
        raise TranslationError(f"tool input not representable ({type(e).__name__})") from None
