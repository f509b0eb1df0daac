"""Requests the proxy sent for llama-server to place (`id_slot: -1`), and whether it learned where they ran.

Why: such a request whose answer never names its slot may have overwritten any idle slot, so a conversation
later found short with no other cause is blamed on it (`unpinned`), but only on one that could have done it:
sent before the short request, and answered unlearned after the short session's previous answer. Pure and
bounded (`CAP` open and `CAP` unlearned); a forgotten unlearned answer is still blamed, so forgetting never
turns an explained loss into `unknown`. docs/ledger.md.
"""

from __future__ import annotations

from collections import OrderedDict

CAP = 1024


class ServerPlaced:
    def __init__(self, cap: int = CAP) -> None:
        self.cap = cap
        self.sent = 0        # requests sent so far; each one's number is its place in that order
        self.answers = 0     # answers without a learned slot so far; each one's order among them
        self._open: OrderedDict[int, None] = OrderedDict()       # sent, not answered
        self._unlearned: OrderedDict[int, int] = OrderedDict()   # request number -> its answer's order
        self._forgot = 0     # the answer order of the newest unlearned answer forgotten (bounded memory)

    def send(self) -> int:
        """A request goes out for the server to place: its number."""
        n = self.sent
        self.sent += 1
        self._open[n] = None
        if len(self._open) > self.cap:
            self._open.popitem(last=False)  # never answered (its flow was dropped): it ran nowhere we can tell
        return n

    def answered(self, n: int, *, learned: bool) -> None:
        """Request `n` was answered; `learned`: its answer said which slot ran it."""
        self._open.pop(n, None)
        if learned:
            return
        self.answers += 1
        self._unlearned[n] = self.answers
        if len(self._unlearned) > self.cap:
            _, self._forgot = self._unlearned.popitem(last=False)

    def learned(self, n: int) -> None:
        """Where request `n` ran was learned after its answer (`/slots` read after it): no longer a suspect."""
        self._unlearned.pop(n, None)

    @property
    def remembered(self) -> int:
        """Requests held in memory (at most twice `cap`)."""
        return len(self._open) + len(self._unlearned)

    def blamed(self, since: int, before: int) -> bool:
        """Whether a request numbered below `before` was answered without its slot after answer order `since`."""
        if since < self._forgot:
            return True
        return any(n < before and order > since for n, order in self._unlearned.items())
