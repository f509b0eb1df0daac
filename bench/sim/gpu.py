"""Page or recompute at GPU speeds: the simulator with the rates of a large model on a current GPU, and each
page-or-recompute choice the proxy made held against the better choice in hindsight.

The proxy weighs every slot move (a page-in, a page-out, a live seed, a prefix restore) by the speeds it
measured: the move's bytes at the measured disk speed against prefilling the tokens it spares at the measured
prefill speed (`slotlogic.costs`). On SmolLM2 on a CPU a move is far cheaper than the prefill; on an 8B model
on a GPU the two are close (a 1,000-token page is ~130 MB, ~40 ms at 3 GB/s, against ~70 ms of prefill at 15K
tokens/s), so a wrong estimate picks the slower one. Here the server's true costs are known (`Disk`, the
prefill speed), so each choice is judged afterwards:

- a restore the server ran cost its bytes at the disk's speed; prefilling what it restored would have cost
  those tokens at the prefill speed. When the restore was the slower, the difference is time lost;
- a move the proxy weighed and declined (`CostWeighed` with `worth` false) would have cost its true bytes;
  when that is less than the true prefill it spares, the difference is time lost;
- a save is weighed with the restore it prepares (both count as the move's cost), whether or not the
  conversation comes back.

Time the moves saved is what the restores spared minus every save's and restore's I/O. `python -m bench.sim.gpu`
prints both per machine, over seeds of varied shapes (sessions, slots, think times, context sizes).
"""

from __future__ import annotations

import argparse
import logging
import random
from dataclasses import astuple, dataclass

from bench.sim.harness import Rig, Setup
from bench.sim.llama import Disk, SimServer
from bench.sim.sweep import run_shape
from bench.sim.traffic import SessionShape, Shape
from slotlogic.costs import Move


@dataclass(frozen=True)
class Machine:
    """A model on a GPU: its prefill and decode speeds (tokens a second, drawn per seed within these), KV bytes a
    token and the disk's bytes a second."""

    name: str
    prefill: tuple[float, float]
    decode: tuple[float, float]
    kv_bytes_per_token: int
    disk_bps: tuple[float, float]
    depth: tuple[float, float]   # the context depth at which a prefilled token costs twice


# An 8B model (128 KiB of KV a token at 16 bits) and a 70B-class one (320 KiB) on one current data-centre GPU,
# a local NVMe disk. The 70B prefill range is an assumption of this bench (a few thousand tokens a second).
MACHINES = {
    "8b": Machine("8b", (10_000.0, 20_000.0), (60.0, 120.0), 128 * 1024, (2e9, 5e9), (16_000.0, 64_000.0)),
    "70b": Machine("70b", (2_000.0, 5_000.0), (20.0, 40.0), 320 * 1024, (2e9, 5e9), (16_000.0, 64_000.0)),
}


def gpu_shape(seed: int, machine: Machine, budget_mb: int | None = None) -> Shape:
    """More sessions than slots with paging on, at `machine`'s speeds: 2-4 slots, one to three sessions more,
    3-7 turns, think times from a fraction of a second to half a minute, some subagents and side calls, shared
    system prompts of 1,000-12,000 words. `budget_mb`: the page budget (None: the shipped default)."""
    r = random.Random(seed * 31 + len(machine.name))
    slots = r.randint(2, 4)
    sessions = tuple(SessionShape(turns=(turns := r.randint(3, 7)), marker=r.random() < 0.5,
                                  stream=r.random() < 0.6, start=r.uniform(0, 2),
                                  think=tuple(r.choice((0.2, 1.0, 3.0, 10.0, 30.0)) for _ in range(turns)),
                                  subagent_at=r.randrange(turns) if r.random() < 0.3 else None,
                                  side_calls=tuple(t for t in range(turns) if r.random() < 0.1))
                     for _ in range(slots + r.randint(1, 3)))
    disk = Disk(machine.kv_bytes_per_token, r.uniform(*machine.disk_bps))
    setup = Setup(slots=slots, paging=True, prefill_speed=r.uniform(*machine.prefill), n_ctx=65536,
                  disk=disk, decode_speed=r.uniform(*machine.decode), ttl=r.choice((60, 120)),
                  prefill_depth=r.uniform(*machine.depth),
                  options=(("slots_page_max_mb", budget_mb),) if budget_mb else ())
    return Shape(seed, setup, sessions, system_words=r.randint(1000, 12000), output_words=(100, 600))


