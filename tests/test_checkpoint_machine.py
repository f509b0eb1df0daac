"""The checkpoint state machine driven by recorded llama-server answers (no server)."""

import pytest

from slotlogic import wording
from slotlogic.checkpoint_machine import Orchestrator, Outcome, Phase, Result
from slotlogic.prefix import StablePrefix

P = StablePrefix("You are pi.", "system", None, None)
# Answers as llama-server gives them (docs/llama-server.md; the live build).
RESTORED = Result(200, {"id_slot": 1, "filename": "f.bin", "n_restored": 291, "n_read": 6710068})
RESTORE_400 = Result(400, {"error": {"code": 400, "message": "Unable to restore slot: No available space in KV "
                                     "cache or invalid slot save file", "type": "invalid_request_error"}})
NO_SAVE_PATH = Result(501, {"error": {"code": 501, "message": "This server does not support slots action. Start "
                                      "it with `--slot-save-path`", "type": "not_supported_error"}})
TIMEOUT = Result(0, None)
SAVED = Result(200, {"id_slot": 1, "filename": "f.bin", "n_saved": 291, "n_written": 6710068})
ERASED = Result(200, {"id_slot": 1, "n_erased": 291})


def saved(n):
    return Result(200, {"id_slot": 1, "filename": "f.bin", "n_saved": n, "n_written": n * 23_056})


def chat(cache_n, prompt_n):
    return Result(200, {"choices": [], "timings": {"cache_n": cache_n, "prompt_n": prompt_n}})


def lines(orch):
    return [wording.note(n) for n in orch.notes]


def run(orch, answers):
    kinds = []
    for answer in answers:
        action = orch.next_action()
        assert action is not None, f"machine finished early after {kinds}"
        assert action.slot == orch.slot
        kinds.append(action.kind.value)
        orch.feed(answer)
    assert orch.next_action() is None and orch.phase is Phase.DONE
    return kinds


def test_hit_needs_no_action():
    o = Orchestrator(2, P, "f.bin", persist=True, holds_prefix=True, file_known=True)
    assert run(o, []) == [] and o.outcome is Outcome.HIT


def test_restore_and_verify():
    o = Orchestrator(1, P, "f.bin", persist=True, file_known=True)
    kinds = run(o, [RESTORED, chat(290, 1), chat(288, 7)])
    assert kinds == ["restore", "verify", "verify"] and o.outcome is Outcome.RESTORED
    assert o.identical == (290, 291) and o.divergent == (288, 295) and o.spent_prefill == 8
    assert o.verified and not o.trusted
    assert "RESTORE verified: identical 290/291, divergent probe 288/295" in lines(o)


def test_a_file_verified_before_on_this_server_restores_without_the_gates_when_it_restores_as_then():
    o = Orchestrator(1, P, "f.bin", persist=True, file_known=True, verified_tokens=291)
    assert run(o, [RESTORED]) == ["restore"] and o.outcome is Outcome.RESTORED and o.spent_prefill == 0
    assert lines(o)[-1] == "RESTORE as verified before on this server (291 tokens): no verification requests"
    other = Orchestrator(1, P, "f.bin", persist=True, file_known=True, verified_tokens=300)  # restored otherwise
    assert run(other, [RESTORED, chat(290, 1), chat(288, 7)]) == ["restore", "verify", "verify"]


def test_restore_400_falls_back_to_cold_build_and_save():
    o = Orchestrator(1, P, "f.bin", persist=True, file_known=True)
    assert run(o, [RESTORE_400, chat(0, 291), SAVED]) == ["restore", "warm", "save"]
    assert o.outcome is Outcome.WARMED_SAVED and o.saved_tokens == 291 and o.spent_prefill == 291
    assert any(line.startswith("no checkpoint (restore HTTP 400") for line in lines(o))


def test_a_save_holding_other_than_the_warm_up_left_is_not_kept():
    """Another request ran on the slot between the warm-up and the save: the file holds its conversation under
    the prefix's name, so it is not a checkpoint (the runner deletes it) and nothing trusts it later."""
    o = Orchestrator(1, P, "f.bin", persist=True)
    other = Result(200, {"id_slot": 1, "filename": "f.bin", "n_saved": 3049, "n_written": 70_298_524})
    assert run(o, [chat(5, 7835), other]) == ["warm", "save"]
    assert o.outcome is Outcome.WARMED and o.save_mismatch and o.file_bad and o.saved_tokens is None
    assert lines(o)[-1].startswith("SAVED f.bin held n_saved=3049, not the 7840 tokens the warm-up left")
    same = Orchestrator(1, P, "f.bin", persist=True)
    assert run(same, [chat(0, 291), SAVED]) == ["warm", "save"] and same.outcome is Outcome.WARMED_SAVED


