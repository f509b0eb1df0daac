"""mitmproxy addon that records what an agent client sends and what the server answered, one JSON line each.

Why not only `mitmdump -w`: a flow is written once it completes, so a request the client abandons is lost;
this addon writes each request the moment it arrives (with its full JSON body) and each response with the
cache numbers of every wire format in use: llama-server's `timings` (chat completions and Responses
streams), OpenAI `usage`, and Anthropic `message_start`/`message_delta` usage. Run it next to `-w` to keep
both. Nothing sets `flow.response.stream`, so responses are buffered; fine for a capture, not for serving.

    mitmdump --mode reverse:http://127.0.0.1:8080@127.0.0.1:8081 -w flows.mitm \\
        -s tools/capture/capture_addon.py --set capture_path=capture.jsonl
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from mitmproxy import ctx, http

RAW_LIMIT = 64_000  # bytes of each response body kept verbatim (captures are local, never committed)


def _merge_usage(out: dict[str, Any], usage: Any) -> None:
    if isinstance(usage, dict):
        out.setdefault("usage", {}).update({k: v for k, v in usage.items() if v is not None})


def stream_summary(raw: bytes) -> dict[str, Any]:
    """Text, finish reason, last `timings` and merged `usage` from an SSE body of any of the three APIs."""
    out: dict[str, Any] = {"text": "", "events": 0}
    for line in raw.decode("utf-8", "replace").splitlines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if not data or data == "[DONE]":
            continue
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            continue
        out["events"] += 1
        if chunk.get("timings"):
            out["timings"] = chunk["timings"]
        _merge_usage(out, chunk.get("usage"))
        kind = chunk.get("type")
        if kind == "message_start":  # Anthropic
            _merge_usage(out, (chunk.get("message") or {}).get("usage"))
        elif kind == "content_block_delta":
            out["text"] += (chunk.get("delta") or {}).get("text") or ""
        elif kind == "message_delta":
            out["finish_reason"] = (chunk.get("delta") or {}).get("stop_reason")
        elif kind == "response.output_text.delta":  # Responses
            out["text"] += chunk.get("delta") or ""
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            resp = chunk.get("response") or {}
            _merge_usage(out, resp.get("usage"))
            out["finish_reason"] = resp.get("status")
            if resp.get("timings"):
                out["timings"] = resp["timings"]
        for choice in chunk.get("choices") or []:  # chat completions
            out["text"] += (choice.get("delta") or {}).get("content") or ""
            out["finish_reason"] = choice.get("finish_reason") or out.get("finish_reason")
    return out


def json_summary(raw: bytes) -> dict[str, Any]:
    """The same fields from a non-streamed JSON answer."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    if not isinstance(body, dict):
        return {}
    out: dict[str, Any] = {}
    if body.get("timings"):
        out["timings"] = body["timings"]
    _merge_usage(out, body.get("usage"))
    return out


class Capture:
    def __init__(self) -> None:
        self.seq = 0

    def load(self, loader: Any) -> None:
        loader.add_option("capture_path", str, "/tmp/capture.jsonl", "JSONL file the capture appends to")

    def _write(self, record: dict[str, Any]) -> None:
        record["t"] = time.time()
        with open(ctx.options.capture_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def request(self, flow: http.HTTPFlow) -> None:
        self.seq += 1
        flow.metadata["capture_seq"] = self.seq
        raw = flow.request.content or b""
        try:
            body: Any = json.loads(raw) if raw else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = raw[:2000].decode("utf-8", "replace")
        self._write({"event": "request", "seq": self.seq, "method": flow.request.method,
                     "path": flow.request.path, "headers": list(flow.request.headers.items()),
                     "body_len": len(raw), "body_sha256": hashlib.sha256(raw).hexdigest(), "body": body})

    def response(self, flow: http.HTTPFlow) -> None:
        assert flow.response is not None
        raw = flow.response.content or b""
        ctype = flow.response.headers.get("content-type", "")
        summary = stream_summary(raw) if "event-stream" in ctype else json_summary(raw)
        self._write({"event": "response", "seq": flow.metadata.get("capture_seq"),
                     "status": flow.response.status_code, "headers": list(flow.response.headers.items()),
                     "raw": raw[:RAW_LIMIT].decode("utf-8", "replace"), **summary})

    def error(self, flow: http.HTTPFlow) -> None:
        self._write({"event": "error", "seq": flow.metadata.get("capture_seq"), "error": str(flow.error)})


addons = [Capture()]
