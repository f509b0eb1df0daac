"""`/props` and `/slots` parsed in one place, tolerant of anything."""

from slotlogic.server import ServerInfo, ended_on, parse_slots, running, slot_facts

PROPS = {"total_slots": 4, "media_marker": "<m>", "build_info": "b1", "model_path": "/m.gguf",
         "default_generation_settings": {"n_ctx": 8192, "params": {"temperature": 0.8}}, "chat_template": "x" * 99}


def test_props():
    info = ServerInfo.parse(PROPS)
    assert info is not None and (info.total_slots, info.media_marker, info.n_ctx) == (4, "<m>", 8192)
    assert info.model_id == "/m.gguf|b1"
    assert info.identity == {"build_info": "b1", "model_path": "/m.gguf", "total_slots": 4, "n_ctx": 8192}
    assert "chat_template" not in info.raw and info.raw["total_slots"] == 4  # only the recorded facts


def test_answers_without_a_slot_count_are_no_answer():
    for junk in (None, [], "x", {}, {"total_slots": 0}, {"total_slots": True}, {"total_slots": "4"}):
        assert ServerInfo.parse(junk) is None
    odd = ServerInfo.parse({"total_slots": 2, "media_marker": 5, "default_generation_settings": []})
    assert odd is not None and odd.media_marker is None and odd.n_ctx is None


def test_slots():
    assert parse_slots([{"id": 0}]) == [{"id": 0}]
    assert parse_slots({"error": "501"}) is None and parse_slots([1]) is None and slot_facts(None) is None
    assert slot_facts([{"id": 0, "n_prompt_tokens": 5, "params": {}}]) == [{"id": 0, "n_prompt_tokens": 5}]


def test_a_slot_whose_request_just_ended_reads_idle_whatever_slots_said_a_moment_before():
    """`slotlogic.wait` Rule 10: a placement told that a slot freed (our request there ended) is ranked again with
    that slot idle; `/slots` read a moment later may still show the task the server is about to drop."""
    live = [{"id": 0, "is_processing": True, "n_prompt_tokens": 40}, {"id": 1, "is_processing": True}]
    after = ended_on(live, 0)
    assert not running(after, 0) and running(after, 1) and after[0]["n_prompt_tokens"] == 40
    assert running(live, 0)  # the answer read is left as it was
