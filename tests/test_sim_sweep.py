"""Seeded workloads through the simulator: the sweep stays within its bound, and each loss cause the simulator
found in today's code has its shrunk seed here as a regression test (xfail until the cause is fixed; the
causes, step by step: docs/simulator.md, "Causes found")."""

from __future__ import annotations

import pytest

from bench.__main__ import main as bench_main
from bench.sim.losses import Loss
from bench.sim.sweep import SeedResult, run_seed, run_shape, summary, sweep
from bench.sim.traffic import crowd_shape

SWEEP = range(12)
BOUND = 3.0  # × limit: the worst of 1,000 seeds was 2.9 (few slots, paging off, many sessions)


@pytest.fixture(scope="module")
def results() -> list[SeedResult]:
    return sweep(SWEEP, processes=1)


def test_the_seeded_sweep_runs_every_workload_within_the_bound(results):
    assert [r.error for r in results] == [None] * len(SWEEP)
    assert all(r.requests > 0 and r.prefill >= r.limit * 0.5 for r in results)
    assert max(r.ratio for r in results) <= BOUND


def test_the_seeded_sweep_loses_nothing_unlabelled(results):
    assert {r.seed: r.lost for r in results if r.lost} == {}


def causes(seed: int, load: bool = False) -> set[str]:
    """The unlabelled causes of `seed`'s losses, on the shape it was found in (`load`: drawn with the loaded
    server the sweep draws since stop 37; the others as drawn before, so that each still replays its cause)."""
    return {x.cause for x in run_seed(seed, load=load).losses if not x.labelled}


# seeds found on the loaded draw (LOADED_AGAIN: a seed found on both draws, each its own cause)
LOADED = {590, 77, 1953, 2670}


