"""A request's intake: what it is, whose session it belongs to, and the body that names it (pure).

Why apart: the keeper decides where a request goes; the intake reads it first. It classifies the route, recognises
a known session's next turn from its bytes (`slotlogic.fastpath`, the hot path: no parse), or parses the body,
undoes a recorded flow's rewrite, sees an Anthropic request as the chat request it renders as (its billing block
dropped when configured) and names its session (`slotlogic.session`). For a session that needs a slot it finds the
stable prefix (a client's marker, or one learned from traffic). What servers of one pool share (request shapes,
prompt marks, conversation threads) is one `Recognition`, handed to every server's intake.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from slotlogic import anthropic, json_scan, rewrite, sidecalls
from slotlogic import lead as leads
from slotlogic import prefix as pfx
from slotlogic import session as sess
from slotlogic.decisions import TRANSLATED_PATH, Fields, Forward, NeedSlot, Observe, Replay, RequestFacts, Ticket
from slotlogic.endpoints import Route
from slotlogic.fastpath import Shape, ShapeIndex, fields_absent
from slotlogic.learned_prefix import PrefixLearner
from slotlogic.ledger import Ledger
from slotlogic.reasons import Passed, Unpinned
from slotlogic.settings import AnthropicMode, Settings

MAX_MARKS = 512  # prompts remembered for the continuation rule of raw `/completion` bodies
# Objects and arrays a request body may hold to be parsed: what a parse costs is theirs more than its bytes
# (~200 bytes each: ~20 MB at most, ~0.1 s). A real agent's request holds a few thousand.
MAX_ITEMS = 100_000


@dataclass
class Recognition:
    """What recognises a session's next request, shared by every server of a pool (a known session's next turn
    is recognised once, whatever server it is on)."""

    shapes: ShapeIndex = field(default_factory=ShapeIndex)  # known sessions' request shapes: no parse
    marks: OrderedDict[str, sess.PromptMark] = field(default_factory=OrderedDict)
    threads: sess.Threads = field(default_factory=sess.Threads)  # one content root's conversations apart
    # stable prefixes learned from the sessions of every server (two siblings parsed by two servers still teach)
    learner: PrefixLearner = field(default_factory=PrefixLearner)
    placements: list[int] = field(default_factory=lambda: [0])  # the pool's placements counted (`SessionTable`)

    def remember(self, key: str, mark: sess.PromptMark | None) -> None:
        if mark is None:
            return
        self.marks[key] = mark
        self.marks.move_to_end(key)
        while len(self.marks) > MAX_MARKS:
            self.marks.popitem(last=False)


class IntakeHost(Protocol):
    """What the intake reads of its keeper: whether the server honours id_slot on /v1/messages (probed)."""

    @property
    def messages_native(self) -> bool | None: ...


@dataclass(frozen=True)
class Arrival:
    """A parsed request with its session named: what the keeper places (`seen` names the session and prefix)."""

    ticket: Ticket
    req: _Seen
    original: bytes | None


@dataclass(frozen=True)
class _Read:
    """A request body parsed (a recorded flow's rewrite undone: `original` is what the client sent)."""

    body: dict[str, Any]
    content: bytes
    original: bytes | None


@dataclass
class _Seen:
    """The body to send (`body`, `content`) and the chat-shaped view that names the session (`seen`)."""

    body: dict[str, Any]
    content: bytes
    chat: dict[str, Any] | None    # an Anthropic request as a chat completion (None: not one, or untranslatable)
    seen: dict[str, Any]
    seen_path: str
    native: bool                   # an Anthropic request goes to the server's own /v1/messages
    translated: bool = False       # `body` is the chat completion an Anthropic request was translated to


class LowerHeaders(dict[str, str]):
    """Request headers as a plain dict with lower-case names, built from the raw fields (mitmproxy's multidict
    look-ups are slow). The first value of a repeated header wins."""

    lowercase_keys = True

    def __init__(self, fields: Fields) -> None:
        super().__init__()
        for k, v in fields:
            self.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))


