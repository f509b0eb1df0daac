"""Which llama-server routes honour `id_slot` and `cache_prompt` (docs/llama-server.md).

`/v1/messages` (Anthropic) copies only a list of keys, and both fields are not among them: such a request is
pinned by sending it as a chat completion (`slotlogic/anthropic.py`), passed natively to a server that
honours them, or observed only (`slots_anthropic`). `/v1/messages/count_tokens` is not a completion.
"""

from __future__ import annotations

from enum import Enum

PINNABLE_PATHS = frozenset({
    "/completion",
    "/completions",
    "/v1/completions",
    "/chat/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/responses",
    "/infill",
})
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/messages"})
CHAT_PATHS = frozenset({"/chat/completions", "/v1/chat/completions"})
RESPONSES_PATHS = frozenset({"/v1/responses", "/responses"})


class Route(Enum):
    PINNABLE = "pinnable"
    ANTHROPIC = "anthropic"  # Anthropic Messages: stock llama-server ignores id_slot there
    OTHER = "other"


def normalise_path(path: str) -> str:
    """Path without query string or trailing slash."""
    path = path.split("?", 1)[0].split("#", 1)[0]
    return path.rstrip("/") or "/"


def classify(method: str, path: str) -> Route:
    if method.upper() != "POST":
        return Route.OTHER
    p = normalise_path(path)
    if p in PINNABLE_PATHS:
        return Route.PINNABLE
    if p in ANTHROPIC_PATHS:
        return Route.ANTHROPIC
    return Route.OTHER
