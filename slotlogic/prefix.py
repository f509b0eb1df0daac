"""The stable prefix every session of one agent shares, and the fingerprint that names its checkpoint.

The prefix is the first system/developer message up to the earliest per-window marker, with the tools and
template kwargs the chat template renders into it; no marker, no prefix (fail open). The fingerprint hashes
everything that could make a checkpoint stale (model, server build, addon version, tools, kwargs, text), so a
stale one is never restored. docs/checkpoints.md.
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


CHAT = "chat"            # /v1/chat/completions: `messages`
RESPONSES = "responses"  # /v1/responses: `input` items (Codex); the server converts them to a chat request


@dataclass(frozen=True)
class StablePrefix:
    text: str
    role: str
    tools: Any
    template_kwargs: Any
    route: str = CHAT  # where it is warmed: a prefix renders the same only through the route that sent it

    @property
    def signature(self) -> str:
        """Content digest (no server identity): what the ranking compares slot contents by."""
        return digest("stable", self.text, canonical(self.tools), canonical(self.template_kwargs))

    @property
    def path(self) -> str:
        return "/v1/responses" if self.route == RESPONSES else "/v1/chat/completions"

    def warmup_body(self, user: str = "") -> dict[str, Any]:
        """A request on the prefix's own route that renders to this prefix (+ an empty or probe user message)."""
        body: dict[str, Any]
        if self.route == RESPONSES:
            body = {"input": [{"type": "message", "role": self.role,
                               "content": [{"type": "input_text", "text": self.text}]},
                              {"type": "message", "role": "user", "content": [{"type": "input_text", "text": user}]}]}
        else:
            body = {"messages": [{"role": self.role, "content": self.text}, {"role": "user", "content": user}]}
        if self.tools:
            body["tools"] = self.tools
        if self.template_kwargs:
            body["chat_template_kwargs"] = self.template_kwargs
        return body


@dataclass(frozen=True)
class First:
    """A request's first system/developer message and what it is rendered with."""

    text: str
    role: str
    tools: Any
    template_kwargs: Any
    route: str


def first_system(body: Mapping[str, Any]) -> First | None:
    """The leading system/developer message of a chat body (`messages`) or a responses body (`input` items)."""
    items = body.get("messages")
    route = CHAT
    if not isinstance(items, list):
        items, route = body.get("input"), RESPONSES
    if not isinstance(items, list) or not items or not isinstance(items[0], Mapping):
        return None
    role = items[0].get("role")
    if role not in SYSTEM_ROLES:
        return None
    return First(message_text(items[0].get("content")), str(role), body.get("tools") or None,
                 body.get("chat_template_kwargs") or None, route)


def extract(body: Mapping[str, Any], markers: Sequence[str] = DEFAULT_MARKERS) -> StablePrefix | None:
    first = first_system(body)
    if first is None:
        return None
    text = first.text
    cut = min((i for i in (text.find(m) for m in markers if m) if i >= 0), default=-1)
    if cut < 0:
        return None
    stable = text[:cut].rstrip()
    if not stable:
        return None
    return StablePrefix(stable, first.role, first.tools, first.template_kwargs, first.route)


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
        **({"route": prefix.route} if prefix.route != CHAT else {}),  # chat prefixes keep their old names
    }
    return hashlib.sha256(canonical(doc).encode("utf-8", "surrogatepass")).hexdigest()


def file_name(fp: str) -> str:
    return f"prefix-{fp[:16]}.bin"


def bucket_file(upstream: str, i: int) -> str:
    """The `i`th of a server's bounded set of checkpoint names (a save dir out of reach: files are overwritten,
    never deleted; the index says which fingerprint a name holds now)."""
    return "prefix-" + hashlib.sha256(f"{upstream}\nbucket\n{i}".encode()).hexdigest()[:16] + ".bin"