# Each: the smallest seed of 0..299 with the cause (seeds 59 and 79: the issue-19 traffic, seed % 10 == 9).
# The assertion is the goal (no unlabelled loss); `causes`
# is named in the reason so that a fix shows which one went.
CAUSES = [
    (185, "side-call-over-owner: a title call is pinned to the reserved side slot (the highest) that a live "
          "session was placed on before any side call came; the session stays `known` there and finds 3 of 282"),
    (277, "prefix-restore-over-owner: two proxies on one state dir; proxy B evicts proxy A's live session, restores "
          "the prefix checkpoint over it; A never hears of it and pins its session `known`: 127 of 167"),
    (261, "other-proxy-request-over-owner: two proxies, one slot; B takes A's slot (evict-cheapest) without paging "
          "A's session out (B's pager knows only its own holders); A pins it `known`: 183 of 217"),
    (15, "page-of-another-conversation: two proxies, one slot; a page-out named for A's session is saved after B's "
         "session ran on the slot, and paging it in restores B's conversation: 204 of 238"),
    (62, "not-paged-in: a side call wiped a subagent's slot (side slot) with no page-out; the subagent comes back "
         "displaced:shared, its slot is saved (another session's tokens) and it prefills from the prefix: 202 of 235"),
    (59, "stale-page (issue 19's second kind): 2 servers x 2 slots, slow server; m2 is paged back in from a page "
         "of 559 tokens written before its last turn, which left 662: 559 of 662"),
    (79, "page-in-over-owner (issue 19's first kind, with a page): m5's slot is paged out and another conversation "
         "paged in, no request follows there, m5 stays `known` and finds 519 of 559; its old page (559) is later "
         "restored though its conversation grew to 715 (stale-page)"),
    (201, "moved-server: two servers; an evicted session with a page on server A is placed on server B "
          "(free-same-prefix) instead of being paged back in on A: 129 of 163"),
    (6, "not-paged-in: two placements chose one slot; the second's claim made the first's moves stale, the "
        "first was placed again, and the second paged the slot out before the first's request had run there"),
    (9, "not-paged-in: a placement's page-out reached the server before the request of the placement ahead of "
        "it on the slot (its lock went at that request's headers, the save was sent on another connection)"),
    (129, "not-paged-in: a displaced session with no page, its whole conversation still in the slot another "
          "placement had claimed, was placed elsewhere and started from the prefix"),
    (389, "stale-page: a slot still holding an older copy of a session that had moved on was paged out as that "
          "session's page, replacing its current one: paged in 559 of 696"),
    (54, "not-paged-in: a request that went out before a restart was noticed ran on the new server; noticing "
         "the restart then forgot what it left there, and the next placement wrote over it unsaved"),
    (993, "moved-server: two one-slot servers; a session with a page on server A, placed on server B because a "
          "side call took A's slot, prefilled its conversation there instead of restoring its page (one save dir)"),
    (98, "page-in-over-owner: two proxies, one slot; a taker's ask was overwritten by another taker's before it "
         "read its answer, waited it out and moved in anyway, over the other's moves"),
    (153, "side-call-over-owner: a title call placed on the side slot while a session's placement there was under way "
          "went out before that session's request was paged out, and overwrote it"),
    (381, "stale-page: two proxies, one slot; a slot handed back to a proxy was not paged out as its own session's, "
          "its ledger having lost sight of the slot at the first handover"),
    (633, "not-paged-in: two proxies; a placement took the state's newest claim (another proxy's, not yet run) for the "
          "slot's holder instead of what its own last request left there"),
    (984, "prefix-restore-over-owner: two proxies, one slot; a placement of the giver decided it was the writer in "
          "the moment between its handover's answer and that answer's write"),
    (1224, "not-paged-in: an expired session came back while another placement was paging its slot out: no copy of "
           "its live slot (busy), no page yet, so it prefilled"),
    (2034, "stale-page: a session came back while a side call paged its slot out: its older page was restored "
           "instead of the one being written"),
    (37, "side-call-over-owner: paging off; a session that had expired was resumed on its old slot, which a side "
         "call had written since (the proxy had evicted it knowingly), and reported `resumed`"),
    (131, "not-paged-in: two proxies, two slots at start-up; a placement handed a slot went stale, was placed "
          "again on it, and forgot the giver's answer (whose conversation was there): 96 of 129"),
    (627, "not-paged-in: two proxies, one slot; the giver answered after the taker's placement went stale and "
          "went elsewhere; the taker's next placement there never read that answer: 136 of 170"),
    (1000, "not-paged-in: two proxies, two slots at start-up; a title call's page step went stale (another claim "
           "of its slot came first) and the call was pinned there anyway, over a session's conversation that "
           "nobody had paged out: 34 of 217 (fixed: a side call whose page step went stale is placed again)"),
    (2438, "page-of-another-conversation: two proxies at start-up (seeds 1,000-2,999; fixed with the bounded "
           "placements: their moves are planned once the slot is idle at the server)"),
    (352, "side-call-over-owner: paging off, every slot a session's; a title call behind a long prefill on the side "
          "slot went out with id_slot -1 and the server ran it on a `known` session's idle slot: 3 of 196"),
    (77, "not-paged-in: a loaded server (262 tok/s, patience 6 s), two proxies, a restart noticed while `/slots` "
         "timed out (a stall): a turn sent before the restart was noticed ran on the new server, and with no "
         "`/slots` answer the restart's bookkeeping forgot what it left there; the session's next turn was placed "
         "anew and wrote over it unsaved: 40 of 254 (found when the loaded draws became client patiences; fixed: "
         "until `/slots` answers, an owner goes back to its emptied slot, which may hold its conversation, "
         "and the ledger holds it there on trust)"),
    (1953, "moved-slot: a loaded server (90 tok/s, patience 6 s), two stalls; a session's turns went with id_slot -1 "
           "while `/props` timed out (`unpinned: server unknown`) and ran on slot 5; the proxy never learned it, "
           "placed the session anew once `/props` answered and restored the prefix on an empty slot beside its "
           "conversation (found when the loaded draws became client patiences): 88 of 286 (fixed: such a request "
           "asks its answer for its slot, `verbose` as a pending one, and its session is recorded there; the first "
           "`/props` keeps what answers taught the ledger)"),
    (2670, "not-paged-in: a loaded server (288 tok/s, patience 15 s), a restart and two stalls; a title call pinned "
           "by hash onto the slot a session's turn had just run on was moved by the wait to a free slot before it "
           "ran, but its pin had already written the slot as the call's in the ledger; the session came back "
           "`displaced:shared` and got the prefix restored over the conversation still there (found when the "
           "loaded draws became client patiences): 205 of 391 (fixed: a pinned request that leaves its slot "
           "unrun puts back what its pin replaced, `ledger.put_back`)"),
    (1912, "other-proxy-request-over-owner: two proxies, two servers, two stalls; the pool's swapper detection "
           "asked every member's `/props`, which a stalled server answers only after the time-out, and the pool's "
           "first placements went later: one proxy's session came back `known` to the slot the other proxy had "
           "taken (found after the router-mode merge): 408 tokens (fixed: a router is told from `/models`, and a "
           "plain llama-server is never asked `/props` by the detection)"),
    (2055, "page-of-another-conversation: two proxies, two servers, a stall; the same timing shift as seed 1912: "
           "40 of 149 (fixed with it)"),
    (590, "not-paged-in: a loaded server (183 tok/s, bound 1 s), two one-slot servers; two placements past their "
          "bound both claimed the one slot and each waited for a slot with no claim but its own until the 3 s cap, "
          "then went with id_slot -1 over the sessions the slot held (fixed: a waiting placement lets go of its "
          "claim; since the wait bound is a third of the client's patience, the title call sent with id_slot -1 at "
          "its patience is a give-away the proxy labels, not an unlabelled loss)"),
]


