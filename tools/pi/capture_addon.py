"""mitmproxy addon that records what an agent client really sends, one JSON line per event.

Why not `mitmdump -w`: a flow is only written once it completes, so a request that never finishes (pi's
unbounded side calls) is lost, and the SSE body of a streamed response is not stored. This addon logs each
request when it arrives and, when the (buffered) SSE response completes, the `usage` and `timings` of its
final chunk. Nothing sets `flow.response.stream`, so mitmproxy buffers each response; fine for a capture.

Use: `mitmdump --mode reverse:http://127.0.0.1:8080@127.0.0.1:8081 -s tools/pi/capture_addon.py
--set capture_path=/tmp/capture.jsonl`.
"""

from __future__ import annotations

import json
import time
from typing import Any

from mitmproxy import ctx, http


def sse_summary(raw: bytes) -> dict[str, Any]:
    """Concatenate the streamed text/tool-call deltas and keep the last `usage` / `timings` seen."""
    out: dict[str, Any] = {"text": "", "tool_calls": 0, "finish_reason": None}
    for line in raw.decode("utf-8", "replace").splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        try:
            chunk = json.loads(line[6:])
        except json.JSONDecodeError:
            continue
        for key in ("usage", "timings"):
            if chunk.get(key):
                out[key] = chunk[key]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            out["text"] += delta.get("content") or ""
            out["tool_calls"] += sum(1 for tc in delta.get("tool_calls") or [] if tc.get("id"))
            out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
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
        try:
            body: Any = json.loads(flow.request.content or b"null")
        except json.JSONDecodeError:
            body = (flow.request.content or b"")[:2000].decode("utf-8", "replace")
        self._write({"event": "request", "seq": self.seq, "method": flow.request.method,
                     "path": flow.request.path, "headers": list(flow.request.headers.items()), "body": body})

    def response(self, flow: http.HTTPFlow) -> None:
        assert flow.response is not None
        raw = flow.response.content or b""
        ctype = flow.response.headers.get("content-type", "")
        summary = sse_summary(raw) if "event-stream" in ctype else {"body": raw[:2000].decode("utf-8", "replace")}
        self._write({"event": "response", "seq": flow.metadata.get("capture_seq"),
                     "status": flow.response.status_code, "headers": list(flow.response.headers.items()),
                     **summary})

    def error(self, flow: http.HTTPFlow) -> None:
        self._write({"event": "error", "seq": flow.metadata.get("capture_seq"), "error": str(flow.error)})


addons = [Capture()]
