"""Restore health (slotlogic/restore_health.py): a restore that answers 200 is judged by the request after it;
two in a row that kept nothing turn paging and prefix restores off for that server until it restarts."""

from __future__ import annotations

import time

from bench.sim.clock import VirtualClock, run
from bench.sim.harness import Rig, Setup
from bench.sim.invariants import Checker
from slotkeeper.drivers.upstream import Upstream
from slotlogic import shared, wording
from slotlogic.answers import Observation
from slotlogic.decisions import Ticket
from slotlogic.endpoints import Route
from slotlogic.events import RestoreJudged, RestoresBroken
from slotlogic.keeper import Keeper
from slotlogic.model_facts import ReuseKind
from slotlogic.restore_health import Health, RestoreHealth, RestoreKind
from slotlogic.server import ServerInfo
from slotlogic.session import SessionId
from slotlogic.settings import CheckpointMode, Settings
from tests.test_page_safety import FileSlots, PagingLlama, paging_upstream
from tests.test_page_safety import facts as page_facts
from tests.test_sim_harness import convo

UP = "http://up:1"
PAGE, PREFIX = RestoreKind.PAGE, RestoreKind.PREFIX


def keeper(**kw: object) -> Keeper:
    k = Keeper(Settings(save_dir="/tmp/x", paging=True, checkpoints=CheckpointMode.DISK, **kw), UP)  # type: ignore
    k.facts.note_server(shared.ServerState(UP), ServerInfo(total_slots=2, media_marker="m1"))
    return k


def ticket(restore: tuple[RestoreKind, int] | None, *, extends: bool | None = None) -> Ticket:
    return Ticket(SessionId("a" * 64, "content:root"), Route.PINNABLE, slot=0, restore=restore, extends=extends)


def test_two_restores_in_a_row_that_keep_nothing_make_the_server_broken_once():
    """The no-op restore of a build that answers with the saved counts: each next request finds 0 cached."""
    h = RestoreHealth()
    assert not h.judge(PAGE, 800, 3) and h.health is Health.UNKNOWN and h.streak == 1
    assert h.judge(PREFIX, 500, 0) and h.broken          # the second: news, once
    assert not h.judge(PAGE, 800, 0) and h.failed == 2   # judged broken already: nothing more to learn
    s = Settings(save_dir="/d", paging=True, checkpoints=CheckpointMode.DISK)
    eff = h.effective(s)
    assert (eff.paging, eff.checkpoints) == (False, CheckpointMode.MEMORY)
    assert h.view()["health"] == "broken"


def test_a_restore_that_took_breaks_the_streak():
    """A working server's one odd answer (a conversation edited, a template's tail) is not a verdict."""
    h = RestoreHealth()
    h.judge(PAGE, 800, 0)
    h.judge(PAGE, 800, 795)
    assert h.health is Health.TAKES and h.streak == 0
    assert not h.judge(PAGE, 800, 0) and not h.broken
    s = Settings(save_dir="/d", paging=True)
    assert h.effective(s) is s


def test_short_restores_and_answers_without_counts_teach_nothing():
    h = RestoreHealth()
    assert not h.judge(PAGE, 20, 0) and not h.judge(PAGE, 800, None)
    assert h.last is None and h.streak == 0


def test_the_answer_after_a_restore_is_judged_unless_its_conversation_was_edited():
    k = keeper()
    ok = Observation(cache_n=0, prompt_n=900)
    assert k.facts.answer_after_restore(ticket((PAGE, 800), extends=False), ok) == []   # an edit reuses less
    assert k.facts.answer_after_restore(ticket(None), ok) == []
    first = k.facts.answer_after_restore(ticket((PAGE, 800)), ok)
    assert first == [RestoreJudged(UP, 0, "page-in", 800, 0, False)]
    second = k.facts.answer_after_restore(ticket((PREFIX, 400), extends=True), ok, ReuseKind.NEEDS_SWA_FULL)
    broken = second[-1]
    assert isinstance(broken, RestoresBroken) and (broken.kinds, broken.restored, broken.cached) == (
        ("page-in", "prefix"), (800, 400), (0, 0))
    line = wording.event_line(broken)[1]
    assert "--swa-full" in line and "paging and prefix restores are off" in line and "800" in line


def test_the_fix_named_follows_what_the_model_check_knows():
    def line(reuse: ReuseKind | None, swa_full: bool = False) -> str:
        return wording.event_line(RestoresBroken(UP, ("page-in",) * 2, (800, 800), (0, 0), reuse, swa_full))[1]
    assert "--swa-full" in line(None) and "build" in line(None)            # not known: both named
    assert "--swa-full" not in line(ReuseKind.CHECKPOINTS_ONLY)             # no flag fixes a hybrid
    assert "--swa-full" in line(ReuseKind.NEEDS_SWA_FULL)
    assert wording.event_record(RestoresBroken(UP, ("prefix",), (5,), (0,), None, False))["kind"] == "restores-broken"


