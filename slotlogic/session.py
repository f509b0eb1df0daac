"""Who sent this request: the session key, from a header, then the body's ids, then the content.

The content rule keys a chat body by its conversation root (system prompt, tools, first user message), told
apart by user messages where a client opens every conversation alike (`Threads`), and a raw prompt by the
continuation rule. Keys are SHA-256 digests: no prompt text or raw header value is ever stored or logged.
The prefix signature (system prompt + tools) lets the slot chooser prefer a slot holding the same prefix.
docs/behaviour.md ("Sessions") and docs/clients.md say what each client sends.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from slotlogic.endpoints import CHAT_PATHS, RESPONSES_PATHS, normalise_path

DEFAULT_SESSION_HEADERS = (
    "x-claude-code-session-id",
    "x-session-affinity",
    "session_id",
    "session-id",
    "x-session-id",
    "x-opencode-session",
    "x-conversation-id",
)
SYSTEM_ROLES = frozenset({"system", "developer"})


def digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()[:16]


def canonical(value: Any) -> str:
    """Canonical JSON: sorted keys, array order kept, no whitespace."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


@dataclass(frozen=True)
class SessionId:
    key: str     # 16 hex digest, the identity used everywhere
    source: str  # e.g. "header:x-session-affinity", "body:prompt_cache_key", "content:root"

    @property
    def short(self) -> str:
        return self.key[:8]


@dataclass(frozen=True)
class PromptMark:
    """What the continuation rule remembers of a session's last prompt: its length and digest."""

    length: int
    digest: str


# ---------------------------------------------------------------------------------------------------
# Extracting text from the different body shapes


