"""Many generated workloads through the simulator (`make bench ARGS=--sim`): per seed the prefill against the
physical limit (bench/limit.py's definition, on the simulator's tokens) and the lost tokens by cause; a seed
with unlabelled lost tokens prints its reproduction (seed, shape, the loss step by step)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from bench.limit import new_tokens
from bench.sim.clock import VirtualClock, run
from bench.sim.harness import Rig
from bench.sim.losses import Loss, find_losses
from bench.sim.traffic import Shape, play, shape_for

SEED_BUDGET = 60.0   # real seconds one seed may take (they take under 3): past it the seed fails, the sweep goes on


@dataclass
class SeedResult:
    seed: int
    shape: str
    requests: int
    prefill: int
    limit: int
    losses: list[Loss] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None
    cpu: float = 0.0          # CPU seconds of its process (a loaded machine stretches `seconds`, not this)
    miscalled: int = 0        # tokens the proxy's meter called unexpected where the ground truth has none unlabelled

    @property
    def ratio(self) -> float:
        return self.prefill / self.limit if self.limit else 1.0

    @property
    def lost(self) -> int:
        """Unlabelled lost tokens: neither expected (restart, idle clearing) nor given away by the proxy."""
        return sum(x.tokens for x in self.losses if not x.labelled)

    @property
    def lost_labelled(self) -> int:
        return sum(x.tokens for x in self.losses if x.labelled)


def run_shape(shape: Shape) -> tuple[SeedResult, Rig]:
    """Play `shape` on a fresh rig; the rig stays readable afterwards (its servers' events and files)."""
    started, cpu = time.perf_counter(), time.process_time()
    holder: dict[str, Rig] = {}

    async def main() -> None:
        async with Rig(shape.setup) as rig:
            holder["rig"] = rig
            await play(rig, shape)

    error = None
    try:
        run(VirtualClock(budget=SEED_BUDGET), main)
    except Exception as e:  # a crash of the harness or the product is a finding too
        error = f"{type(e).__name__}: {e}"
    rig = holder["rig"]
    done = sorted((o.done for o in rig.outcomes if o.done is not None), key=lambda d: d.started)
    limit = sum(new_tokens([d.tokens for d in done])) if done else 0
    losses = find_losses(rig)
    result = SeedResult(shape.seed, shape.describe(), len(rig.outcomes), rig.prefill_tokens, limit,
                        losses, time.perf_counter() - started, error, time.process_time() - cpu,
                        miscalled(rig, losses))
    return result, rig


def miscalled(rig: Rig, losses: list[Loss]) -> int:
    """Tokens the proxy's own meter called unexpected (`Report.loss`) for a session whose losses the ground truth
    all labels (a restart, idle clearing, an eviction it chose): the meter crying wolf, which a user reads as a
    fault of the proxy."""
    # idle clearing of a slot the proxy pinned is the server's doing in the ground truth, yet the proxy's own miss
    # (it pinned before it knew the server's cache mode): the meter rightly calls it unexpected
    real = {x.tag for x in losses if not x.labelled or x.cause == "idle-clear"}
    out = 0
    for o in rig.outcomes:
        loss = getattr(o.report, "loss", None) if o.report is not None else None
        if loss is not None and not loss.expected and o.tag not in real:
            out += loss.tokens
    return out


def run_seed(seed: int, *, load: bool = True, stalls: bool = True) -> SeedResult:
    return run_shape(shape_for(seed, load=load, stalls=stalls))[0]


def _quiet() -> None:
    """The sweep reads the ground truth, not log lines: slotkeeper's lines (and mitmproxy's handling of each)
    are skipped in its workers."""
    logging.getLogger("slotkeeper").setLevel(logging.ERROR)


def sweep(seeds: range, processes: int | None = None, progress: bool = False) -> list[SeedResult]:
    procs = processes or min(2, os.cpu_count() or 1)
    if procs <= 1:
        logger = logging.getLogger("slotkeeper")
        level = logger.level
        _quiet()
        try:
            return [run_seed(s) for s in seeds]
        finally:
            logger.setLevel(level)  # in-process (a test): the caller's logging is left as it was
    out: list[SeedResult] = []
    # ProcessPoolExecutor, not multiprocessing.Pool: a worker that dies breaks the pool with an error, where
    # Pool's imap waits for its lost chunk for ever.
    with ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("fork"), initializer=_quiet) as pool:
        for r in pool.map(run_seed, seeds, chunksize=8):
            out.append(r)
            if progress and len(out) % 100 == 0:
                print(f"  {len(out)}/{len(seeds)} workloads", flush=True)
    return sorted(out, key=lambda r: r.seed)


def reproduction(r: SeedResult) -> str:
    lines = [f"  {r.shape}", f"  reproduce: python -m bench --sim --sim-seed {r.seed}"]
    for x in r.losses:
        if not x.labelled:
            lines.append(f"  - {x.line()}")
            lines += [f"      {s}" for s in x.steps]
    if r.error:
        lines.append(f"  error: {r.error}")
    return "\n".join(lines)


def summary(results: list[SeedResult], seconds: float) -> str:
    worst = max(results, key=lambda r: r.ratio)
    causes: dict[str, int] = {}
    for r in results:
        for x in r.losses:
            causes[x.cause] = causes.get(x.cause, 0) + x.tokens
    lost = sum(r.lost for r in results)
    failing = [r for r in results if r.lost or r.error]
    out = [f"simulated workloads: {len(results)}  requests: {sum(r.requests for r in results)}  "
           f"seconds: {seconds:.1f}  CPU seconds in the workers: {sum(r.cpu for r in results):.1f} "
           f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)",
           f"worst x limit: {worst.ratio:.2f} (seed {worst.seed})  "
           f"median x limit: {sorted(r.ratio for r in results)[len(results) // 2]:.2f}",
           f"lost tokens (unlabelled): {lost}  labelled (restart, idle clearing, given away, server-placed): "
           f"{sum(r.lost_labelled for r in results)}",
           "lost tokens by cause: " + (", ".join(f"{k}={v}" for k, v in sorted(causes.items())) or "none"),
           f"the proxy's meter: unexpected where the ground truth labels the loss: "
           f"{sum(r.miscalled for r in results)} tokens in {sum(1 for r in results if r.miscalled)} seeds",
           f"failing seeds: {len(failing)}" + (f" (first: {[r.seed for r in failing[:10]]})" if failing else "")]
    for r in failing[:3]:
        out.append(f"seed {r.seed}: lost {r.lost}" + (f", error {r.error}" if r.error else ""))
        out.append(reproduction(r))
    return "\n".join(out)


def main(seeds: int, one: int | None = None, processes: int | None = None) -> int:
    """`python -m bench --sim [--sim-seeds N]` or `--sim-seed S`: 1 when any seed lost unlabelled tokens."""
    started = time.perf_counter()
    if one is not None:
        result = run_seed(one)
        print(f"seed {one}: prefill {result.prefill}, limit {result.limit}, x limit {result.ratio:.2f}, "
              f"lost {result.lost} (labelled {result.lost_labelled}), {result.seconds:.2f} s")
        for x in result.losses:
            print(f"  - {x.line()}" + (" (labelled)" if x.labelled else ""))
            print("\n".join(f"      {s}" for s in x.steps))
        print(reproduction(result) if result.error else f"  {result.shape}")
        return 1 if result.lost or result.error else 0
    results = sweep(range(seeds), processes, progress=True)
    print(summary(results, time.perf_counter() - started))
    return 1 if any(r.lost or r.error for r in results) else 0