def test_no_save_path_is_reported_and_warm_slot_kept():
    o = Orchestrator(1, P, "f.bin", persist=True, file_known=True)
    assert run(o, [NO_SAVE_PATH, chat(0, 291), NO_SAVE_PATH]) == ["restore", "warm", "save"]
    assert o.missing_save_path and o.outcome is Outcome.WARMED


def test_verification_below_gate_erases_and_rebuilds():
    o = Orchestrator(1, P, "f.bin", persist=True, file_known=True)
    kinds = run(o, [RESTORED, chat(10, 281), ERASED, chat(0, 291), SAVED])
    assert kinds == ["restore", "verify", "erase", "warm", "save"]
    assert o.file_bad and o.outcome is Outcome.WARMED_SAVED


def test_divergent_probe_zero_is_loud_but_kept():
    o = Orchestrator(1, P, "f.bin", persist=True, file_known=True)
    assert run(o, [RESTORED, chat(290, 1), chat(0, 296)]) == ["restore", "verify", "verify"]
    assert o.outcome is Outcome.RESTORED_UNVERIFIED and any("divergent probe 0/296" in line for line in lines(o))


@pytest.mark.parametrize("answers", [[TIMEOUT], [RESTORE_400]])
def test_warm_up_failure_fails_open(answers):
    o = Orchestrator(0, P, "f.bin", persist=False)
    assert run(o, answers) == ["warm"] and o.outcome is Outcome.FAILED


def test_memory_mode_warms_without_saving():
    o = Orchestrator(0, P, "f.bin", persist=False, file_known=True)
    assert run(o, [chat(0, 291)]) == ["warm"] and o.outcome is Outcome.WARMED
    assert "cache=MISS → warming slot=0 (cold)" in lines(o)


def test_verification_timeout_keeps_restore():
    o = Orchestrator(1, P, "f.bin", persist=True, file_known=True)
    assert run(o, [RESTORED, TIMEOUT]) == ["restore", "verify"] and o.outcome is Outcome.RESTORED_UNVERIFIED


def test_feeding_a_finished_machine_is_an_error():
    o = Orchestrator(1, P, "f.bin", persist=True, holds_prefix=True)
    with pytest.raises(RuntimeError):
        o.feed(SAVED)


def test_a_cold_prefix_is_built_on_the_shorter_one_it_starts_with():
    """A family's prefix extends the shared one: its file is restored first, so the warm-up prefills only the
    difference (subagents of two families, 2 servers: 925 of 930 tokens prefilled before); a failed restore of
    the base only costs the warm-up it would have paid anyway."""
    o = Orchestrator(1, P, "f.bin", persist=True, base="base.bin")
    kinds = run(o, [RESTORED, chat(774, 156), saved(930)])
    assert kinds == ["restore", "warm", "save"] and o.outcome is Outcome.WARMED_SAVED and o.spent_prefill == 156
    assert any(line.startswith("RESTORE base.bin first") for line in lines(o))
    failed = Orchestrator(1, P, "f.bin", persist=True, base="base.bin")
    assert run(failed, [RESTORE_400, chat(0, 930), saved(930)]) == ["restore", "warm", "save"]
    assert run(Orchestrator(1, P, "f.bin", persist=False, base="base.bin"), [chat(0, 930)]) == ["warm"]


def test_a_cold_prefix_on_a_copy_of_a_conversation_that_starts_with_it_is_warmed_on_the_copy_not_on_a_base():
    """Bench subagents seed 3: a subagent's slot was seeded with its parent's conversation (the family prefix and
    more), then the shared base was restored over that copy and the family's 262 environment tokens prefilled
    again; on the copy the warm-up reuses all of it."""
    o = Orchestrator(1, P, "f.bin", persist=True, base="base.bin", copied=True)
    kinds = run(o, [chat(923, 1), saved(924)])
    assert kinds == ["warm", "save"] and o.outcome is Outcome.WARMED_SAVED and o.spent_prefill == 1


def test_every_phase_with_an_action_has_its_handler_and_every_verdict_a_next_phase():
    """The answer of each phase's action is read by a handler from a table (no method looked up by its name);
    a phase without an action pending raises."""
    from slotlogic.checkpoint_machine import _HANDLERS, TRANSITIONS, Verdict

    acting = {p for p in Phase if p not in (Phase.START, Phase.DONE)}
    assert set(_HANDLERS) == acting
    assert {p for p, _ in TRANSITIONS} == acting
    assert all(isinstance(v, Verdict) for _, v in TRANSITIONS)