def test_a_restarted_server_is_asked_again():
    """A new server process may be a build with the fix, or run with --swa-full."""
    k = keeper()
    for _ in range(2):
        k.facts.restore_judged(1, PAGE, 800, 0)
    assert k.facts.restores.broken
    events = k.facts.note_server(shared.ServerState(UP), ServerInfo(total_slots=2, media_marker="m2"))
    assert events and k.facts.restores.health is Health.UNKNOWN and not k.facts.restores.broken


async def _turns(tmp_path, kept_share: float, n: int = 8) -> tuple[Upstream, FileSlots, list]:
    """Two sessions taking turns on one slot: each turn pages the other out and its own page in. The server's
    answer finds `kept_share` of what the restore answered it put there (0: a restore that keeps nothing)."""
    slots, seen = FileSlots(tmp_path / "slots", per_token=10), []  # writes its page files, as llama-server does
    up = paging_upstream(tmp_path, PagingLlama(slots), seen)
    now = time.time()
    for turn in range(n):
        d = await up.decide(page_facts("AB"[turn % 2], now + turn * 10), f"f{turn}")
        up.unlock(f"f{turn}")
        kept = int(d.ticket.restore[1] * kept_share) if d.ticket.restore else 0
        up.answered(d.ticket, Observation(cache_n=kept, prompt_n=900), path="/v1/chat/completions", seconds=1.0)
        await up.settle()
    return up, slots, seen


async def test_restores_that_keep_nothing_stop_after_two(tmp_path):
    """The no-op restore (answers with the saved counts, the next request prefills everything): the proxy used to
    page in at every turn (6 restores and 7 saves in 8 turns here), each a save, a restore and the whole prefill
    anyway. Now the second page-in that kept nothing ends paging on that server: no restore and no save after it,
    one line."""
    up, slots, seen = await _turns(tmp_path, 0.0)
    broken = [e for e in seen if isinstance(e, RestoresBroken)]
    assert len(broken) == 1 and up.pages is None
    # turn 1 saves A; turns 2 and 3 each save one and restore the other; after the verdict nothing is sent
    assert slots.calls.count("restore") == 2 and len(slots.peaks) == 3
    assert up.status_now()["restores"]["health"] == "broken"
    # a new server process (another build, other flags) is asked again
    up.client.props_data = {**up.client.props_data, "media_marker": "<restarted>"}  # type: ignore[attr-defined]
    await up.prober.probe()
    await up.settle()
    assert up.pages is not None and up.status_now()["restores"]["health"] == "unknown"


async def test_restores_that_take_keep_paging(tmp_path):
    up, slots, seen = await _turns(tmp_path, 0.99)
    assert not any(isinstance(e, RestoresBroken) for e in seen) and up.pages is not None
    assert slots.calls.count("restore") == 6 and len(slots.peaks) == 7
    assert up.status_now()["restores"]["health"] == "takes"


def test_the_simulator_s_broken_restores_stop_after_two_and_every_invariant_holds():
    """The simulator's broken build (restores answer the file's counts and leave the slot empty): two sessions
    taking turns on one slot through the real addons. Two restores, then none; the proxy's belief agrees with the
    simulated slots after every turn, and after the verdict no session loses a token it was promised."""
    async def main() -> tuple[list[list[str]], list, list]:
        async with Rig(Setup(slots=1, paging=True, restores_keep_nothing=True)) as rig:
            checker, seen, turns = Checker(rig), [], {"a": ["task a"], "b": ["task b"]}
            for i in range(8):
                tag = "ab"[i % 2]
                out = await rig.send(tag, convo(tag, *turns[tag]))
                turns[tag] += [out.content, f"output {i} " * 10]
                for up in rig.proxies[0].rt.upstreams.values():
                    await up.settle()
                seen.append(checker.violations())
            events = [e for s in rig.servers.values() for e in s.events]
            return seen, events, list(rig.outcomes)
    seen, events, outcomes = run(VirtualClock(), main)
    restores = [e for e in events if e.kind == "restore"]
    assert len(restores) == 2 and all(e.after == 0 for e in restores), restores
    # The table and the ledger agree with the simulated slots at every turn. (The meter's check is left out: its
    # ground truth counts a page's tokens, 4 more than the prompt the meter counts, and calls a conversation not
    # paged in after the verdict `not-paged-in`, unlabelled; the proxy chose it, and meters it `evicted`.)
    assert [[v for v in step if "metered" not in v] for step in seen] == [[]] * 8, seen
    verdict = restores[-1].t
    later = [o for o in outcomes if o.started > verdict and o.done is not None]
    assert later and all(o.report.loss is None or o.report.loss.expected for o in later), [
        (o.tag, o.meta.get("reason"), o.report.loss) for o in later]
