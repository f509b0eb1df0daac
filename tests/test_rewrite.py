"""The body rewrite: only `id_slot` and `cache_prompt` may change, and only as documented."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as s

from slotlogic.rewrite import pin, valid_client_slot

json_values = s.recursive(
    s.none() | s.booleans() | s.integers() | s.floats(allow_nan=False, allow_infinity=False) | s.text(),
    lambda children: s.lists(children, max_size=4) | s.dictionaries(s.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@given(body=s.dictionaries(s.text(max_size=12), json_values, max_size=8), slot=s.integers(0, 7),
       override=s.booleans())
def test_any_json_object_stays_valid_and_identical_but_for_two_fields(body, slot, override):
    out = pin(body, slot, 8, override_client=override)
    reparsed = json.loads(json.dumps(out.body))
    assert isinstance(reparsed["id_slot"], int) and 0 <= reparsed["id_slot"] < 8
    assert {k: v for k, v in out.body.items() if k not in ("id_slot", "cache_prompt")} == \
        {k: v for k, v in body.items() if k not in ("id_slot", "cache_prompt")}
    if body.get("cache_prompt") is not None:
        assert out.body["cache_prompt"] == body["cache_prompt"]
    else:
        assert out.body["cache_prompt"] is True
    assert pin(out.body, slot, 8, override_client=override).body == out.body  # idempotent


def test_adds_both_fields():
    out = pin({"prompt": "x"}, 2, 4)
    assert out.body == {"prompt": "x", "id_slot": 2, "cache_prompt": True}
    assert out.changed and out.slot == 2 and not out.client_slot_kept


def test_keeps_explicit_cache_prompt_false():
    assert pin({"cache_prompt": False}, 1, 4).body["cache_prompt"] is False


def test_null_cache_prompt_counts_as_absent():
    assert pin({"cache_prompt": None}, 1, 4).body["cache_prompt"] is True


def test_respects_valid_client_slot_unless_overridden():
    assert pin({"id_slot": 3}, 1, 4).slot == 3
    assert pin({"id_slot": 3}, 1, 4).client_slot_kept
    assert pin({"id_slot": 3}, 1, 4, override_client=True).slot == 1


@pytest.mark.parametrize("bad", ["3", 3.0, -1, -2, 7, True, None, [1]])
def test_replaces_unusable_client_slots(bad):
    assert valid_client_slot({"id_slot": bad}, 4) is None
    out = pin({"id_slot": bad}, 1, 4)
    assert out.body["id_slot"] == 1 and type(out.body["id_slot"]) is int


def test_unchanged_when_already_pinned():
    body = {"id_slot": 1, "cache_prompt": True}
    assert not pin(body, 1, 4).changed


def test_refuses_out_of_range_target():
    with pytest.raises(ValueError):
        pin({}, 4, 4)


def test_splice_appends_and_unsplice_restores():
    from slotlogic.rewrite import splice, unsplice

    raw = b'{"messages": [], "x": "}"} \n'
    body = json.loads(raw)
    out = splice(raw, body, pin(body, 2, 4))
    assert json.loads(out) == {**body, "id_slot": 2, "cache_prompt": True}
    assert unsplice(out) == b'{"messages": [], "x": "}"}'
    assert splice(b"{}", {}, pin({}, 1, 4)) == b'{"id_slot":1,"cache_prompt":true}'
    assert unsplice(b'{"id_slot":1,"cache_prompt":true}') == b"{}"
    assert splice(b'{"id_slot": 9}', {"id_slot": 9}, pin({"id_slot": 9}, 1, 4)) is None  # dumps instead
    assert unsplice(b'{"a": 1}') is None


@pytest.mark.parametrize(("raw", "expected"), [
    (b'{"id_slot": 3, "messages": []}', {"id_slot": 1, "messages": [], "cache_prompt": True}),
    (b'{"cache_prompt": false}', {"cache_prompt": False, "id_slot": 1}),
    (b'{"id\\u005fslot": 3, "x": 1e400}', {"id_slot": 1, "x": float("inf"), "cache_prompt": True}),
    (b'{"id_slot": 3, "id_slot": "x", "cache_prompt": null}', {"id_slot": 1, "cache_prompt": True}),
])
def test_set_fields_edits_the_clients_bytes_in_place(raw, expected):
    from slotlogic.rewrite import set_fields

    body = json.loads(raw)
    out = set_fields(raw, pin(body, 1, 4, override_client=True))
    assert json.loads(out) == expected
    def keys(data: bytes) -> list[str]:
        return json.loads(data, object_pairs_hook=lambda pairs: [k for k, _ in pairs])

    added = [k for k in ("id_slot", "cache_prompt") if k not in body]
    assert keys(out) == keys(raw) + added  # repeated keys all edited, none added twice
    if b"1e400" in raw:
        assert b"1e400" in out and b"Infinity" not in out  # never re-serialised


def test_set_fields_keeps_a_lone_surrogate_as_the_client_sent_it():
    from slotlogic.rewrite import set_fields

    raw = b'{"messages": [{"role": "user", "content": "TOP SECRET \\ud800"}], "id_slot": 2}'
    out = set_fields(raw, pin(json.loads(raw), 1, 4, override_client=True))
    assert out == raw.replace(b'"id_slot": 2', b'"id_slot": 1')[:-1] + b',"cache_prompt":true}'
    assert set_fields(b"[1]", pin({}, 1, 4)) is None and set_fields(b'{"a":1} x', pin({}, 1, 4)) is None


json_values = s.recursive(s.none() | s.booleans() | s.integers() | s.text(max_size=8),
                           lambda inner: s.lists(inner, max_size=3) | s.dictionaries(s.text(max_size=4), inner,
                                                                                       max_size=3), max_leaves=8)


@given(s.dictionaries(s.text(max_size=6), json_values, max_size=5), s.sampled_from(["", " ", "\n  "]))
def test_the_one_scanner_finds_every_member_with_its_exact_span(obj, pad):
    """`json_scan.members` (the splice's and the hot path's scanner) agrees with json.loads on any object."""
    from slotlogic import json_scan

    text = pad + json.dumps(obj, indent=1 if pad else None) + pad
    found, close = json_scan.members(text)
    assert [(name, json.loads(text[a:b])) for name, a, b in found] == list(obj.items())
    assert text[close] == "}" and not text[close + 1:].strip()
    for bad in ("[]", text + "{}", text.rstrip()[:-1]):
        with pytest.raises(json_scan.ERRORS):
            json_scan.members(bad)
