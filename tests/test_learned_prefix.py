"""Stable prefixes learned from two sessions' system messages: where they cut, what is kept, what is found."""

from __future__ import annotations

import sys

from hypothesis import given, settings
from hypothesis import strategies as s

from slotlogic.learned_prefix import (
    MAX_LEARNED,
    MAX_SAMPLES,
    MAX_SENDERS,
    PrefixLearner,
    common_length,
    first_system,
    stable_cut,
)

SHARED = "You are a coding agent.\n" + "".join(f"Rule {i}: keep changes small and test them.\n" for i in range(30))
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


def body(system: str, first: str = "task", tools=TOOLS) -> dict:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": first}],
            "tools": tools}


def env(cwd: str, date: str) -> str:
    return SHARED + f"\n<env>\nWorking directory: {cwd}\nToday's date: {date}\n</env>"


COMMON = SHARED + "\n<env>"  # every line before the first that differs


def test_two_sessions_teach_the_shared_part_cut_at_a_line_end():
    learner = PrefixLearner(min_chars=100)
    assert learner.observe("a", body(env("/srv/a", "2026-11-30")), 1.0) is None  # one session shows nothing
    rec = learner.observe("b", body(env("/srv/b", "2026-11-30")), 2.0)
    assert rec is not None and rec.length == len(COMMON)
    found = learner.find(body(env("/home/c", "2026-12-01")), 3.0)
    assert found is not None and found.text == COMMON and found.tools == TOOLS
    assert learner.find(body(env("/srv/a", "x"), tools=None), 3.0) is None  # other tools: another context
    assert learner.find(body("Something else entirely.\n" * 30), 3.0) is None


def test_a_system_message_that_repeats_exactly_is_its_own_prefix():
    learner = PrefixLearner(min_chars=100)
    learner.observe("a", body(SHARED, "task A"), 1.0)
    rec = learner.observe("b", body(SHARED, "task B"), 2.0)
    assert rec is not None and rec.length == len(SHARED.rstrip())


def test_the_longest_matching_prefix_wins_and_no_text_is_kept_in_records():
    learner = PrefixLearner(min_chars=100)
    for session, cwd in (("a", "/p/x"), ("b", "/p/x"), ("c", "/q/y")):
        learner.observe(session, body(env(cwd, f"day {session}")), 1.0)
    lengths = sorted(r.length for r in learner.records())
    assert len(lengths) == 2 and lengths[0] == len(COMMON)  # the client's prefix and the project's
    same_project = learner.find(body(env("/p/x", "day d")), 2.0)
    assert same_project is not None and len(same_project.text) == lengths[1]
    assert all(set(vars(r)) == {"context", "length", "digest", "last_seen"} for r in learner.records())


def test_learned_prefixes_survive_in_records_and_are_bounded():
    learner = PrefixLearner(min_chars=100)
    learner.observe("a", body(env("/a", "1")), 1.0)
    learner.observe("b", body(env("/b", "2")), 2.0)
    other = PrefixLearner(min_chars=100)
    other.load(learner.records())  # a restarted proxy, from the state file
    assert other.find(body(env("/c", "3")), 3.0) is not None
    for i in range(MAX_LEARNED + 10):
        other.observe(f"s{i}", body(f"Prompt number {i}.\n" * 40), float(i))
        other.observe(f"t{i}", body(f"Prompt number {i}.\n" * 40), float(i))
    assert len(other.records()) == MAX_LEARNED


