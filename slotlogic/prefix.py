"""The stable prefix every session of one agent shares, and the fingerprint that names its checkpoint.

Stable prefix (seed 001; docs/checkpoints.md): the first `system`/`developer` message up to the
earliest marker that starts the per-window part — newer pi puts `\\n<cwd>` there, pi 0.58 puts
`\\nCurrent date: …` then `\\nCurrent working directory: …` — with trailing whitespace stripped; together
with `tools` and `chat_template_kwargs`, which the chat template renders into the same prefix. No marker:
no stable prefix (the caller logs once and uses no checkpoint: fail open).

Fingerprint: SHA-256 over canonical JSON (sorted keys, array order kept) of a format tag, the model's
identity (`/props` model_path, plus size and mtime when that file exists locally), the server's identity
(`build_info` and the operator's `slots_server_id`), the addon version, tools, template kwargs and the
prefix text. A change to any of them names a different file, so a stale checkpoint is never restored.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from slotlogic.session import SYSTEM_ROLES, canonical, digest, message_text

FORMAT_TAG = "slotkeeper-prefix-v1"
DEFAULT_MARKERS = ("\n<cwd>", "\nCurrent date: ", "\nCurrent working directory: ")
FILE_RE = re.compile(r"^prefix-[0-9a-f]{16}\.bin$")


@dataclass(frozen=True)
class StablePrefix:
    text: str
    role: str
    tools: Any
    template_kwargs: Any

    @property
    def signature(self) -> str:
        """Content digest (no server identity): what the ranking compares slot contents by."""
        return digest("stable", self.text, canonical(self.tools), canonical(self.template_kwargs))

    def warmup_body(self, user: str = "") -> dict[str, Any]:
        """A chat request that renders to this prefix (+ an empty or probe user message)."""
        body: dict[str, Any] = {"messages": [{"role": self.role, "content": self.text},
                                             {"role": "user", "content": user}]}
        if self.tools:
            body["tools"] = self.tools
        if self.template_kwargs:
            body["chat_template_kwargs"] = self.template_kwargs
        return body


def extract(body: Mapping[str, Any], markers: Sequence[str] = DEFAULT_MARKERS) -> StablePrefix | None:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not isinstance(msgs[0], Mapping):
        return None
    first = msgs[0]
    role = first.get("role")
    if role not in SYSTEM_ROLES:
        return None
    text = message_text(first.get("content"))
    cut = min((i for i in (text.find(m) for m in markers if m) if i >= 0), default=-1)
    if cut < 0:
        return None
    stable = text[:cut].rstrip()
    if not stable:
        return None
    return StablePrefix(stable, str(role), body.get("tools") or None, body.get("chat_template_kwargs") or None)


def fingerprint(prefix: StablePrefix, *, model_path: str | None, model_size: int | None,
                model_mtime: float | None, build_info: str | None, server_id: str, addon_version: str) -> str:
    doc = {
        "format": FORMAT_TAG,
        "model": {"path": model_path, "size": model_size, "mtime": model_mtime},
        "server": {"build_info": build_info, "id": server_id},
        "addon": addon_version,
        "tools": prefix.tools,
        "chat_template_kwargs": prefix.template_kwargs,
        "prefix": prefix.text,
        "role": prefix.role,
    }
    return hashlib.sha256(canonical(doc).encode("utf-8", "surrogatepass")).hexdigest()


def file_name(fp: str) -> str:
    return f"prefix-{fp[:16]}.bin"
