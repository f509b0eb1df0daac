"""Which llama-server routes honour `id_slot` and `cache_prompt` (docs/llama-server.md).

`/v1/messages` (Anthropic) copies only a whitelist of keys, so both fields are dropped there: we pass it
through and say so instead of pretending to pin it.
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
UNPINNABLE_PATHS = frozenset({"/v1/messages"})
CHAT_PATHS = frozenset({"/chat/completions", "/v1/chat/completions"})
RESPONSES_PATHS = frozenset({"/v1/responses", "/responses"})


class Route(Enum):
    PINNABLE = "pinnable"
    UNPINNABLE = "unpinnable"  # a completion route that ignores id_slot (Anthropic messages)
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
    if p in UNPINNABLE_PATHS:
        return Route.UNPINNABLE
    return Route.OTHER