@dataclass(frozen=True)
class Hindsight:
    """One run's page-or-recompute choices against the better choice, in seconds of server time."""

    restores: int = 0
    saves: int = 0
    declined: int = 0
    wrong: int = 0
    lost_s: float = 0.0     # what the wrong choices cost beyond the better one
    saved_s: float = 0.0    # what the moves spared, their own I/O taken off
    unread: int = 0         # saves whose session did not come back before the run ended (not judged)

    def __add__(self, o: Hindsight) -> Hindsight:
        return Hindsight(*(a + b for a, b in zip(astuple(self), astuple(o), strict=True)))


def judge(rig: Rig) -> Hindsight:
    """Every restore and save the servers ran and every move the proxies declined, held against the truth."""
    out = Hindsight()
    for server in rig.servers.values():
        out += _moves_made(rig, server)
    for _, w in rig.weighed:
        c, server = w.choice, rig.servers[w.upstream]
        if c.worth:
            continue  # made: its restore (and save) are judged as the server ran them
        trips = 2 if c.move in (Move.PAGE_OUT, Move.LIVE_SEED) else 1
        cost, spared = trips * _io(server, c.tokens), server.prefill_seconds(c.spares or c.tokens)
        out += Hindsight(declined=1, wrong=int(cost < spared), lost_s=max(0.0, spared - cost))
    return out


def _io(server: SimServer, tokens: int) -> float:
    disk = server.disk
    assert disk is not None, "a GPU rig models its disk"
    return disk.overhead_s + disk.seconds(disk.size(tokens))


def _moves_made(rig: Rig, server: SimServer) -> Hindsight:
    """A restore was wrong when prefilling what it restored would have been quicker; a save, when its session
    came back and its page was never read (had its session not come back by the run's end, it is not judged)."""
    out = Hindsight()
    restored = [e for e in server.events if e.kind == "restore"]
    for e in restored:
        cost, spared = _io(server, e.after), server.prefill_seconds(e.after)
        out += Hindsight(restores=1, wrong=int(cost > spared), lost_s=max(0.0, cost - spared), saved_s=spared - cost)
    for e in server.events:
        if e.kind != "save":
            continue
        cost = _io(server, e.after)
        f = server.files.get(e.tag or "")
        read = any(r.tag == e.tag and r.t >= e.t for r in restored)
        back = f is not None and any(o.tag == f.writer and o.started > e.t for o in rig.outcomes)
        wasted, judged = not read and back, read or back
        out += Hindsight(saves=1, wrong=int(wasted), lost_s=cost if wasted else 0.0,
                         saved_s=-cost if judged else 0.0, unread=int(not judged))
    return out


def run(seeds: range, machine: Machine, budget_mb: int | None = None) -> tuple[Hindsight, int]:
    """The hindsight totals over `seeds` and the number of seeds whose run lost tokens no cause explains."""
    total, failing = Hindsight(), 0
    for seed in seeds:
        result, rig = run_shape(gpu_shape(seed, machine, budget_mb))
        total += judge(rig)
        failing += bool(result.lost or result.error)
    return total, failing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sim.gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--machines", default=",".join(MACHINES))
    ap.add_argument("--budgets-mb", default="0,8192", help="page budgets to run (0: sized from the model, the default)")
    a = ap.parse_args(argv)
    logging.getLogger("slotkeeper").setLevel(logging.ERROR)
    print("| machine | page budget | seeds | restores | saves | declined | wrong choices | time lost s | "
          "time moves saved s | lost / saved | saves not judged | failing seeds |\n" + "|---" * 12 + "|")
    for name in a.machines.split(","):
        for mb in (int(b) for b in a.budgets_mb.split(",")):
            h, failing = run(range(a.seeds), MACHINES[name], mb or None)
            share = h.lost_s / h.saved_s if h.saved_s > 0 else float("inf")
            budget = f"{mb // 1024} GB" if mb else "sized (default)"
            print(f"| {name} | {budget} | {a.seeds} | {h.restores} | {h.saves} | {h.declined} | {h.wrong} | "
                  f"{h.lost_s:.2f} | {h.saved_s:.2f} | {share:.1%} | {h.unread} | {failing} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

