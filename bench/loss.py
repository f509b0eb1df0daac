"""Lost tokens, two ways: the proxy's own meter and the bench's ground truth.

*Lost* means a session had a prefix computed on the server, came back with a prompt that extends it, and
the server reused less of it than it had: the difference is prefilled again. The proxy counts what it
notices (`slotkeeper_tokens_lost_total{cause=...}` in `/_slots/metrics`); the bench counts independently,
from the server's own `cache_n`/`prompt_n` per request, so a loss the proxy does not see still shows.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

METRIC = "slotkeeper_tokens_lost"
# The previous request's prompt ends with the generation prompt (`<|im_start|>assistant\n`, a few tokens),
# which the next prompt need not repeat token for token, and a full hit reuses N-1 of N tokens.
TOLERANCE = 16


@dataclass(frozen=True)
class Sent:
    """One answered request of a session: its content (message list or token list), as the server counted it."""

    session: str
    content: Sequence[Any]
    cache_n: int
    prompt_n: int


def bench_lost(requests: Iterable[Sent], tolerance: int = TOLERANCE) -> dict[str, Any]:
    """Per session, in the given (start) order: a request whose content extends the session's previous one
    but whose `cache_n` falls short of the previous prompt's length by more than `tolerance` lost the
    shortfall. Returns the tokens and the requests that lost any."""
    last: dict[str, Sent] = {}
    tokens = hits = 0
    for r in requests:
        prev = last.get(r.session)
        last[r.session] = r
        if prev is None or list(r.content[:len(prev.content)]) != list(prev.content):
            continue
        shortfall = prev.cache_n + prev.prompt_n - r.cache_n
        if shortfall > tolerance:
            tokens += shortfall
            hits += 1
    return {"tokens": tokens, "requests": hits}


def sent_of(records: Iterable[Any], specs: dict[tuple[str, int], Any]) -> list[Sent]:
    """`Sent` entries for the bench client's records (start order) of a generated workload (`by_key()`)."""
    return [Sent(r.session, specs[(r.session, r.index)].messages, r.cache_n, r.prompt_n) for r in records
            if r.error is None and r.cache_n is not None and r.prompt_n is not None]


def parse_metrics(text: str) -> dict[str, Any] | None:
    """The loss counter from a `/_slots/metrics` text: total, the unlabelled part (`cause="unknown"` or no
    cause), and tokens by cause; None when the proxy has no such metric (its meter predates this column)."""
    from prometheus_client.parser import text_string_to_metric_families

    found = False
    by_cause: dict[str, int] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name not in (METRIC, METRIC + "_total"):
            continue
        found = True
        for s in fam.samples:
            if s.name in (METRIC, METRIC + "_total"):
                cause = s.labels.get("cause") or "unknown"
                by_cause[cause] = by_cause.get(cause, 0) + int(s.value)
    if not found:
        return None
    return {"total": sum(by_cause.values()), "unknown": by_cause.get("unknown", 0), "by_cause": by_cause}


def proxy_lost(proxy_urls: Sequence[str]) -> dict[str, Any] | None:
    """The proxies' loss counters summed (several proxies on one store: each counts its own answers);
    None when any proxy has no meter or does not answer."""
    total: dict[str, Any] = {"total": 0, "unknown": 0, "by_cause": {}}
    for url in proxy_urls:
        try:
            r = httpx.get(url.rstrip("/") + "/_slots/metrics", timeout=10.0)
            r.raise_for_status()
        except httpx.HTTPError:
            return None
        one = parse_metrics(r.text)
        if one is None:
            return None
        total["total"] += one["total"]
        total["unknown"] += one["unknown"]
        for cause, n in one["by_cause"].items():
            total["by_cause"][cause] = total["by_cause"].get(cause, 0) + n
    return total


def row_fields(proxy: dict[str, Any] | None, bench: dict[str, Any] | None) -> dict[str, Any]:
    """The table's loss columns: the proxy's count (None: no meter), its unlabelled part, the bench's count."""
    return {"lost": proxy["total"] if proxy else None, "lost_unknown": proxy["unknown"] if proxy else None,
            "lost_causes": proxy["by_cause"] if proxy else None,
            "lost_bench": bench["tokens"] if bench else None,
            "lost_bench_requests": bench["requests"] if bench else None}