# the slot ledger (docs/ledger.md): fenced moves, side calls page out, current pages; claims that queue, page-outs
# after every earlier request reached the server, live copies of a displaced conversation, older copies never
# paged, what ran on a restarted server kept, no resume over a slot written since; routing to the server that
# keeps a session's conversation, and its page restored on another server of the pool when it must go there;
# two proxies hand a slot over (slotlogic/handover.py): one writer per slot, the giver answers before the taker moves
FIXED = {77, 185, 62, 59, 79, 6, 9, 129, 389, 54, 37, 201, 993, 277, 261, 98, 153, 381, 633, 984, 1224, 2034,
         352, 131, 627, 15, 2438, 590, 1000, 1953, 2670, 1912, 2055}


# Seeds whose loaded draw showed a cause of its own, besides the one its first draw showed (in CAUSES).
LOADED_AGAIN = [
    (1224, "moved-server: a loaded server (84 tok/s, bound 1 s), two servers; a new session placed on server B "
           "waited out its bound, was placed again and refused there (no free slot left), and went to server A; "
           "B still counted it as its own, so its next turn went back to B (`displaced:resumed`) instead of "
           "having its page restored on A: 205 of 253 (fixed: a placement refused on a server it had claimed a "
           "slot of lets that claim and the session go)"),
    (984, "not-paged-in: a loaded server (174 tok/s, bound 2 s), two proxies, two slots; a title call's page step "
          "went stale when the other proxy's placement took the slot, and the call was pinned there anyway, over "
          "the conversation its own proxy had handed over to be paged out: 40 of 239 (found once the simulator's "
          "state-file lock became an in-process one; the same cause as seed 1000, fixed with it)"),
]


@pytest.mark.parametrize("seed,load", [pytest.param(seed, load, id=why.split(":")[0] + ("-loaded" if load else ""),
                                                    marks=() if seed in FIXED else
                                                    pytest.mark.xfail(strict=True, reason=f"seed {seed}, {why}"))
                                       for seed, why, load in [(s, w, s in LOADED) for s, w in CAUSES]
                                       + [(s, w, True) for s, w in LOADED_AGAIN]])
def test_a_shrunk_seed_of_each_cause_loses_nothing(seed, load):
    assert causes(seed, load) == set()


def test_a_seed_whose_hold_once_never_ended_runs_to_its_end():
    """Seed 1698 (loaded, two proxies, four slots): a held request's remaining wait was under the clock's
    resolution, so the clock never moved and the hold decided again for ever (a sweep's worker at 100% CPU)."""
    result = run_seed(1698)
    assert result.error is None and result.lost == 0


def test_bench_sim_runs_without_a_server_and_prints_the_figures(capsys):
    code = bench_main(["--sim", "--sim-seeds", "3", "--sim-processes", "1"])
    out = capsys.readouterr().out
    assert "simulated workloads: 3" in out and "worst x limit:" in out and "lost tokens (unlabelled):" in out
    assert code in (0, 1)


def test_bench_sim_seed_prints_each_loss_step_by_step(capsys):
    assert bench_main(["--sim-seed", "88"]) == 0  # unified KV: idle clearing, a labelled loss
    out = capsys.readouterr().out
    assert "cause=idle-clear why=known (labelled)" in out and "idle-clear 125->0" in out and "this request: slot" in out


def test_a_seed_with_an_unlabelled_loss_fails_the_sweep_and_prints_its_reproduction():
    loss = Loss("m2", "http://127.0.0.1:8080", 1, 40, 239, 199, "not-paged-in", "displaced:all-busy",
                ["t=10002.000 slot 1: request m3.title0 239->42 reused 3"])
    bad = SeedResult(984, "seed=984 servers=1 slots=2", 21, 1576, 1300, [loss])
    text = summary([run_seed(3), bad], 1.0)
    assert "lost tokens (unlabelled): 40" in text and "failing seeds: 1 (first: [984])" in text
    assert "reproduce: python -m bench --sim --sim-seed 984" in text and "request m3.title0 239->42" in text


@pytest.mark.parametrize("seed", [88, 105, 132])
def test_idle_clearing_seen_through_the_other_proxy_is_labelled_expected_by_both(seed):
    """Two proxies, unified KV: a slot emptied while idle was called `unknown` by the proxy whose own slots
    showed no evidence (the emptied ones were the other proxy's), 121-209 tokens a loss. Both read the evidence
    off the shared state now: the slots another proxy's live sessions hold, and that proxy's finding."""
    result = run_seed(seed, stalls=False)  # the shape it was found on (before stalls)
    assert result.miscalled == 0 and any(x.cause == "idle-clear" for x in result.losses)


