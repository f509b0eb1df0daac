"""The cost model (slotlogic/costs.py): measured speeds in, page-or-recompute decisions out."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import pytest

from slotkeeper.drivers import gguf_io
from slotlogic import costs, kv_types, paging
from slotlogic import shared as st
from slotlogic.costs import Choice, Direction, Move, PrefillFit, Rates, SlotFileAnswer, Speeds
from slotlogic.keeper import Keeper
from slotlogic.model_facts import ModelFacts
from slotlogic.paging import PageAsk, PagePlan, PageRecord
from slotlogic.ranking import SlotView
from slotlogic.server import ServerInfo
from slotlogic.settings import Settings
from tests.test_model_facts import common, write_gguf

UP = "http://up"
KIB = 1024
# An 8B model on a GPU: 20,000 prompt tokens a second at the start of a context, twice as slow a token at 32K
# (attention), slot files read and written at 2 GB/s, 2 ms a call beyond the server's own time.
GPU = Rates(prefill_tps=20_000, save_bps=2e9, restore_bps=2e9, kv_bytes_per_token=128 * KIB, prefill_depth=32_768,
            overhead_s=0.002)
CPU = Rates(prefill_tps=100, save_bps=1.5e9, restore_bps=2.5e9, kv_bytes_per_token=23_000, overhead_s=0.001)


def crossover(r: Rates, per_token_bytes: float) -> float:
    """Where `overhead + n·β = a·n + a·n²/(2D)` (the larger root: above it the restore wins)."""
    assert r.prefill_tps and r.restore_bps and r.prefill_depth
    a, beta = 1 / r.prefill_tps, per_token_bytes / r.restore_bps
    qa, qb, qc = a / (2 * r.prefill_depth), a - beta, -r.overhead_s
    return (-qb + (qb * qb - 4 * qa * qc) ** 0.5) / (2 * qa)


def test_save_and_restore_answers_are_read_as_llama_server_sends_them():
    save = SlotFileAnswer.parse("save", {"id_slot": 0, "filename": "f", "n_saved": 1342, "n_written": 31_000_000,
                                         "timings": {"save_ms": 12.5}}, wall_ms=14.0)
    assert save == SlotFileAnswer(Direction.SAVE, 1342, 31_000_000, 12.5, 14.0)
    restore = SlotFileAnswer.parse("restore", {"n_restored": 1342, "n_read": 31_000_000,
                                               "timings": {"restore_ms": 8}})
    assert restore == SlotFileAnswer(Direction.RESTORE, 1342, 31_000_000, 8.0)
    for action, data in (("save", {"n_saved": 10}), ("restore", {"n_restored": 5, "n_read": 9}),
                         ("erase", {"n_erased": 3}), ("save", {"n_saved": True, "n_written": 1, "timings": {}}),
                         ("save", None), ("save", {"n_saved": 0, "n_written": 0, "timings": {"save_ms": 1}})):
        assert SlotFileAnswer.parse(action, data) is None


def test_speeds_are_moving_averages_of_the_answers_and_tiny_files_do_not_count():
    s = Speeds()
    assert not s.rates(None).measured and s.rates(500.0).restore_bps is None
    assert s.note(SlotFileAnswer(Direction.RESTORE, 1000, 100_000_000, 50.0, 52.0))  # first restore: worth a line
    assert not s.note(SlotFileAnswer(Direction.RESTORE, 1000, 100_000_000, 25.0, 30.0))
    assert s.restore_bps == pytest.approx(2e9 + 0.3 * (4e9 - 2e9))
    assert s.rates(None).overhead_s == pytest.approx(0.002)  # the fixed part: the smallest of the recent ones
    assert not s.note(SlotFileAnswer(Direction.SAVE, 10, 1000, 1.0))      # below MIN_TOKENS: overhead, not speed
    assert s.save_bps is None and s.kv_bytes_per_token == 100_000
    assert s.note(SlotFileAnswer(Direction.SAVE, 1000, 100_000_000, 100.0, 900.0))  # a save's wait is no overhead
    assert s.save_bps == 1e9 and s.rates(None).overhead_s == pytest.approx(0.002)
    assert s.rates(250.0).measured and s.rates(250.0).prefill_tps == 250.0
    s.forget()
    assert not s.rates(250.0).measured


def test_a_restore_queued_behind_a_running_batch_does_not_raise_the_move_overhead():
    """bench mix-4 run E: a 0.5 s restore (server time) answered after 19 s, queued behind a long prefill; the
    overhead then priced every restore at about 19 s. A prefill started then waits for the same batch: only the
    call's fixed part, the smallest of the last OVERHEAD_WINDOW restores, weighs a move against a prefill."""
    from slotlogic.costs import OVERHEAD_WINDOW
    s = Speeds()
    s.note(SlotFileAnswer(Direction.RESTORE, 6000, 600_000_000, 500.0, 530.0))
    s.note(SlotFileAnswer(Direction.RESTORE, 6000, 600_000_000, 500.0, 19_000.0))
    assert s.rates(None).overhead_s == pytest.approx(0.03)
    for _ in range(OVERHEAD_WINDOW - 1):  # the old sample leaves the window: the overhead follows the server
        s.note(SlotFileAnswer(Direction.RESTORE, 6000, 600_000_000, 500.0, 560.0))
    assert s.rates(None).overhead_s == pytest.approx(0.06)


