"""The seeded subagent workloads (bench/subagent_workload.py) and the lost-token columns (bench/loss.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from bench import client, loss, report
from bench.subagent_workload import generate, shape
from bench.workload import WORKLOADS, SessionScript, Workload

SEEDS = range(24)


def dump(w: Workload) -> str:
    return json.dumps([[r.session, r.index, r.think_s, w.body(r)] for r in w.requests()], sort_keys=True)


def test_deterministic_per_seed_and_different_across_seeds() -> None:
    assert dump(generate("subagents", seed=5, max_tokens=4)) == dump(generate("subagents", seed=5, max_tokens=4))
    assert len({dump(generate("subagents", seed=s, max_tokens=4)) for s in range(6)}) == 6
    # the 2x2 variant sends the same traffic, only the servers differ
    assert dump(generate("subagents-2x2", seed=5, max_tokens=4)).replace("subagents-2x2", "subagents") == \
        dump(generate("subagents", seed=5, max_tokens=4))
    assert WORKLOADS["subagents-2x2"].servers == 2 and WORKLOADS["subagents-2x2"].slots == 2


def test_shapes_vary_across_seeds() -> None:
    shapes = [shape("subagents", s) for s in SEEDS]
    assert len(set(shapes)) == len(shapes)
    assert {s.mains for s in shapes} == {3, 4}
    assert {s.env_position for s in shapes} == {"end", "before-tail"}
    assert {s.sub_system for s in shapes} == {"same", "own"}
    assert any(b > 1 for s in shapes for b in s.bursts)  # some sessions start together
    works = [generate("subagents", seed=s, max_tokens=4) for s in SEEDS]
    assert len({len(w.requests()) for w in works}) > 5
    widths = {len(children) for w in works for m in w.sessions for children in m.forks.values()}
    assert {1, 2} <= widths  # single and parallel subagents


def _children(m: SessionScript) -> list[SessionScript]:
    return [c for cs in m.forks.values() for c in cs]


@pytest.mark.parametrize("seed", SEEDS)
def test_parent_resumes_with_every_report_and_children_start_together(seed: int) -> None:
    w = generate("subagents", seed=seed, max_tokens=4)
    keys = [(r.session, r.index) for r in w.requests()]
    assert len(keys) == len(set(keys)) == len(w.by_key())
    for m in w.sessions:
        assert m.forks and all(0 < at < len(m.requests) for at in m.forks)
        for at, children in m.forks.items():
            resumed = m.requests[at].messages
            assert resumed[: len(m.requests[at - 1].messages)] == m.requests[at - 1].messages  # it only grows
            tools = [x for x in resumed if x["role"] == "tool"][-len(children):]
            assert [t["content"].split(":")[0] for t in tools] == [f"Report of {c.id}" for c in children]
            assert len({c.requests[0].think_s for c in children}) == 1  # parallel subagents start together


@pytest.mark.parametrize("seed", SEEDS)
def test_system_prompt_has_no_marker_and_a_per_session_environment(seed: int) -> None:
    w = generate("subagents", seed=seed, max_tokens=4)
    sh = shape("subagents", seed)
    systems = [m.requests[0].messages[0]["content"] for m in w.sessions]
    assert len(set(systems)) == len(systems)
    shared = {s[: s.index("# Environment")] for s in systems}
    assert len(shared) == 1 and len(shared.pop()) > 1000  # the shared part first, the environment after it
    assert len({s[s.index("# Environment"):] for s in systems}) == len(systems)
    tails = {s.split("# Reminders")[-1] for s in systems}
    assert (len(tails) == 1) == (sh.env_position == "before-tail")
    assert not any(k in systems[0] for k in ("<cwd>", "pi, a coding agent", "<env>"))
    for m, system in zip(w.sessions, systems, strict=True):
        env = system[system.index("# Environment"):].split("# Reminders")[0]
        for c in _children(m):
            sub = c.requests[0].messages[0]["content"]
            assert env in sub  # a subagent runs in its parent's working directory
            assert (sub == system) == (sh.sub_system == "same")


def test_parents_wait_for_all_their_subagents() -> None:
    """Run a generated workload through the bench client with a stub `send`: every parent request that a
    fork blocks starts after all of that fork's requests ended, and the fork's subagents overlap."""
    w = generate("subagents", seed=1, max_tokens=4)

    def fast(s: SessionScript) -> SessionScript:
        reqs = [dataclasses.replace(r, think_s=r.think_s / 1000) for r in s.requests]
        return SessionScript(s.id, reqs, {k: [fast(c) for c in cs] for k, cs in s.forks.items()})

    w.sessions = [fast(s) for s in w.sessions]
    events: list[tuple[str, str, int]] = []

    async def fake_send(_c: object, _url: str, _body: object, rec: client.RequestRecord) -> None:
        events.append(("start", rec.session, rec.index))
        await asyncio.sleep(0.003)
        rec.prompt_n, rec.cache_n = 1, 0
        events.append(("end", rec.session, rec.index))

    orig = client.send
    client.send = fake_send  # type: ignore[assignment]
    try:
        records, _ = asyncio.run(client.run_workload("http://127.0.0.1:9", w, "t"))
    finally:
        client.send = orig  # type: ignore[assignment]
    assert len(records) == len(w.requests())
    pos = {e: i for i, e in enumerate(events)}
    parallel_seen = False
    for m in w.sessions:
        for at, children in m.forks.items():
            resumed = pos[("start", m.id, at)]
            assert pos[("end", m.id, at - 1)] < min(pos[("start", c.id, 0)] for c in children)
            assert all(pos[("end", c.id, len(c.requests) - 1)] < resumed for c in children)
            if len(children) > 1:
                parallel_seen = True
                assert max(pos[("start", c.id, 0)] for c in children) < min(
                    pos[("end", c.id, len(c.requests) - 1)] for c in children)
    assert parallel_seen


# ------------------------------------------------------------------------------------------------ loss

def test_bench_lost_counts_a_shortfall_on_a_growing_prompt() -> None:
    sent = [loss.Sent("a", [1, 2], 0, 800), loss.Sent("b", [9], 0, 800),
            loss.Sent("a", [1, 2, 3], 790, 100),   # full reuse minus the generation prompt: no loss
            loss.Sent("a", [1, 2, 3, 4], 763, 255),  # the slot held 890 tokens of a, only 763 came back
            loss.Sent("b", [8], 0, 900),            # not an extension of b's previous prompt: not a loss
            loss.Sent("b", [8, 1], 500, 500)]
    assert loss.bench_lost(sent) == {"tokens": (790 + 100 - 763) + (900 - 500), "requests": 2}
    assert loss.bench_lost(sent, tolerance=500) == {"tokens": 0, "requests": 0}


METRICS = """# HELP slotkeeper_tokens_lost_total Tokens lost.
# TYPE slotkeeper_tokens_lost_total counter
slotkeeper_tokens_lost_total{cause="prefix-restore"} 93.0
slotkeeper_tokens_lost_total{cause="unknown"} 7.0
slotkeeper_tokens_lost_total 5.0
# HELP slotkeeper_requests_total Requests.
# TYPE slotkeeper_requests_total counter
slotkeeper_requests_total{server="x",slot="0"} 3.0
"""


def test_proxy_meter_sum_and_unlabelled_part() -> None:
    got = loss.parse_metrics(METRICS)
    assert got == {"total": 105, "unknown": 12, "by_cause": {"prefix-restore": 93, "unknown": 12}}
    assert loss.parse_metrics(METRICS.split("# HELP slotkeeper_requests")[0].replace("tokens_lost", "x")) is None


def test_loss_columns_beside_x_limit_and_a_dash_without_a_meter() -> None:
    keys = [k for k, _ in report.COLUMNS]
    at = keys.index("ratio_to_limit")
    assert keys[at + 1: at + 4] == ["lost", "lost_unknown", "lost_bench"]
    assert "lost" in [k for k, _ in report.CLIENT_COLUMNS]
    row = {"workload": "w", "config": "auto", **loss.row_fields(None, {"tokens": 40, "requests": 1})}
    table = report.text_table([row], report.COLUMNS)
    assert "\u2013" in table.splitlines()[2] and " 40 " in table.splitlines()[2] + " "
    row.update(loss.row_fields(loss.parse_metrics(METRICS), None))
    assert "105" in report.text_table([row], report.COLUMNS)


def test_loss_trace_labels_both_kinds_of_loss(tmp_path) -> None:
    """A bench result and a proxy log shaped as the seed-0 run's: a known session finds another placement's
    seed in its slot, then is paged in from the page that placement wrote before its last turn."""
    from bench import loss_trace

    def rec(session: str, index: int, start: float, total: float, cache_n: int, prompt_n: int) -> dict:
        return {"session": session, "index": index, "start_s": start, "total_s": total, "cache_n": cache_n,
                "prompt_n": prompt_n, "error": None}

    bench = [rec("a", 0, 0.0, 2.0, 868, 47), rec("a", 1, 3.0, 9.0, 774, 243), rec("a", 2, 14.0, 6.0, 915, 184)]
    t = 1000.0
    log = [{"t": t + 2.0, "kind": "request", "session": "05b99648ff", "slot": 1, "reason": "evict-waiting-parent",
            "cache_n": 868, "prompt_n": 47, "seconds": 2.0},
           {"t": t + 2.9, "kind": "page", "slot": 1, "out": "05b99648", "out_tokens": 918, "in": "1dd91cf8",
            "in_tokens": 883, "seed": True},
           {"t": t + 12.0, "kind": "request", "session": "05b99648ff", "slot": 1, "reason": "known",
            "cache_n": 774, "prompt_n": 243, "seconds": 9.0},
           {"t": t + 15.0, "kind": "page", "slot": 0, "out": "15be50ff", "out_tokens": 894, "in": "05b99648",
            "in_tokens": 918, "seed": False},
           {"t": t + 20.0, "kind": "request", "session": "05b99648ff", "slot": 0,
            "reason": "displaced:evict-cheapest+paged-in", "cache_n": 915, "prompt_n": 184, "seconds": 6.0}]
    (tmp_path / "subagents-auto+ckpt.requests.jsonl").write_text("\n".join(json.dumps(x) for x in log))
    doc = {"meta": {"log_dir": str(tmp_path)},
           "runs": [{"workload": "subagents", "config": "auto+ckpt", "records": bench}]}
    got = [(x.session, x.index, x.tokens, x.kind) for x in loss_trace.trace(doc)]
    assert got == [("a", 1, 141, "slot-written-under-owner"), ("a", 2, 102, "stale-page")]
    assert loss_trace.classify("evict-cheapest", 0, 934, [], "2187b52f") == "placed-as-new"
    assert loss_trace.classify("displaced:shared", 0, 934, [], "2187b52f") == "unexplained"