class Intake:
    def __init__(self, settings: Settings, ledger: Ledger, host: IntakeHost,
                 recognition: Recognition | None = None) -> None:
        self.settings = settings
        self.ledger = ledger
        self.host = host
        self.recognition = recognition or Recognition()
        self.learner = self.recognition.learner
        self.learner.min_chars = settings.prefix_min_chars

    def known(self, facts: RequestFacts, route: Route) -> Shape | None:
        """The hot path without a parse (`slotlogic.fastpath`): the shape of a known session's next chat request
        (the byte match proved it carries no id_slot/cache_prompt and appends to its previous request's
        messages); the keeper builds its one ticket once it knows the slot (`keeper._known_ticket`)."""
        if route is not Route.PINNABLE or facts.replay is not None or not facts.content:
            return None
        shapes = self.recognition.shapes
        if not shapes:
            return None
        named = self.settings.header_bytes
        if any(k.lower() in named for k, _ in facts.fields):
            return None  # a header names the session: the full path reads it
        return shapes.match(facts.path, facts.content)

    def read(self, facts: RequestFacts, route: Route) -> Arrival | Forward | Observe:
        """Parse the request and name its session: an `Arrival`, or a request that is not ours to pin."""
        read = _read(facts)
        if isinstance(read, Forward):
            return read
        req = self._as_seen(read, route, facts.path)
        s, rec = self.settings, self.recognition
        key = sess.resolve(LowerHeaders(facts.fields), req.seen, req.seen_path, header_names=s.session_headers,
                           known_prompts=rec.marks, threads=rec.threads)
        side = sidecalls.is_side_call(sess.system_text(req.seen, req.seen_path), s.side_patterns)
        if side:  # its slot content is its kind's, not the session's it came with (`sidecalls.home`)
            key = sidecalls.home(sess.prefix_signature(req.seen, req.seen_path), key)
        client = {k: req.body.get(k) for k in ("id_slot", "cache_prompt")}
        rec.remember(key.key, sess.prompt_mark(req.body))
        extends, mark = leads.extends(req.seen, self.ledger.marks.get(key.key))
        if mark is not None:
            self.ledger.marks.put(key.key, mark, self.ledger.max_sessions)
        refused = self._translate(req) if route is Route.ANTHROPIC else None
        if refused is not None:
            return Observe(Ticket(key, route, client=client, extends=extends, unpinned=refused), read.original)
        if facts.replay is None and fields_absent(req.body):
            rec.shapes.learn(facts.path, req.content, key, side)
        ticket = Ticket(key, route, side=side, translated=req.translated, client=client, extends=extends)
        return Arrival(ticket, req, read.original)

    def need_slot(self, ticket: Ticket, req: _Seen, now: float, displaced_from: int | None) -> NeedSlot:
        """A new or displaced session: what the driver needs to claim it a slot (its stable prefix above all)."""
        # The stable prefix: up to a client's known marker (the instant path), else learned from traffic: a new
        # session's system message is compared with the other sessions' (never a displaced one's, nor a side
        # call's: those are no new conversations).
        stable = pfx.extract(req.seen, self.settings.markers)
        if stable is None and not ticket.side and displaced_from is None:
            self.learner.observe(ticket.session.key, req.seen, now)
        if stable is None:
            stable = self.learner.find(req.seen, now)
        # What the ranking compares slot contents by: the stable prefix when there is one (windows of two
        # projects share it), else the whole system prompt + tools.
        prefix = stable.signature if stable else sess.prefix_signature(req.seen, req.seen_path)
        return NeedSlot(ticket, req.body, req.content, prefix, stable, displaced_from)

    def _as_seen(self, read: _Read, route: Route, path: str) -> _Seen:
        """The request as the rest of the core sees it: an Anthropic request (its billing block dropped when
        configured) as the chat request it renders as, so it names its session and prefix like one."""
        s = self.settings
        body, content = read.body, read.content
        native = self._messages_native()
        if route is not Route.ANTHROPIC:
            return _Seen(body, content, None, body, path, native)
        if s.strip_billing and s.anthropic is not AnthropicMode.OFF:
            stripped = anthropic.strip_billing(body)
            if stripped is not None:
                body = stripped
                if native:  # the native route sends these bytes (a translated request is encoded later)
                    content = _encoded(stripped) or content
        chat = _as_chat(body)
        seen = body if chat is None else {**chat, "metadata": body.get("metadata")}
        return _Seen(body, content, chat, seen, path if chat is None else TRANSLATED_PATH, native)

    def _messages_native(self) -> bool:
        mode = self.settings.anthropic
        return mode is AnthropicMode.NATIVE or (mode is AnthropicMode.TRANSLATE and self.host.messages_native is True)

    def _translate(self, req: _Seen) -> Unpinned | None:
        """An Anthropic request made ready to pin: as it is (native), or as its chat completion (translate).
        Why it is only observed instead (the mode is off, or the request cannot be translated)."""
        if self.settings.anthropic is AnthropicMode.OFF:
            return Unpinned.ROUTE
        if req.native:
            return None
        encoded = _encoded(req.chat)
        if req.chat is None or encoded is None:
            return Unpinned.UNTRANSLATABLE
        req.body, req.content, req.translated = req.chat, encoded, True
        return None


def _read(facts: RequestFacts) -> _Read | Forward:
    content = facts.content or b""
    if json_scan.containers_over(content, MAX_ITEMS):  # passed untouched, as a body too large to read is
        return Forward(Passed.TOO_MANY_ITEMS, completion_route=True)
    body = _parse(content)
    original = None
    if facts.replay is not None and isinstance(body, dict):
        body, original = _undo_rewrite(body, content, facts.replay)
        content = original or content
    if not isinstance(body, dict):
        return Forward(Passed.NOT_JSON_OBJECT, completion_route=True)
    return _Read(body, content, original)


def _as_chat(body: dict[str, Any]) -> dict[str, Any] | None:
    try:
        return anthropic.to_chat(body)
    except anthropic.TranslationError:
        return None


def _encoded(chat: dict[str, Any] | None) -> bytes | None:
    try:
        return anthropic.encode(chat) if chat is not None else None
    except anthropic.TranslationError:
        return None


def _parse(content: bytes) -> Any:
    if not content:
        return None
    try:
        return json.loads(content)
    except (ValueError, UnicodeDecodeError, RecursionError):  # 100k nested arrays: not ours
        return None


def _undo_rewrite(body: dict[str, Any], content: bytes, replay: Replay) -> tuple[dict[str, Any], bytes | None]:
    """A saved flow holds the body we sent upstream: put back what the client itself had sent, and its bytes
    when our rewrite was the splice (so the replayed rewrite gives the recorded bytes again)."""
    client = replay.client
    if not isinstance(client, Mapping):
        return body, None
    out = dict(body)
    for name in ("id_slot", "cache_prompt", "verbose"):
        if name in client:
            if client[name] is None:
                out.pop(name, None)
            else:
                out[name] = client[name]
    original = None
    if client.get("id_slot") is None and client.get("cache_prompt") is None:
        original = rewrite.unsplice(content)
    return out, original
