"""Restore health (slotlogic/restore_health.py): a restore that answers 200 is judged by the request after it;
two in a row that kept nothing turn paging and prefix restores off for that server until it restarts."""

from __future__ import annotations

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
