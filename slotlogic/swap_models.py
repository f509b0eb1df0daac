"""Which models behind a llama-swap get a server of their own, and which of those to forget.

Why: the model is named by the request body, any client's choice, and one upstream per name would let a client
grow the proxy without bound. So only a model llama-swap lists (or runs) gets an upstream, the list is asked
again at most every `REFRESH_SECONDS`, at most `max_models` are kept and an idle one is forgotten (its state
stays, so its sessions resume). Any other request passes through unpinned. Pure: the pool driver asks
llama-swap. docs/scale-out.md ("llama-swap").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

REFRESH_SECONDS = 30.0   # the shortest interval between two look-ups of llama-swap's model list
IDLE_SECONDS = 600.0     # a model upstream without a request for this long is forgotten
MAX_MODELS = 16          # model upstreams kept per llama-swap (`slots_swap_max_models`)
MAX_NAME = 256           # a longer model name is nobody's configuration


def listed(models: Any, running: Any) -> frozenset[str] | None:
    """The model names llama-swap serves, from its `/v1/models` and `/running` answers; None when neither
    answered as llama-swap does (keep what was known)."""
    names: set[str] = set()
    answered = False
    data = models.get("data") if isinstance(models, Mapping) else None
    if isinstance(data, list):
        answered = True
        names.update(e["id"] for e in data if isinstance(e, Mapping) and isinstance(e.get("id"), str))
    run = running.get("running") if isinstance(running, Mapping) else None
    if isinstance(run, list):
        answered = True
        names.update(e["model"] for e in run if isinstance(e, Mapping) and isinstance(e.get("model"), str))
    return frozenset(n for n in names if n and len(n) <= MAX_NAME) if answered else None


def accepts(known: frozenset[str], model: str) -> bool:
    return bool(model) and model in known


def due(known: frozenset[str], model: str, last_asked: float | None, now: float) -> bool:
    """Whether to ask llama-swap's list again for `model` (unknown, and not asked lately)."""
    return not accepts(known, model) and (last_asked is None or now - last_asked >= REFRESH_SECONDS)


def to_forget(used: Mapping[str, float], inflight: Mapping[str, int], now: float, *, cap: int,
              idle_seconds: float = IDLE_SECONDS, room_for: int = 0) -> list[str]:
    """The model upstreams (URL -> when last used) to forget now: every idle one, then the least recently used
    until `room_for` more fit under `cap`. One with a request in flight is never forgotten."""
    free = sorted((t, url) for url, t in used.items() if not inflight.get(url))
    out = [url for t, url in free if now - t >= idle_seconds]
    keep = len(used) - len(out)
    for _, url in free:
        if keep + room_for <= cap:
            break
        if url not in out:
            out.append(url)
            keep -= 1
    return out
