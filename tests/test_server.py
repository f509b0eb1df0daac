"""`/props` and `/slots` parsed in one place, tolerant of anything."""

from slotlogic.server import ServerInfo, ended_on, parse_slots, running, slot_facts

PROPS = {"total_slots": 4, "media_marker": "<m>", "build_info": "b1", "model_path": "/m.gguf",
         "default_generation_settings": {"n_ctx": 8192, "params": {"temperature": 0.8}}, "chat_template": "x" * 99}


def test_props():
    info = ServerInfo.parse(PROPS)
    assert info is not None and (info.total_slots, info.media_marker, info.n_ctx) == (4, "<m>", 8192)
    assert (info.model_path, info.build_info) == ("/m.gguf", "b1")
    assert info.identity == {"build_info": "b1", "model_path": "/m.gguf", "total_slots": 4, "n_ctx": 8192,
                             "model_content": info.model_content}
    assert "chat_template" not in info.raw and info.raw["total_slots"] == 4  # only the recorded facts


def test_a_model_replaced_at_the_same_path_gets_no_old_page():
    """The model file on another machine (no size or time here): path, build, n_ctx and slots were all a page
    matched, so a model replaced at the same path got the old KV restored. What `/props` reports of the model's
    content (quantization, chat template, special tokens) is part of a page's identity now."""
    old = ServerInfo.parse({**PROPS, "model_ftype": "Q4_1", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    assert old is not None and old.model_size is None
    same = ServerInfo.parse({**PROPS, "model_ftype": "Q4_1", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                             "media_marker": "<restarted>"})
    assert same is not None and same.page_identity() == old.page_identity() and same.identity == old.identity
    for changed in ({"model_ftype": "Q8_0"}, {"chat_template": "y" * 99}, {"eos_token": "</s>"},
                    {"modalities": {"vision": True}}):
        new = ServerInfo.parse({**PROPS, "model_ftype": "Q4_1", "bos_token": "<|im_start|>",
                                "eos_token": "<|im_end|>", **changed})
        assert new is not None and new.page_identity() != old.page_identity(), changed
        assert new.identity != old.identity, changed
    replayed = ServerInfo.parse(dict(old.raw or {}))  # a decision's recorded facts reach the same identity
    assert replayed is not None and replayed.page_identity() == old.page_identity()


def test_a_server_reporting_nothing_of_its_model_keeps_the_identity_pages_had():
    bare = {k: v for k, v in PROPS.items() if k != "chat_template"}
    info = ServerInfo.parse(bare)
    assert info is not None and info.model_content is None and "model_content" not in info.identity


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
