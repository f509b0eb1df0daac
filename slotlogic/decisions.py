"""The types that cross the boundary of the core: a request's facts in, a decision out, a report at the end.

(Plain slotted dataclasses: a request of a known session builds four of them, and a frozen dataclass's
`__init__` costs several times as much. Nothing changes them after they are made but the core itself.)

`Keeper.request` answers every request with exactly one of:
- `Forward`:  not ours (not a completion route, not a JSON object); forwarded untouched, not observed;
- `Observe`:  a completion request that goes out without a slot of ours (policy off, a route that ignores
              `id_slot`, an unknown server); its answer is still read and logged;
- `Pin`:      goes out with `body` (the client's bytes plus `id_slot` and `cache_prompt`);
- `NeedSlot`: the core cannot answer from memory; the driver asks the server and the shared state, then
              calls `Keeper.assign` and `Keeper.pin` (or `Keeper.fallback`), which end in `Pin` or `Observe`.
`Pin`, `Observe` and `NeedSlot` carry the request's `Ticket`: what the proxy decided about it, kept until the
answer completes and turned into a `Report` (the per-request line, the mitmweb comment, the flow's metadata).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from slotlogic.affinity import Learn
from slotlogic.answers import Observation
from slotlogic.endpoints import Route
from slotlogic.ledger import Loss, Promise
from slotlogic.prefix import StablePrefix
from slotlogic.reasons import Passed, Unpinned, Why, render
from slotlogic.restore_health import RestoreKind
from slotlogic.session import SessionId

Fields = tuple[tuple[bytes, bytes], ...]


@dataclass(frozen=True)
class Replay:
    """A saved flow replayed offline: what it carried besides its (rewritten) body."""

    client: Mapping[str, Any] | None   # id_slot / cache_prompt as the client had sent them
    facts: Mapping[str, Any] | None    # the `/props` and `/slots` facts behind its decision
    path: str | None = None            # the client's own path (a translated request went elsewhere)


@dataclass(slots=True)
class RequestFacts:
    method: str
    path: str
    fields: Fields                      # the raw header fields (mitmproxy's tuple)
    content: bytes | None               # the decoded body; None when absent, streamed or badly encoded
    now: float                          # the request's own start time
    replay: Replay | None = None


@dataclass(frozen=True, slots=True)
class Ticket:
    """What the proxy decided about one request: a value (each step of the core returns a new one)."""

    session: SessionId
    route: Route
    side: bool = False
    slot: int | None = None
    why: Why | None = None
    unpinned: Unpinned | None = None
    displaced: bool = False
    paged_in: bool = False
    seeded: bool = False                                   # started from another session's conversation
    translated: bool = False                               # an Anthropic request sent as a chat completion
    client: dict[str, Any] = field(default_factory=dict)   # id_slot / cache_prompt as the client sent them
    facts: dict[str, Any] | None = None                    # server facts behind a new session's decision
    learn: Learn | None = None   # pending (`slots_policy=affinity`): how the slot llama-server chose is read
    placed: int | None = None    # pending: its number among the requests the server places (`Ledger.placed`)
    promise: Promise | None = None   # what the slot ledger said its slot holds for it when it was pinned
    extends: bool | None = None      # its messages start with all of its previous request's (None: unknown)
    restore: tuple[RestoreKind, int] | None = None  # a restore put this many tokens of its prompt in its slot

    @property
    def reason(self) -> str:
        return render(self.why, self.unpinned, displaced=self.displaced, paged_in=self.paged_in,
                      seeded=self.seeded)


@dataclass(slots=True)
class Forward:
    reason: Passed
    completion_route: bool   # worth a log line: a completion route whose body we cannot read


@dataclass(slots=True)
class Observe:
    ticket: Ticket
    body: bytes | None = None   # replay only: the client's own bytes


@dataclass(slots=True)
class Pin:
    ticket: Ticket
    body: bytes | None          # None: the body already is what goes out (the client set both fields)

    @property
    def path(self) -> str | None:
        """The route it goes to when that is not the client's (a translated Anthropic request)."""
        return TRANSLATED_PATH if self.ticket.translated else None


TRANSLATED_PATH = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class NeedSlot:
    """A request that needs a slot (`Keeper.request`): a value, handed to `Keeper.assign`, never edited."""

    ticket: Ticket
    body: dict[str, Any]        # the parsed request
    content: bytes              # the client's bytes, for the splice
    prefix: str | None          # what slot contents are compared by (stable prefix or system prompt + tools)
    stable: StablePrefix | None  # the shared prefix a checkpoint can warm
    displaced_from: int | None = None


Decision = Forward | Observe | Pin | NeedSlot


@dataclass(slots=True)
class Report:
    """A finished request, as the log line, the mitmweb view and the flow's metadata show it."""

    ticket: Ticket
    obs: Observation
    slot: int | None
    path: str
    upstream: str
    seconds: float
    loss: Loss | None = None   # tokens the session had that its slot did not hold for this request
    settled: bool = True       # False: its loss's cause is still being asked of the server (`Outcomes.settle_loss`)
    saved_s: float = 0.0       # prefill seconds its cached tokens would have cost (`Outcomes.saved_seconds`)

    @property
    def metadata(self) -> dict[str, Any]:
        """`flow.metadata["slotkeeper"]`: JSON-like only (mitmproxy saves it with the flow)."""
        t = self.ticket
        out = {"session": t.session.key, "source": t.session.source, "slot": self.slot, "reason": t.reason,
               "side": t.side, "cache_n": self.obs.cache_n, "prompt_n": self.obs.prompt_n,
               "outcome": self.obs.outcome, "client": t.client, "facts": t.facts}
        if self.loss is not None and self.settled:
            out["loss"] = {"tokens": self.loss.tokens, "cause": self.loss.cause.value, "expected": self.loss.expected}
        if t.unpinned is not None:
            out["unpinned"] = t.unpinned.value  # sent with `id_slot: -1` by the proxy's own decision
        if t.translated:
            out["path"] = self.path  # the request went upstream as a chat completion; this is what was asked
        return out