def test_the_prefill_fit_finds_the_per_token_cost_and_its_growth_with_depth():
    a, b = 1 / 20_000, 1 / 20_000 / 32_768
    fit = PrefillFit()
    for n, c in ((500, 0), (2000, 500), (4000, 8000), (800, 20_000), (3000, 1000)):
        seconds = a * n + b * n * (c + n / 2)
        fit.note(n, c, n / seconds)
    got = fit.solve()
    assert got is not None and got[0] == pytest.approx(a, rel=1e-6) and got[1] == pytest.approx(b, rel=1e-6)
    s = Speeds()
    s.fit = fit
    r = s.rates(5.0)   # the fit overrides the plain average once it has depth
    assert r.prefill_tps == pytest.approx(20_000) and r.prefill_depth == pytest.approx(32_768)


def test_a_fit_of_answers_of_one_size_has_no_depth_and_falls_back_to_the_average():
    fit = PrefillFit()
    for _ in range(5):
        fit.note(1000, 0, 900.0)
    assert fit.solve() is None
    s = Speeds()
    s.fit = fit
    assert s.rates(900.0).prefill_tps == 900.0 and s.rates(900.0).prefill_depth is None


def test_gpu_speeds_recompute_short_conversations_and_restore_long_ones_at_the_crossover():
    """f16 KV of an 8B model (128 KiB a token) read at 2 GB/s is 65.5 µs a token, a prefilled token 50 µs at the
    start of a context: recomputing wins until attention has made prefilled tokens dear enough."""
    n = crossover(GPU, 128 * KIB)
    assert 19_000 < n < 22_000
    below, above = costs.page_in(int(n * 0.97), 0, GPU), costs.page_in(int(n * 1.03), 0, GPU)
    assert below is not None and above is not None
    assert not below.worth and above.worth
    short = costs.page_in(1342, 0, GPU)
    assert short is not None and not short.worth and short.bytes == 1342 * 128 * KIB
    assert short.prefill_s == pytest.approx(1342 / 20_000 * (1 + 1342 / 65_536))
    long = costs.page_in(30_000, 0, GPU)
    assert long is not None and long.worth
    assert long.move_s == pytest.approx(0.002 + 30_000 * 128 * KIB / 2e9)


