"""The physical limit of prefill for a workload: what a perfect cache with unlimited slots would prefill.

For every request, in start order, only the tokens beyond the longest prefix that *any* earlier request of
the run shared with it must be computed; at least 1 per request, because llama-server re-evaluates the last
token even on a full hit (`cache_n = N-1, prompt_n = 1`). No slot policy can beat this, so each
configuration's Σprompt_n is reported as a ratio to it.

Prompts are rendered and tokenized by the server itself (`POST /apply-template`, then `POST /tokenize`), so
the token lists are exactly what the server would prefill. The content is deterministic, so the limit only
depends on the start order of requests, which comes from one run (the first configuration run for the
workload, `stock` by default); the orders of other runs differ only in how sessions interleave.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx


class _Trie:
    """Token trie; `insert` returns the longest prefix of the new list already present."""

    def __init__(self) -> None:
        self.root: dict[int, Any] = {}

    def insert(self, tokens: Sequence[int]) -> int:
        node, shared, matching = self.root, 0, True
        for tok in tokens:
            nxt = node.get(tok)
            if nxt is None:
                matching = False
                nxt = node[tok] = {}
            elif matching:
                shared += 1
            node = nxt
        return shared


def new_tokens(token_lists: Sequence[Sequence[int]]) -> list[int]:
    """Per request (in the given order): tokens beyond the longest prefix shared with an earlier one, min 1."""
    trie = _Trie()
    return [max(1, len(tokens) - trie.insert(tokens)) for tokens in token_lists]


def render_tokens(server_url: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                  client: httpx.Client | None = None) -> list[int]:
    """The server's own token list for a chat request (template applied, generation prompt included)."""
    c = client or httpx.Client(timeout=60.0)
    try:
        r = c.post(server_url.rstrip("/") + "/apply-template", json={"messages": messages, "tools": tools})
        r.raise_for_status()
        prompt = r.json()["prompt"]
        r = c.post(server_url.rstrip("/") + "/tokenize", json={"content": prompt})
        r.raise_for_status()
        return [int(t) for t in r.json()["tokens"]]
    finally:
        if client is None:
            c.close()


def workload_limit(server_url: str, ordered: Sequence[tuple[list[dict[str, Any]], list[dict[str, Any]]]]
                   ) -> dict[str, Any]:
    """Limit for requests given as (messages, tools) in start order: per-request and total tokens."""
    with httpx.Client(timeout=60.0) as client:
        lists = [render_tokens(server_url, m, t, client) for m, t in ordered]
    per_request = new_tokens(lists)
    total = sum(len(t) for t in lists)
    return {"requests": len(lists), "prompt_tokens": total, "limit_tokens": sum(per_request),
            "per_request": per_request, "prompt_lengths": [len(t) for t in lists]}


RENDER_DROP = ("id_slot", "cache_prompt", "stream", "stream_options")


def render_body_tokens(server_url: str, body: dict[str, Any], client: httpx.Client) -> list[int]:
    """The server's token list for a whole chat-completions body (template kwargs, tools and all, as the
    completion handler would render it); the proxy's own fields and streaming switches are left out."""
    payload = {k: v for k, v in body.items() if k not in RENDER_DROP}
    r = client.post(server_url.rstrip("/") + "/apply-template", json=payload)
    r.raise_for_status()
    prompt = r.json()["prompt"]
    r = client.post(server_url.rstrip("/") + "/tokenize", json={"content": prompt})
    r.raise_for_status()
    return [int(t) for t in r.json()["tokens"]]