def message_text(content: Any) -> str:
    """A message's content as text: strings as-is, part arrays joined, anything else canonical JSON."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                out.append(part["text"])
            else:
                out.append(canonical(part))
        return "\n".join(out)
    if content is None:
        return ""
    return canonical(content)


def _messages(body: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """The message objects, lazily: callers stop at the first few, so a long conversation costs nothing."""
    msgs = body.get("messages")
    if isinstance(msgs, list):
        for m in msgs:
            if isinstance(m, Mapping):
                yield m


def system_text(body: Mapping[str, Any], path: str) -> str | None:
    """The leading system/developer text of a chat or responses body, None when there is none."""
    p = normalise_path(path)
    items: Iterable[Any] = _messages(body)
    if p in RESPONSES_PATHS:
        instr = body.get("instructions")
        if isinstance(instr, str):
            return instr
        items = body.get("input") if isinstance(body.get("input"), list) else []  # leading developer items
    parts = []
    for m in items:
        if not isinstance(m, Mapping):
            break
        if m.get("role") not in SYSTEM_ROLES:
            break
        parts.append(message_text(m.get("content")))
    return "\n".join(parts) if parts else None


def first_user_text(body: Mapping[str, Any], path: str) -> str | None:
    p = normalise_path(path)
    if p in RESPONSES_PATHS:
        inp = body.get("input")
        if isinstance(inp, str):
            return inp
        if isinstance(inp, list):
            for item in inp:
                if isinstance(item, Mapping) and item.get("role", "user") == "user":
                    return message_text(item.get("content"))
        return None
    for m in _messages(body):
        if m.get("role") == "user":
            return message_text(m.get("content"))
    return None


def prompt_text(body: Mapping[str, Any]) -> str | None:
    """The raw prompt of `/completion`-style and `/infill` bodies, as one string."""
    if "prompt" in body:
        prompt = body["prompt"]
        return prompt if isinstance(prompt, str) else canonical(prompt)
    if "input_prefix" in body or "input_extra" in body:
        return canonical([body.get("input_extra"), body.get("input_prefix")])
    return None


def is_chat_like(body: Mapping[str, Any], path: str) -> bool:
    p = normalise_path(path)
    return p in CHAT_PATHS or p in RESPONSES_PATHS or ("messages" in body and "prompt" not in body)


def prefix_signature(body: Mapping[str, Any], path: str) -> str | None:
    """Digest of the shared prefix (system prompt + tools + template kwargs); None without a system prompt."""
    system = system_text(body, path)
    if system is None:
        return None
    return digest("prefix", system, canonical(body.get("tools")), canonical(body.get("chat_template_kwargs")))


def prompt_mark(body: Mapping[str, Any]) -> PromptMark | None:
    text = prompt_text(body)
    if text is None:
        return None
    return PromptMark(len(text), digest("prompt", text))


# ---------------------------------------------------------------------------------------------------
# Resolution


def _header_key(headers: Mapping[str, str], names: Iterable[str]) -> SessionId | None:
    lowered = headers if getattr(headers, "lowercase_keys", False) else {k.lower(): v for k, v in headers.items()}
    for name in names:
        value = lowered.get(name.lower())
        if value and value.strip():
            return SessionId(digest("header", value.strip()), f"header:{name.lower()}")
    return None


def _user_id_session(user_id: Any) -> str | None:
    """`metadata.user_id`: JSON `{"session_id": …}` (Claude Code ≥ 2.1.78) or `…_session_<uuid>`."""
    if not isinstance(user_id, str) or not user_id:
        return None
    if user_id.lstrip().startswith("{"):
        try:
            parsed = json.loads(user_id)
        except (ValueError, RecursionError):
            parsed = None
        if isinstance(parsed, Mapping):
            sid = parsed.get("session_id")
            if isinstance(sid, str) and sid:
                return sid
    if "_session_" in user_id:
        tail = user_id.rsplit("_session_", 1)[1]
        return tail or None
    return None


def _body_key(body: Mapping[str, Any]) -> SessionId | None:
    metadata = body.get("metadata")
    if isinstance(metadata, Mapping):
        sid = _user_id_session(metadata.get("user_id"))
        if sid:
            return SessionId(digest("body", sid), "body:metadata.user_id")
    for name in ("prompt_cache_key", "promptCacheKey", "user"):
        value = body.get(name)
        if isinstance(value, str) and value.strip():
            return SessionId(digest("body", value.strip()), f"body:{name}")
    return None


def conversation_root(body: Mapping[str, Any], path: str) -> SessionId | None:
    system = system_text(body, path)
    first = first_user_text(body, path)
    if system is None and first is None:
        return None
    root = digest("root", system or "", tool_names(body.get("tools")), first or "")
    return SessionId(root, "content:root")


def user_digests(body: Mapping[str, Any], path: str) -> tuple[str, ...]:
    """Digests of the user messages' heads (first non-empty line, at most 200 characters), in order, each once.
    The head, not the whole text: aider sends the current prompt with a reminder appended and keeps only the
    bare prompt in the history of the next turn. Bounded in bytes, not only in conversations: the first
    `MAX_USER_HEADS` distinct heads among the first `MAX_USER_SCAN` items (a body of 1.5M empty items kept
    146 MB of digests per conversation root, and hashed them on the event loop). Two conversations that share
    their root and all of those are one conversation here."""
    if normalise_path(path) in RESPONSES_PATHS:
        inp = body.get("input")
        items: Iterable[Any] = inp if isinstance(inp, list) else ([{"content": inp}] if isinstance(inp, str) else [])
        default_role: str | None = "user"
    else:
        msgs = body.get("messages")
        items, default_role = (msgs if isinstance(msgs, list) else []), None
    heads: dict[str, None] = {}
    for item in itertools.islice(items, MAX_USER_SCAN):
        if isinstance(item, Mapping) and item.get("role", default_role) == "user":
            heads.setdefault(digest("user", _head(message_text(item.get("content")))))
            if len(heads) >= MAX_USER_HEADS:
                break
    return tuple(heads)


def _head(text: str) -> str:
    rest = text.lstrip()
    return rest[:1024].splitlines()[0].strip()[:200] if rest else ""


def _included(earlier: Sequence[str], now: Sequence[str]) -> bool:
    return set(earlier) <= set(now)


MAX_ROOTS = 512            # conversation roots remembered (each with its conversations)
MAX_USER_HEADS = 16        # user-message heads remembered per conversation (~1.2 KB; all roots: ~20 MB at most)
MAX_USER_SCAN = 4096       # leading items of a request read for them
MAX_THREADS_PER_ROOT = 32  # conversations remembered per root, the least recently seen go first


@dataclass
class Threads:
    """Conversations that share one root, told apart by their user messages.

    A conversation's next request holds every user message of its earlier ones (appended at the end by most
    clients; aider moves its file context after the history, so order is not required). Another conversation
    with the same root lacks at least one of them: it gets a key of its own. The first conversation of a root
    keeps the plain root key. Only digests of the messages' heads are kept; bounded (LRU)."""

    roots: OrderedDict[str, OrderedDict[str, tuple[str, ...]]] = field(default_factory=OrderedDict)

    def place(self, root: SessionId, users: tuple[str, ...]) -> SessionId:
        """The conversation this request belongs to (its user messages are remembered for the next one)."""
        known = self.roots.get(root.key)
        if known is None:
            known = self.roots[root.key] = OrderedDict()
            while len(self.roots) > MAX_ROOTS:
                self.roots.popitem(last=False)
            key = root.key
        else:
            self.roots.move_to_end(root.key)
            matches = [(len(seen), k) for k, seen in known.items() if _included(seen, users)]
            key = max(matches)[1] if matches else (digest(root.key, *users) if known else root.key)
        known[key] = users
        known.move_to_end(key)
        while len(known) > MAX_THREADS_PER_ROOT:
            known.popitem(last=False)
        return SessionId(key, root.source)


