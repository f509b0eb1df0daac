"""Every line slotkeeper prints comes from typed records; none can carry prompt text."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from slotlogic import events as ev
from slotlogic import wording
from slotlogic.answers import Observation
from slotlogic.checkpoint_machine import Failure, Note, NoteKind, Outcome
from slotlogic.costs import Choice, Move
from slotlogic.decisions import Report, Ticket
from slotlogic.endpoints import Route
from slotlogic.ledger import Cause
from slotlogic.paging import PageCheck
from slotlogic.reasons import Passed, Why
from slotlogic.scheduler import Action, Candidate, Pick
from slotlogic.session import SessionId

EVENTS = [c for c in vars(ev).values() if isinstance(c, type) and issubclass(c, ev.Event) and c is not ev.Event]


def sample(cls: type) -> ev.Event:
    """An instance with a plausible value for every field (strings get a marker we can look for)."""
    hints = typing.get_type_hints(cls)
    values = {"upstream": "http://u:1"}
    for f in dataclasses.fields(cls):
        if f.name in values:
            continue
        hint = str(hints[f.name])
        values[f.name] = (Passed.NOT_JSON_OBJECT if "Passed" in hint else ev.Stage.PAGING if "Stage" in hint
                          else ev.Via.NOTICE if "Via" in hint else Cause.STALE_PAGE if "Cause" in hint
                          else Outcome.WARMED if "Outcome" in hint else PageCheck.LOW_CACHE if "PageCheck" in hint
                          else Choice(Move.PAGE_IN, 1342, 31_000_000, 0.2, 13.0, "c" * 16) if "Choice" in hint
                          else Pick(Candidate(Action.MOVE_FREE, 2, 4.2), Candidate(Action.HOLD, None, 12.0),
                                    ((Action.SERVER_CHOOSES, "promise"),)) if "Pick" in hint
                          else Failure(400, "invalid_request_error")
                          if "Failure" in hint else Note(NoteKind.COLD, 1) if "Note" in hint
                          else (1, 2) if "tuple[int" in hint else ("a",) if "tuple[str" in hint
                          else True if hint == "<class 'bool'>" else 1.5 if "float" in hint and "int" not in hint
                          else 3 if "int" in hint else "x")
    return cls(**values)


def test_the_request_line_keeps_its_shape():
    ticket = Ticket(SessionId("016d9bcc" + "0" * 8, "content:root"), Route.PINNABLE, slot=0, why=Why.KNOWN)
    report = Report(ticket, Observation(cache_n=887, prompt_n=219), 0, "/v1/chat/completions", "u", 4.61)
    assert wording.request_line(report) == ("slotkeeper: /v1/chat/completions session=016d9bcc (content:root) "
                                            "slot=0 why=known cache_n=887 prompt_n=219 reuse=80% 4.61s")
    assert wording.marker(report) == ":zap:" and wording.request_record(report)["reason"] == "known"


@pytest.mark.parametrize("cls", EVENTS, ids=lambda c: c.__name__)
def test_every_event_has_a_line_or_a_record(cls):
    event = sample(cls)
    if wording.logged(event):
        level, text = wording.event_line(event)
        assert text.startswith("slotkeeper: ") and level in wording.Level
    else:
        assert wording.event_record(event) is not None


@pytest.mark.parametrize("kind", list(NoteKind))
def test_every_checkpoint_step_has_words(kind):
    assert wording.note(Note(kind, 2, "prefix-0123456789abcdef.bin", 10, 5, (9, 10), (0, 12), 0.9,
                             Failure(400, "invalid_request_error")))


def test_failures_name_a_type_and_a_status_never_a_message():
    assert wording.failure(Failure(0)) == "timeout or unreachable"
    assert wording.failure(Failure(400, "invalid_request_error")) == "HTTP 400: invalid_request_error"
    line = wording.event_line(ev.Failed("u", ev.Stage.REQUEST, "UnicodeEncodeError", "POST", "/v1/chat/completions"))
    assert line[1] == ("slotkeeper: internal error on POST /v1/chat/completions, forwarded unchanged: "
                       "UnicodeEncodeError")


def test_control_bytes_from_a_request_path_are_escaped_and_one_line_stays_one_line():
    """`?\x1b[1A\x1b[2K…` erased the previous line and drew a fake `slotkeeper:` line."""
    path = "/v1/chat/completions?\x1b[1A\x1b[2K\rslotkeeper: fake\n\x9b2J\u202eevil\u2028x"
    ticket = Ticket(SessionId("016d9bcc" + "0" * 8, "content:root"), Route.PINNABLE, slot=0, why=Why.KNOWN)
    line = wording.request_line(Report(ticket, Observation(cache_n=1, prompt_n=1), 0, path, "u", 1.0))
    assert line.isprintable() and line.count("slotkeeper:") == 2
    assert "\\x1b[1A\\x1b[2K\\x0dslotkeeper: fake\\x0a" in line
    assert "\\x9b2J\\u202eevil\\u2028x" in line
    _, text = wording.event_line(ev.PassedThrough("u", "POST", path, Passed.NOT_JSON_OBJECT))
    assert text.isprintable() and text.startswith("slotkeeper: POST /v1/chat/completions?\\x1b[1A")
    assert wording.printable("plain é ✓") == "plain é ✓"


def test_a_held_request_s_decision_names_the_winner_the_runner_up_and_the_filters():
    pick = Pick(Candidate(Action.RUN_OWN, None, 0.0), Candidate(Action.MOVE_FREE, 2, 4.2),
                ((Action.SERVER_CHOOSES, "promise"),))
    event = ev.Scheduled("http://u:1", "3f2a9c1e", 0, pick, 31.0)
    assert wording.event_line(event)[1] == ("slotkeeper: session 3f2a9c1e held 31 s on slot 0: run-own ~0 ms; "
                                            "runner-up move-free slot 2 ~4.2 s; removed server-chooses by promise")
    record = wording.event_record(event)
    assert record is not None and record["chosen"]["action"] == "run-own" and record["runner_up"]["seconds"] == 4.2
    assert record["removed"] == [{"action": "server-chooses", "filter": "promise"}]