def test_q8_0_pages_halve_and_the_crossover_moves_down_to_a_few_hundred_tokens():
    q8 = 34 * (32 * 8 * 128 * 2 // 32)  # q8_0: 34 bytes a block of 32 values; 32 layers × 8 KV heads × 128 dims, K, V
    n = crossover(GPU, q8)
    assert 100 < n < 200
    assert not costs.page_in(int(n * 0.9), int(n * 0.9) * q8, GPU).worth   # type: ignore[union-attr]
    assert costs.page_in(int(n * 1.1), int(n * 1.1) * q8, GPU).worth       # type: ignore[union-attr]


def test_on_two_cpu_cores_paging_always_wins():
    for tokens in (64, 1342, 30_000):
        for choice in (costs.page_in(tokens, 0, CPU), costs.page_out(tokens, CPU),
                       costs.prefix_restore(tokens, 0, CPU)):
            assert choice is not None and choice.worth


def test_page_out_counts_the_save_and_the_restore_back():
    n = 25_000
    out, back = costs.page_out(n, GPU), costs.page_in(n, 0, GPU)
    assert out is not None and back is not None
    assert out.move_s == pytest.approx(back.move_s + 0.002 + n * 128 * KIB / 2e9)
    assert back.worth and not out.worth   # worth reading back if saved, not worth saving and reading back
    assert costs.page_out(120_000, GPU).worth   # type: ignore[union-attr]


def test_unmeasured_or_unknown_sizes_keep_todays_behaviour():
    partial = Rates(prefill_tps=20_000)
    assert costs.page_in(1000, 0, partial) is None and costs.page_out(1000, partial) is None
    assert costs.page_out(None, GPU) is None
    assert costs.page_in(1000, 0, Rates(20_000, 2e9, 2e9)) is None     # no bytes, no KV width: no estimate
    plan = PagePlan(0, "b", "fb", "a", "fa", 1000)
    assert costs.judge(plan, GPU, holder_tokens=None, restore_bytes=0, seed_tokens=0) == replace_choices(
        plan, costs.page_in(1000, 0, GPU))


def replace_choices(plan: PagePlan, *choices: Choice | None) -> PagePlan:
    """`plan` with the restore dropped (what `judge` makes of a short page at GPU speeds)."""
    kept = tuple(replace(c, session="a") for c in choices if c is not None)
    return replace(plan, restore_for=None, restore_file=None, restore_tokens=0, choices=kept)


def test_judge_drops_each_move_that_costs_more_than_it_spares():
    plan = PagePlan(0, "b", "fb", "a", "fa", 40_000)
    judged = costs.judge(plan, GPU, holder_tokens=500, restore_bytes=40_000 * 128 * KIB, seed_tokens=0)
    assert judged.save_file is None and judged.restore_file == "fa"          # let the short one go, restore the long
    assert [(c.move, c.session, c.worth) for c in judged.choices] == [(Move.PAGE_OUT, "b", False),
                                                                      (Move.PAGE_IN, "a", True)]
    live = paging.seeded(PagePlan(0), paging.Seed("s", 4 * 300, slot=2), {}, UP, "x")
    judged = costs.judge(live, GPU, holder_tokens=None, restore_bytes=0, seed_tokens=300)
    assert judged.seed is None and judged.restore_file is None and judged.choices[0].move is Move.LIVE_SEED
    assert costs.judge(live, CPU, holder_tokens=None, restore_bytes=0, seed_tokens=300).seed is not None


def test_a_page_seed_is_worth_only_the_part_it_shares():
    """Another session's page restored as a start spares prefilling what the two share, not the whole page:
    a long page that shares a short prefix costs more to read than that prefix costs to prefill."""
    pages = {"s": PageRecord("fs", 20_000, 1.0, 20_000 * 23_000, "m")}
    seed = paging.seeded(PagePlan(0), paging.Seed("s", 4 * 300, prefix=True), pages, UP, "x")
    slow_disk = replace(CPU, restore_bps=1e8)  # 4.6 s to read, 3 s to prefill 300 tokens
    judged = costs.judge(seed, slow_disk, holder_tokens=None, restore_bytes=20_000 * 23_000, seed_tokens=300)
    assert judged.seed is None and judged.restore_file is None
    assert judged.choices[0].prefill_s == pytest.approx(slow_disk.prefill_s(300))
    kept = costs.judge(seed, slow_disk, holder_tokens=None, restore_bytes=20_000 * 23_000, seed_tokens=19_000)
    assert kept.seed is not None and kept.restore_file == "fs"


def test_the_pager_weighs_its_plan_once_speeds_are_measured():
    k = Keeper(Settings(paging=True, save_dir="/x"), UP)
    k.facts.note_server(st.ServerState(UP), ServerInfo(total_slots=4, model_path="/m.gguf", build_info="b1",
                                                       n_ctx=8192))
    k.pager.index = {"a": PageRecord(paging.page_file(UP, "a"), 1342, 1.0, 1342 * 128 * KIB, k.page_identity)}
    assert k.pager.page_plan(PageAsk(0, "a", SlotView(0, 0))).restore_for == "a"            # nothing measured: page in
    k.outcomes.probed(20_000)
    k.speeds.note(SlotFileAnswer(Direction.RESTORE, 1000, 1000 * 128 * KIB, 1000 * 128 * KIB / 2e6))
    plan = k.pager.page_plan(PageAsk(0, "a", SlotView(0, 0)))
    assert plan.restore_for is None and plan.empty                                 # cheaper to prefill
    assert [(c.move, c.tokens, c.worth) for c in plan.choices] == [(Move.PAGE_IN, 1342, False)]
    assert k.status(st.ServerState(UP), 0.0)["speeds"]["restore_mb_s"] == 2000.0
    k.outcomes.probed(100.0)                                                       # a CPU: page in
    assert k.pager.page_plan(PageAsk(0, "a", SlotView(0, 0))).restore_for == "a"


def test_with_the_cost_model_off_the_pager_pages_in_at_measured_speeds_that_favour_prefill():
    """`slots_cost_model=false` (the bench's always-page configurations): the speeds are measured and shown,
    and the plan is made as before they were."""
    k = Keeper(Settings(paging=True, save_dir="/x", cost_model=False), UP)
    k.facts.note_server(st.ServerState(UP), ServerInfo(total_slots=4, model_path="/m.gguf", build_info="b1",
                                                       n_ctx=8192))
    k.pager.index = {"a": PageRecord(paging.page_file(UP, "a"), 1342, 1.0, 1342 * 128 * KIB, k.page_identity)}
    k.outcomes.probed(20_000)
    k.speeds.note(SlotFileAnswer(Direction.RESTORE, 1000, 1000 * 128 * KIB, 1000 * 128 * KIB / 2e6))
    assert k.rates().measured and k.status(st.ServerState(UP), 0.0)["speeds"]["restore_mb_s"] == 2000.0
    plan = k.pager.page_plan(PageAsk(0, "a", SlotView(0, 0)))
    assert plan.restore_for == "a" and plan.choices == ()


# --- the KV cache type, read off a save's size (slotlogic/kv_types.py) ------------------------------------------

def eight_b(tmp_path: Path) -> ModelFacts:
    """An 8B-class KV layout: 32 layers × 8 KV heads × 128 dims."""
    def fill(w: gguf.GGUFWriter) -> None:
        common(w, layers=32, embd=4096, heads=32)
        w.add_head_count_kv(8)
    return ModelFacts.from_metadata(gguf_io.read_header(write_gguf(tmp_path / "m.gguf", "llama", fill)).metadata or {})


def test_a_saves_size_tells_the_cache_type_and_a_page_under_another_is_not_restored(tmp_path):
    facts = eight_b(tmp_path)
    assert facts.kv_bytes_per_token() == 128 * KIB
    for kv in (("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("f16", "q8_0")):  # K and V rows: same size
        size = facts.slot_file_bytes(1342, *kv, n_streams=4)
        assert kv_types.infer(facts, 1342, size, 4, ("f16", "f16")) == kv
    assert kv_types.infer(facts, 1342, facts.slot_file_bytes(1342, "bf16", "bf16", 4), 4, ("bf16", "bf16")) == (
        "bf16", "bf16")                                                  # a tie goes to the configured type
    assert kv_types.infer(facts, 1342, 12345, 4, ("f16", "f16")) is None  # nothing matches: nothing concluded
    assert kv_types.infer(None, 1342, 12345, 4, ("f16", "f16")) is None
    f16 = ServerInfo(total_slots=4, model_path="/m.gguf", build_info="b1", n_ctx=8192, kv_cache="f16/f16")
    q8 = replace(f16, kv_cache="q8_0/q8_0")
    assert f16.page_identity("") != q8.page_identity("") and f16.identity != q8.identity
    k = Keeper(Settings(paging=True, save_dir="/x"), UP)
    k.facts.note_server(st.ServerState(UP), f16)
    k.pager.index = {"a": PageRecord(paging.page_file(UP, "a"), 900, 1.0, 100, k.page_identity)}
    assert k.pager.page_plan(PageAsk(0, "a", SlotView(0, 0))).restore_for == "a"
    k.facts.server = q8
    assert k.pager.page_plan(PageAsk(0, "a", SlotView(0, 0))).restore_file is None
