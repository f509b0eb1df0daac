"""The slot page's history (`slotlogic/board.py`): recent holders, marks, sessions' extras, warnings, all bounded."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from slotlogic import board
from slotlogic.answers import Observation
from slotlogic.board import Board, client_kind
from slotlogic.checkpoint_machine import Outcome
from slotlogic.decisions import Report, Ticket
from slotlogic.endpoints import Route
from slotlogic.events import CheckpointDone, Paged, TokensLost
from slotlogic.ledger import Cause, Loss
from slotlogic.session import SessionId

UP = "http://127.0.0.1:8080"


def report(key: str, slot: int | None, *, seconds: float = 0.5, loss: Loss | None = None,
           path: str = "/v1/chat/completions", source: str = "content:root") -> Report:
    ticket = Ticket(SessionId(key, source), Route.PINNABLE, slot=slot)
    return Report(ticket, Observation(), slot, path, UP, seconds, loss)


def test_known_clients_are_named_and_the_rest_is_api_and_signal():
    assert client_kind("/v1/messages?beta=true", "header:x-claude-code-session-id") == "claude-code"
    assert client_kind("/v1/responses", "header:session-id") == "codex"
    assert client_kind("/v1/chat/completions", "content:root") == "chat/content:root"
    assert client_kind("/completion", "content:continuation") == "completion/content:continuation"
    assert client_kind("/v1/chat/completions", "header:x-my-own-header") == "chat/header:other"


@given(st.text(max_size=40), st.text(max_size=40))
def test_client_kinds_are_a_fixed_set_whatever_the_client_sends(path, source):
    kinds = {client_kind(p, s) for p in ("/v1/messages", "/v1/responses", "/v1/chat/completions", "/x")
             for s in (*board._SIGNALS, "header:other", "other")} | set(board._NAMED.values())
    assert client_kind(path, source) in kinds  # a bounded label: never a client-chosen string


def test_holders_marks_and_losses_are_shown_per_server():
    b = Board()
    b.report(report("aaaaaaaa11111111", 0, seconds=2.0), now=100.0)
    b.event(Paged(UP, 0, "aaaaaaaa", 900, "bbbbbbbb", 800, 0.2, 10.0), now=104.0)
    b.event(CheckpointDone(UP, 1, Outcome.RESTORED, 450, None, None, 0.1), now=104.5)
    b.event(CheckpointDone(UP, 1, Outcome.HIT, 0, None, None, 0.0), now=104.6)  # nothing restored: no mark
    b.report(report("bbbbbbbb22222222", 0, loss=Loss(300, Cause.EVICTED)), now=105.0)
    b.event(TokensLost(UP, "bbbbbbbb", 0, 300, Cause.EVICTED, True, "chat/content:root"), now=105.0)  # its meter
    b.event(Paged("http://other:8080", 0, "cccccccc", 1, None, None, 0.1, 1.0), now=104.0)
    v = b.view(UP, now=106.0)
    assert [(s["slot"], s["session"], s["start"], s["end"]) for s in v["spans"]] == [
        (0, "aaaaaaaa", 98.0, 100.0), (0, "bbbbbbbb", 104.5, 105.0)]
    assert [(m["kind"], m["slot"], m["session"], m["tokens"]) for m in v["marks"]] == [
        ("page-out", 0, "aaaaaaaa", 900), ("page-in", 0, "bbbbbbbb", 800), ("prefix", 1, "", 450),
        ("loss", 0, "bbbbbbbb", 300)]
    assert v["sessions"]["bbbbbbbb"] == {"client": "chat/content:root", "lost_by_cause": {"evicted": 300},
                                         "pages_out": 0, "pages_in": 1}
    assert v["sessions"]["aaaaaaaa"]["pages_out"] == 1
    assert b.view("http://other:8080", now=106.0)["spans"] == []


def test_old_history_and_warnings_leave_the_view_and_every_ring_is_bounded():
    b = Board()
    b.report(report("aaaaaaaa11111111", 0), now=0.0)
    b.event(Paged(UP, 0, "aaaaaaaa", 1, None, None, 0.1, 1.0), now=0.0, warning="slotkeeper: something")
    assert b.view(UP, now=1.0)["warnings"] == [{"t": 0.0, "line": "slotkeeper: something"}]
    later = b.view(UP, now=board.HORIZON_S + 10)
    assert later["spans"] == [] and later["marks"] == [] and later["warnings"] == []
    for i in range(board.MAX_SPANS + board.MAX_SESSIONS + 10):
        b.report(report(f"{i:08x}00000000", i % 8, loss=Loss(1, Cause.UNKNOWN)), now=1000.0 + i * 0.001)
        b.event(TokensLost(UP, f"{i:08x}", i % 8, 1, Cause.UNKNOWN, False), now=1000.0 + i * 0.001)
    lane = b.lanes[UP]
    assert len(lane.spans) == board.MAX_SPANS and len(lane.marks) == board.MAX_MARKS
    assert len(lane.extras) == board.MAX_SESSIONS


def test_a_view_of_an_unknown_server_is_empty():
    v = Board().view("http://nowhere:1", now=5.0)
    assert v["spans"] == [] and v["sessions"] == {} and v["now"] == 5.0
