"""Lost tokens, from the simulator's ground truth: what a session's own previous request left (in its slot, or
in a page) that its next request did not find, and why.

A request of session S lost `min(expected, n-1) - cache_n` tokens, where `expected` is how much of its prompt
S's previous request left in the slot it ran on (`bench.sim.llama.Done`). The cause is read from what happened
between S's two requests (the simulated slots' event log) and from what the proxy said about the request
(its `why`): a restart or unified-KV idle clearing are expected and labelled so; a session the proxy placed
anew or called displaced without paging on (an eviction it chose) is given away knowingly; a request the proxy
passed through on a server that clears idle slots was placed by the server (`server-placed`), as with no
proxy. Anything else is a loss the product must not have:
- the proxy said `known`/`resumed`, yet something wrote over the slot: `prefix-restore-over-owner`,
  `page-in-over-owner`, `side-call-over-owner`, `proxy-request-over-owner`,
  `other-proxy-request-over-owner`, `overwritten`, `erased`;
- it paged the session in from the wrong file: `stale-page` (older than the conversation),
  `page-of-another-conversation`, `page-in-overwritten`;
- (labelled `recomputed`) the proxy weighed a page-out or page-in of the session by the measured speeds and
  declined it, prefilling being the cheaper: it chose to prefill those tokens again; (labelled `page-budget`)
  its newest page was deleted before it came back, to keep the save dir within the page budget;
- it moved the session without paging it in (`not-paged-in`, paging on), to another slot (`moved-slot`) or
  server (`moved-server`); `unknown` otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.sim.harness import Outcome, Rig
from bench.sim.llama import SimServer, SlotEvent, common_prefix

EXPECTED = frozenset({"restart", "idle-clear", "given-away", "server-placed", "recomputed", "page-budget"})
# What the proxy says when it passes a request through on a server that clears idle slots (Unpinned.IDLE_CLEARED)
PASSED = "passed through"
KNOWN = ("known", "resumed")  # the proxy's word for "your slot still holds your conversation"
# what the proxy itself decided to send with id_slot -1 (its record's `unpinned`): held to its client's patience,
# or its server unknown
GIVEN_UP = ("wait-bound", "side-busy", "unpinned: server unknown")


@dataclass
class Loss:
    tag: str
    server: str
    slot: int
    tokens: int
    expected: int
    cache_n: int
    cause: str
    why: str                      # the proxy's own `why=` for the request
    steps: list[str] = field(default_factory=list)

    @property
    def labelled(self) -> bool:
        """An expected loss (restart, idle clearing) or one the proxy chose (an eviction without paging)."""
        return self.cause in EXPECTED

    def line(self) -> str:
        return (f"{self.tag} on {self.server} slot {self.slot}: lost {self.tokens} of {self.expected} "
                f"(cache_n={self.cache_n}) cause={self.cause} why={self.why}")


def _fmt(e: SlotEvent) -> str:
    who = f" {e.tag}" if e.tag else ""
    return f"t={e.t:.3f} slot {e.slot}: {e.kind}{who} {e.before}->{e.after}" + (f" reused {e.reused}"
                                                                           if e.kind == "request" else "")


def find_losses(rig: Rig) -> list[Loss]:
    last: dict[str, Outcome] = {}
    out: list[Loss] = []
    for o in sorted((o for o in rig.outcomes if o.done is not None), key=lambda o: o.done.started):  # type: ignore
        d = o.done
        assert d is not None
        prev = last.get(o.tag)
        last[o.tag] = o
        if d.lost <= 0 or prev is None or prev.done is None or o.server is None:
            continue
        out.append(_explain(rig, o, prev))
    return out


def _explain(rig: Rig, o: Outcome, prev: Outcome) -> Loss:
    d, p = o.done, prev.done
    assert d is not None and p is not None and o.server is not None and prev.server is not None
    why = str(o.meta.get("reason", "-"))
    loss = Loss(o.tag, o.server, d.slot, d.lost, min(d.expected, d.n_tokens - 1), d.cache_n, "unknown", why)
    server, before = rig.servers[prev.server], rig.servers[o.server]
    window = [e for e in server.events if p.ended <= e.t <= d.started]
    on_prev = [e for e in window if e.slot == p.slot]
    loss.steps = [f"{o.tag}'s previous request: slot {p.slot} of {prev.server}, left {d.left_before} tokens "
                  f"(t={p.ended:.3f})"] + [_fmt(e) for e in on_prev]
    if o.server != prev.server:
        loss.steps.append(f"this request went to {o.server} slot {d.slot}")
    elif d.slot != p.slot:
        loss.steps += [_fmt(e) for e in window if e.slot == d.slot]
    loss.steps.append(f"this request: slot {d.slot}, why={why}, cache_n={d.cache_n} of {loss.expected} expected")
    if any(p.ended <= t <= d.started for t in server.restarts) or d.generation != p.generation:
        loss.cause = "restart"
    elif _declined(rig, o, p.ended, d.started):
        loss.cause = "recomputed"
    elif "paged-in" not in why and _page_deleted(rig, server, o.tag, p.ended, d.started):
        loss.cause = "page-budget"
    elif any(e.kind == "idle-clear" for e in on_prev):
        loss.cause = "idle-clear"
    elif why.startswith(PASSED):
        # sent as the client sent it, on a server that clears idle slots: the server chose the slot, as with no
        # proxy (the simulated server has no RAM prompt cache, which is what serves these on a real one)
        loss.cause = "server-placed"
    elif _given_away(rig, on_prev, o.tag) or o.meta.get("unpinned") in GIVEN_UP:
        # written over by a request the proxy itself sent with id_slot -1, or this request is one: held to its
        # client's patience (or its server unknown), it went where it could start, its own page-in given up
        loss.cause = "given-away"
    elif o.server != prev.server:
        # paging off, its slot written by another session since, placed anew: an eviction the proxy chose
        taken = any(e.kind == "request" and e.tag != o.tag for e in on_prev)
        loss.cause = "given-away" if taken and not rig.setup.paging and not why.startswith(KNOWN) \
            else "moved-server"
    elif "paged-in" in why:
        restores = [e for e in before.events if e.slot == d.slot and e.kind == "restore" and e.t <= d.started]
        f = before.files.get(restores[-1].tag or "") if restores else None
        left = before.left_before.get(d.task, [])
        if f is not None and common_prefix(f.tokens, left) < len(f.tokens):
            loss.cause = "page-of-another-conversation"
            loss.steps.append(f"the page restored ({restores[-1].tag}) was written from {f.writer}'s tokens")
        elif f is not None and len(f.tokens) < d.left_before:
            loss.cause = "stale-page"
            loss.steps.append(f"the page restored ({restores[-1].tag}) holds {len(f.tokens)} of the "
                              f"{d.left_before} tokens {o.tag} had left")
        else:
            loss.cause = "page-in-overwritten"
    elif not why.startswith(KNOWN) and prev.meta.get("unpinned") in GIVEN_UP:
        # its previous request went out with id_slot -1 by the proxy's own choice: where it ran is the server's
        # to say, and when the proxy could not learn it the conversation was given up with that request
        loss.cause = "given-away"
    elif not why.startswith(KNOWN):  # the proxy placed it anew or knew it was displaced
        loss.cause = "not-paged-in" if rig.setup.paging else "given-away"
    elif d.slot != p.slot:
        loss.cause = "moved-slot"
    else:
        loss.cause = _overwritten(rig, on_prev, o.tag)
    return loss


def _declined(rig: Rig, o: Outcome, since: float, until: float) -> bool:
    """The proxy weighed moving `o`'s session's conversation (a page-out, or its page-in) between its two
    requests and declined it by cost."""
    key = str(o.meta.get("session", ""))[:8]
    return bool(key) and any(since <= t <= until and w.session == key and not w.choice.worth
                             for t, w in rig.weighed)


def _page_deleted(rig: Rig, server: SimServer, tag: str, since: float, until: float) -> bool:
    """`tag`'s newest page saved between its two requests was deleted before the second, or overwritten by
    another session's save (a save dir out of the proxy's reach reuses a bounded set of names)."""
    saves = [e for e in server.events if e.kind == "save" and since <= e.t <= until and e.writer == tag]
    if not saves:
        return False
    last = saves[-1]
    overwritten = any(e.kind == "save" and e.tag == last.tag and e.writer != tag and last.t < e.t <= until
                      for e in server.events)
    return overwritten or rig.deleted.get(last.tag or "", until + 1) <= until


def _given_away(rig: Rig, events: list[SlotEvent], tag: str) -> bool:
    """The first write over `tag`'s slot was a request the proxy itself sent with `id_slot: -1` (its record says
    `unpinned`): held to its client's patience, it went where it could start, over a conversation the proxy
    gave up knowingly and labelled so (docs/scheduler.md)."""
    for e in events:
        if e.kind == "save" or (e.kind == "request" and e.tag == tag):
            continue
        if e.kind != "request":
            return False
        return any(o.tag == e.tag and o.done is not None and o.done.started == e.t
                   and o.meta.get("unpinned") in GIVEN_UP for o in rig.outcomes)
    return False


def _overwritten(rig: Rig, events: list[SlotEvent], tag: str) -> str:
    """What first wrote over a slot the proxy still counted as `tag`'s (the events after tag's last request)."""
    side = {o.tag for o in rig.outcomes if o.meta.get("side")}
    proxy_of = {o.tag: o.proxy for o in rig.outcomes}
    for e in events:
        if e.kind == "request" and e.tag == tag:
            continue
        if e.kind == "save":
            continue  # a save reads the slot
        if e.kind == "restore":
            return "prefix-restore-over-owner" if (e.tag or "").startswith("prefix-") else "page-in-over-owner"
        if e.kind == "request" and e.tag in side:
            return "side-call-over-owner"
        if e.kind == "request" and e.tag is None:
            return "proxy-request-over-owner"
        if e.kind == "request":
            return "other-proxy-request-over-owner" if proxy_of.get(e.tag) != proxy_of.get(tag) else "overwritten"
        if e.kind in ("erase", "restore-failed"):
            return "erased"
    return "unknown"
