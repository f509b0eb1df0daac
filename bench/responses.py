"""An OpenAI Responses request (`POST /v1/responses`, what Codex CLI sends) as the chat-completions body
llama-server renders it from, so the bench can count its prompt tokens with `/apply-template` + `/tokenize`.

Why a converter of our own: llama-server has no endpoint that renders a Responses body; its `/v1/responses`
handler converts the body to a chat completion first (`server_chat_convert_responses_to_chatcmpl` in
llama.cpp's tools/server, server-chat.cpp; earlier builds had it as `convert_responses_to_chatcmpl` in
server-common.cpp) and renders that. This module follows the same rules, item by item:

- `instructions` becomes a leading `system` message; a string `input` one `user` message;
- a message item keeps its role (`developer` stays `developer`; a missing role is `user`) and its content
  parts become chat `text` parts (`input_text`, `output_text`, `text`), `image_url` parts for images,
  `refusal` parts as they are; a string content becomes one `text` part;
- an assistant message item right after an assistant message merges into it (parts appended);
- `function_call` items become an assistant `tool_calls` entry (merged into a preceding assistant message),
  `function_call_output` items a `tool` message (string output as it is, parts as `text` parts);
- `reasoning` items set the preceding assistant message's `reasoning_content`, or start an assistant
  message with empty content;
- only `function` tools are kept (the server skips the others), with `strict: true` when unset;
  `max_output_tokens` becomes `max_tokens`, `reasoning.effort` becomes `reasoning_effort`.

The result is only ever used for counting; the bench checks every count against the `cache_n + prompt_n`
the server reported for the same request (bench/client_workloads.py), so a difference from the server's
own conversion shows up as a mismatch, never as a silently wrong limit.
"""

from __future__ import annotations

import copy
import json
from typing import Any

TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesError(ValueError):
    """The body is not a Responses request the server would accept."""


def _text(obj: dict[str, Any], key: str) -> str:
    value = obj.get(key)
    return value if isinstance(value, str) else ""


def _content_parts(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    parts: list[dict[str, Any]] = []
    if not isinstance(content, list):
        return parts
    for part in content:
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
            continue
        if not isinstance(part, dict):
            continue
        kind = _text(part, "type")
        if kind in TEXT_PARTS or (not kind and "text" in part):
            parts.append({"type": "text", "text": _text(part, "text")})
        elif kind in ("input_image", "image_url"):
            if "image_url" in part:
                url = part["image_url"]
                parts.append({"type": "image_url", "image_url": {"url": url} if isinstance(url, str) else url})
        elif kind == "refusal":
            parts.append({"type": "refusal", "refusal": _text(part, "refusal")})
        elif "text" in part:
            parts.append({"type": "text", "text": _text(part, "text")})
        else:
            parts.append(part)
    return parts


def _reasoning_text(item: dict[str, Any]) -> str:
    if isinstance(item.get("reasoning_content"), str):
        return str(item["reasoning_content"])
    content = item.get("content")
    if isinstance(content, str):
        return content
    text = ""
    if isinstance(content, list):
        for part in content:
            if isinstance(part, str):
                text += part
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                text += part["text"]
    return text


def _tool_output(item: dict[str, Any]) -> Any:
    output = item.get("output", item.get("content", ""))
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        parts = []
        for part in output:
            if isinstance(part, str):
                parts.append({"type": "text", "text": part})
            elif isinstance(part, dict):
                kind = part.get("type", "text")
                parts.append({"type": "text", "text": _text(part, "text")} if kind in TEXT_PARTS else part)
        return parts
    return json.dumps(output, separators=(",", ":"))


def _item(item: Any, messages: list[dict[str, Any]]) -> None:
    if isinstance(item, str):
        messages.append({"role": "user", "content": item})
        return
    if not isinstance(item, dict):
        return
    merge = bool(messages) and messages[-1].get("role") == "assistant"
    kind, role = _text(item, "type"), _text(item, "role")
    if kind == "reasoning" or "reasoning_content" in item:
        if merge:
            messages[-1]["reasoning_content"] = _reasoning_text(item)
        else:
            messages.append({"role": "assistant", "content": [], "reasoning_content": _reasoning_text(item)})
        return
    if kind in ("function_call", "tool_call") or ("call_id" in item and "arguments" in item):
        args = item.get("arguments", "{}")
        call = {"function": {"arguments": args if isinstance(args, str) else json.dumps(args, separators=(",", ":")),
                             "name": _text(item, "name")},
                "id": _text(item, "call_id") or _text(item, "id"), "type": "function"}
        if merge:
            calls = messages[-1].get("tool_calls")
            if not isinstance(calls, list):
                calls = messages[-1]["tool_calls"] = []
            calls.append(call)
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
        return
    if kind in ("function_call_output", "tool_result") or role == "tool" or ("call_id" in item and "output" in item):
        messages.append({"content": _tool_output(item), "role": "tool",
                         "tool_call_id": _text(item, "call_id") or _text(item, "tool_call_id")})
        return
    parts = _content_parts(item.get("content")) if "content" in item else []
    role = role or "user"
    if role == "assistant" and merge:
        prev = messages[-1]
        if not isinstance(prev.get("content"), list):
            prev["content"] = []
        prev["content"].extend(parts)
        return
    msg: dict[str, Any] = {"role": role, "content": parts}
    if "tool_calls" in item:
        msg["tool_calls"] = item["tool_calls"]
    messages.append(msg)


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body llama-server builds from the Responses request `body` (not modified)."""
    if not isinstance(body, dict) or "input" not in body:
        raise ResponsesError("'input' is required")
    out = copy.deepcopy(body)
    for key in ("input", "previous_response_id", "instructions"):
        out.pop(key, None)
    messages: list[dict[str, Any]] = []
    if "instructions" in body:
        messages.append({"role": "system", "content": _text(body, "instructions")})
    value = body["input"]
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list):
        for item in value:
            _item(copy.deepcopy(item), messages)
    else:
        raise ResponsesError("'input' must be a string or array of objects")
    out["messages"] = messages
    if "tools" in body:
        if not isinstance(body["tools"], list):
            raise ResponsesError("'tools' must be an array of objects")
        tools = []
        for tool in body["tools"]:
            if not isinstance(tool, dict) or tool.get("type") != "function":
                continue  # the server skips (newer builds) or refuses (older ones) other tool types
            fn = {k: copy.deepcopy(v) for k, v in tool.items() if k != "type"}
            fn.setdefault("strict", True)
            tools.append({"type": "function", "function": fn})
        out.pop("tools")
        if tools:
            out["tools"] = tools
    if "max_output_tokens" in body:
        out["max_tokens"] = out.pop("max_output_tokens")
    if "reasoning" in body:
        reasoning = out.pop("reasoning")
        if isinstance(reasoning, dict) and "effort" in reasoning:
            out["reasoning_effort"] = reasoning["effort"]
    return out