def test_sample_texts_stay_under_their_byte_budget_and_still_teach(monkeypatch):
    """Issue 20: 60 sessions with 8 MB system prompts kept 8 samples of 8 MB per context, in up to 32 contexts."""
    from slotlogic import learned_prefix as lp
    monkeypatch.setattr(lp, "MAX_SAMPLE_BYTES", 1 << 20)
    monkeypatch.setattr(lp, "MAX_TEXT_BYTES", 1 << 19)
    learner = PrefixLearner(min_chars=256)
    shared = "Rules of the project.\n" * 20_000   # ~440 KB
    for i in range(12):
        learner.observe(f"s{i}", body(shared + env(f"/w/{i}", "d"), tools=[{"name": "t"}]), float(i))
        assert learner.sample_bytes <= 1 << 20
        assert learner.sample_bytes == sum(sys.getsizeof(t) for c in learner.samples.values() for t in c.values())
    assert learner.find(body(shared + env("/w/new", "d"), tools=[{"name": "t"}]), 20.0) is not None
    learner.observe("huge", body("x" * (1 << 19)), 21.0)  # past a million tokens' worth: neither compared nor kept
    assert all("huge" not in c for c in learner.samples.values()) and learner.sample_bytes <= 1 << 20


def test_a_parent_whose_subagents_send_its_system_prompt_stays_a_sharer_of_it():
    """bench subagents seed 6: four main sessions, then a burst of subagents each sending its parent's system
    prompt. Kept per session, the first parents' texts went out after eight sessions, and the next subagent of
    that family found no live conversation sharing its family's part of the prompt (a 211-token warm-up)."""
    learner = PrefixLearner(min_chars=100)
    mains = [f"m{i}" for i in range(4)]
    for i, m in enumerate(mains):
        learner.observe(m, body(env(f"/w/{i}", "d")), float(i))
    learner.observe("first", body(env("/w/0", "d"), first="question"), 5.0)  # the first family's first subagent
    for n in range(3 * MAX_SAMPLES):  # then a burst of the other families' subagents
        parent = 1 + n % 3
        learner.observe(f"sub{n}", body(env(f"/w/{parent}", "d"), first=f"question {n}"), 10.0 + n)
    family = learner.find(body(env("/w/0", "d"), first="another question"), 50.0)
    assert family is not None and family.text == env("/w/0", "d")  # learned from the parent and its subagent
    sharers = dict(learner.sharers(family))
    assert sharers["m0"] == len(family.text)  # the parent holds all of it
    assert all(sharers[m] < len(family.text) for m in mains[1:])  # the others: the shared part only


def test_a_text_keeps_its_latest_senders_and_the_least_recently_sent_text_goes_first():
    learner = PrefixLearner(min_chars=100)
    for n in range(MAX_SENDERS + 5):
        learner.observe(f"s{n}", body(env("/same", "d")), float(n))
    prefix = learner.find(body(env("/same", "d")), 99.0)
    assert prefix is not None
    senders = [k for k, _ in learner.sharers(prefix) if k.startswith("s")]
    assert senders == [f"s{n}" for n in range(5, MAX_SENDERS + 5)]
    for i in range(MAX_SAMPLES):
        learner.observe(f"o{i}", body(env(f"/other/{i}", "d")), 200.0 + i)
    assert not any(k.startswith("s") for k, _ in learner.sharers(prefix))  # its text was the oldest
    assert learner.sample_bytes == sum(sys.getsizeof(t) for c in learner.samples.values() for t in c.values())


def test_short_or_markerless_texts_teach_nothing():
    assert stable_cut("abc\ndef", "abc\nxyz", 100) is None
    assert stable_cut("x" * 300, "x" * 299 + "y", 10) is None  # no line break in the shared part
    assert first_system({"messages": [{"role": "user", "content": "x"}]}) is None


lines = s.lists(s.text(alphabet=s.characters(blacklist_categories=("Cs",), blacklist_characters="\n"),
                       max_size=30), min_size=1, max_size=12).map(lambda ls: "\n".join(ls))


@settings(max_examples=200, deadline=None)
@given(shared=lines, tail_a=lines, tail_b=lines)
def test_a_learned_prefix_is_a_line_aligned_prefix_of_every_contributing_prompt(shared, tail_a, tail_b):
    a, b = shared + "\n" + tail_a, shared + "\n" + tail_b
    n = stable_cut(a, b, 1)
    if n is None:
        return
    assert a[:n] == b[:n]  # a prefix of both
    assert n <= common_length(a, b)
    for text in (a, b):  # only blanks between the cut and the end of its line: a line end in both prompts
        assert text[n:].split("\n", 1)[0].strip() == ""