@pytest.mark.parametrize("seed", [6])
def test_a_slot_our_page_out_finds_emptied_is_labelled_idle_clearing_not_the_write_after(seed):
    """Unified KV with idle clearing: the slot was emptied while idle; our page-out of its session then saved
    0 tokens, a prefix restore or seed copy wrote the slot, and the meter named that write
    (`prefix-over-owner`, `seed-over-owner`: 317 tokens; seed 685's 255 `unknown` were the same until a later
    change of placement moved its schedule). The page-out's own count is the evidence: the server is asked why
    (a restart? else idle clearing) and the loss carries that cause."""
    result = run_seed(seed, stalls=False)  # the shape it was found on (before stalls)
    assert result.miscalled == 0 and any(x.cause == "idle-clear" for x in result.losses)


@pytest.mark.parametrize("seed", [250, 364])
def test_a_slot_the_other_proxys_page_out_finds_emptied_is_labelled_idle_clearing_by_its_owner(seed):
    """Two proxies: the other proxy paged our session out of a slot idle clearing had emptied, and our meter
    called the loss `other-process` (331 and 105 tokens). That proxy writes what it found into the shared
    state (`emptied`), and our placement of the session reads it before moving anything."""
    result = run_seed(seed, stalls=False)  # the shape it was found on (before stalls)
    assert result.miscalled == 0 and any(x.cause == "idle-clear" for x in result.losses)


@pytest.mark.parametrize("seed", [1369, 2689, 2918])
def test_seeds_a_placement_placed_again_found_lose_nothing(seed):
    """Found by a 3,000-seed sweep once a waiting placement is placed again when another slot frees
    (`slotlogic.wait` Rule 10), each losing 40-67 tokens without a label. Seeds 1369 and 2689: a displaced
    session's live copy of its own conversation was refused because another placement was paging that slot out;
    its page, recorded a moment later, was then dropped as "not a seed" and the turn ran without it
    (`seed_pages.seed_from_its_page`). Seed 2918 (two proxies): a placement past its bound was placed again on a
    slot the other proxy writes, which looked idle here, and paged a session in over that proxy's turn queued on
    it; a slot only counts as idle for Rules 8 and 10 when this proxy writes it."""
    result = run_seed(seed, stalls=False)  # the shape it was found on (before stalls)
    assert result.error is None and result.lost == 0, [(x.tag, x.tokens, x.cause) for x in result.losses]


@pytest.mark.parametrize("seed", [2, 3, 140, 264, 1333])
def test_a_server_whose_props_and_slots_time_out_loses_nothing(seed):
    """On a loaded machine llama-server answered `/props` past the proxy's 3 s time-out (bench mix-4 on 2
    cores: a new session was then pinned by hash onto a slot in the middle of another
    placement's prefix warm-up, and the prefix file saved that session's conversation). The sweep's stalls
    (`Rig.stall`) found three causes: seeds 2 and 3, the hash fallback writing over a live session of a server
    this process knew (now placed with its last `/props`); 140 and 264, a server never heard from sent requests
    unpinned onto other sessions' slots (now asked again up to the hold's cap); 1333, a slot read as empty
    while `/slots` hung, a prefix restored over the conversation it held (now the ledger says what it holds)."""
    from bench.sim.traffic import shape_for

    assert shape_for(seed).stalls
    result = run_seed(seed)
    assert result.error is None and result.lost == 0, [(x.tag, x.tokens, x.cause, x.why) for x in result.losses]


def test_more_sessions_than_slots_without_a_save_dir_prefill_less_than_stock():
    """More sessions than slots without a save dir (`crowd_shape`: 3 sessions on 2 slots and shapes around it,
    80 of them): the proxy prefills less than stock (the server's own similarity and LRU choice) in total and
    on the 3-on-2 shapes alone, and loses nothing unlabelled. Before each owner's return time was measured, a
    displaced session left its slot only for an owner idle 5 s, and agents call again within 0-3 s: one
    session kept its slot while two displaced each other every turn (1.71 of the limit against stock's 1.68
    on these shapes; crowd seed 7: 2.35 against 1.47)."""
    proxy = [run_shape(crowd_shape(seed))[0] for seed in range(80)]
    stock = [run_shape(crowd_shape(seed, stock=True))[0] for seed in range(80)]
    assert [r.error for r in proxy + stock] == [None] * 160 and sum(r.lost for r in proxy) == 0
    assert sum(r.prefill for r in proxy) < sum(r.prefill for r in stock)
    three = [i for i in range(80) if crowd_shape(i).setup.slots == 2 and len(crowd_shape(i).sessions) == 3]
    assert len(three) > 30
    assert sum(proxy[i].prefill for i in three) < sum(stock[i].prefill for i in three)
    assert sum(r.prefill for r in proxy) / sum(r.limit for r in proxy) <= 1.7
