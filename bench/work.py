"""Prefill work, not just prefill tokens: a token deep in a context costs more than one at its start.

Why: attention reads every token before it, so prefilling the 20,000th token of a conversation costs many
times what the 200th does. Stock llama-server re-prefills a displaced conversation from position 0 (cheap
tokens first); a proxy that keeps the conversation cached prefills only its new tail, deep in the context.
Counting tokens alone therefore overstates what the saved tokens are worth in seconds, and a wall-time
ratio can never reach the token ratio. The bench reports both: tokens (Σ prompt_n, as the server counts
them) and work in *token-equivalents at depth 0*, where prefilling positions `[a, b)` costs

    (b - a) + (b² - a²) / (2·D)

with `D` the depth at which one token costs twice a token at the start (a per-token cost `c0 + c1·p`,
`D = c0 / c1`; the same model as `slotlogic.costs.PrefillFit`). `D` is measured by `measure_depth` (one
slot, 15 chunks of 2,048 tokens at increasing depth, to 30K: `python -m bench.work`); the default is this
machine's measurement of the long-context SmolLM2 copy on 2 CPU threads (docs/performance.md has the curve).
The line is not exact: the first chunks are faster than it, so a fit over 0-16K alone gives D ≈ 3,150.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from typing import Any

DEPTH_TOKENS = 1_830  # measured (python -m bench.work): 2 threads, long-context SmolLM2-135M Q4_1, 32K slot


def span(start: int, end: int, depth: float = DEPTH_TOKENS) -> float:
    """Work of prefilling positions [start, end) in token-equivalents at depth 0."""
    if end <= start:
        return 0.0
    return (end - start) + (end * end - start * start) / (2 * depth)


def served_work(spans: Iterable[tuple[int, int]], depth: float = DEPTH_TOKENS) -> float:
    """Work of requests given as (cache_n, prompt_n): each prefilled its tokens after its cached ones."""
    return sum(span(cached, cached + n, depth) for cached, n in spans)


def limit_work(token_lists: Sequence[Sequence[int]], new: Sequence[int], depth: float = DEPTH_TOKENS) -> float:
    """Work of the physical limit: each request prefills only its `new` tokens (bench.limit.new_tokens), at the
    end of its own prompt."""
    return sum(span(len(t) - n, len(t), depth) for t, n in zip(token_lists, new, strict=True))


def measure_depth(threads: int = 2, chunk: int = 2048, chunks: int = 15) -> dict[str, Any]:
    """Prefill `chunks` chunks of `chunk` tokens one after another into one slot of the long-context model
    and fit `ms per token = c0 + c1·depth` by plain least squares: `D = c0 / c1`. Not the proxy's
    `slotlogic.costs.PrefillFit`: that one forgets older answers on purpose (a server's speed drifts), which
    here would weigh the deep chunks over the shallow ones."""
    import httpx

    from bench.real.llama_server import LlamaServer
    from bench.real.long_context import filler_prompt, long_context_model

    points: list[tuple[float, float]] = []
    with LlamaServer(slots=1, ctx_per_slot=chunk * (chunks + 1), threads=threads,
                     model=str(long_context_model())) as srv:
        tokens = httpx.post(srv.url + "/tokenize", json={"content": filler_prompt(chunk * (chunks + 1))},
                            timeout=60).json()["tokens"]
        for k in range(1, chunks + 1):
            r = httpx.post(srv.url + "/completion", timeout=900,
                           json={"prompt": tokens[:k * chunk], "n_predict": 1, "cache_prompt": True, "id_slot": 0})
            t = r.json()["timings"]
            points.append((t.get("cache_n", (k - 1) * chunk) + t["prompt_n"] / 2, t["prompt_ms"] / t["prompt_n"]))
    n = len(points)
    mx, my = sum(p for p, _ in points) / n, sum(m for _, m in points) / n
    c1 = sum((p - mx) * (m - my) for p, m in points) / sum((p - mx) ** 2 for p, _ in points)
    c0 = my - c1 * mx
    return {"threads": threads, "chunk": chunk, "ms_per_token_at_0": round(c0, 3), "ms_per_token_per_depth": c1,
            "depth_tokens": round(c0 / c1) if c1 > 0 else None,
            "points": [(round(p), round(m, 3)) for p, m in points]}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.work", description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=15)
    a = ap.parse_args(argv)
    print(json.dumps(measure_depth(a.threads, chunks=a.chunks)))


if __name__ == "__main__":
    main()