def tool_names(tools: Any) -> str:
    """The tool set by name: enough to tell two conversation roots apart, and cheap on the hot path
    (the full schemas are hashed only for the prefix signature, off the hot path)."""
    if not isinstance(tools, list):
        return ""
    names = []
    for t in tools:
        fn = t.get("function") if isinstance(t, Mapping) else None
        name = fn.get("name") if isinstance(fn, Mapping) else (t.get("name") if isinstance(t, Mapping) else None)
        names.append(name if isinstance(name, str) else "?")
    return "\x1f".join(names)


def continuation(body: Mapping[str, Any], known: Mapping[str, PromptMark]) -> SessionId | None:
    """The known session whose last prompt this prompt extends (the longest such prompt wins). The prompt's
    prefix digests are taken in one pass, shortest first, a running hash copied at each remembered length: the
    prompt is hashed once, whatever the number of remembered prompts (hashing it again from its start for each
    length cost 488 MB of hashing a request with 512 remembered 1 MB prompts)."""
    text = prompt_text(body)
    if text is None:
        return None
    by_length: dict[int, list[str]] = {}
    for key, mark in known.items():
        if mark.length <= len(text):
            by_length.setdefault(mark.length, []).append(key)
    if not by_length:
        return None
    best: str | None = None
    running, at = hashlib.sha256(b"prompt\x00"), 0
    for length in sorted(by_length):
        running.update(text[at:length].encode("utf-8", "surrogatepass"))
        at = length
        head = running.copy()
        head.update(b"\x00")
        found = head.hexdigest()[:16]
        best = next((k for k in by_length[length] if known[k].digest == found), best)
    return None if best is None else SessionId(best, "content:continuation")


def resolve(headers: Mapping[str, str], body: Mapping[str, Any], path: str, *,
            header_names: Iterable[str] = DEFAULT_SESSION_HEADERS,
            known_prompts: Mapping[str, PromptMark] | None = None, threads: Threads | None = None) -> SessionId:
    """The session of a request. Always returns a key: at worst the digest of the whole body.

    A header or body key names a *client* session, which can hold several conversations (a title call, a
    parent and its subagents): each conversation is its own slot session, so the key is the named session
    together with the conversation root when the body has one."""
    found = _header_key(headers, header_names) or _body_key(body)
    if found:
        root = conversation_root(body, path) if is_chat_like(body, path) else None
        return SessionId(digest(found.key, root.key), found.source) if root else found
    if is_chat_like(body, path):
        root = conversation_root(body, path)
        if root:
            return threads.place(root, user_digests(body, path)) if threads is not None else root
    cont = continuation(body, known_prompts or {})
    if cont:
        return cont
    text = prompt_text(body)
    if text is not None:
        return SessionId(digest("prompt", text), "content:prompt")
    return SessionId(digest("body", canonical(body)), "content:body")
