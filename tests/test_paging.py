"""Session paging decisions (pure): what to save, what to restore, what to delete."""

from slotlogic import paging
from slotlogic import shared as st
from slotlogic.paging import PageRecord
from slotlogic.ranking import SlotView

U, M = "http://127.0.0.1:8080", "/m.gguf|b1"


def rec(key: str, n: int = 900, saved: float = 1.0, size: int = 100, model: str = M) -> PageRecord:
    return PageRecord(paging.page_file(U, key), n, saved, size, model)


def test_page_file_is_private_stable_and_per_server():
    name = paging.page_file(U, "sess-a")
    assert paging.FILE_RE.match(name) and "sess" not in name
    assert name == paging.page_file(U, "sess-a")
    assert name != paging.page_file("http://other:8080", "sess-a") != paging.page_file(U, "sess-b")


def test_the_holder_is_whoever_this_proxy_sent_to_the_slot_last():
    view = SlotView(2, 1300, owner="b")
    assert paging.holder_of(2, view, {}) == ("b", 1300)  # nothing sent since start: the snapshot stands in
    assert paging.holder_of(2, view, {2: "c"}) == ("c", None)  # c went there after the snapshot: size unknown
    assert paging.holder_of(2, view, {2: "b"}) == ("b", None)
    assert paging.holder_of(2, view, {2: ""}) == (None, None)  # a side call: nobody's conversation
    assert paging.holder_of(2, view, {1: "c"}) == ("b", 1300)


def test_another_sessions_conversation_is_saved_before_the_slot_changes_hands():
    p = paging.plan(2, "a", "b", 1300, {}, paging.PageFiles(U, M))
    assert (p.slot, p.save_for, p.save_file, p.restore_file) == (2, "b", paging.page_file(U, "b"), None)
    assert not p.empty
    # size unknown (sent there after the /slots snapshot, or no /slots at all): a save costs milliseconds
    assert paging.plan(2, "a", "b", None, {}, paging.PageFiles(U, M)).save_for == "b"


def test_nothing_worth_saving():
    assert paging.plan(2, "a", "a", 1300, {}, paging.PageFiles(U, M)).empty  # our own conversation
    assert paging.plan(2, "a", None, 1300, {}, paging.PageFiles(U, M)).empty  # nobody's
    assert paging.plan(2, "a", "", None, {}, paging.PageFiles(U, M)).empty  # a side call's
    assert paging.plan(2, "a", "b", 10, {}, paging.PageFiles(U, M)).empty  # too short to matter


def test_a_returning_session_is_paged_in_unless_the_slot_still_holds_it():
    pages = {"a": rec("a", 1200)}
    p = paging.plan(1, "a", "b", 1400, pages, paging.PageFiles(U, M))
    assert (p.save_for, p.restore_for, p.restore_file, p.restore_tokens) == ("b", "a", pages["a"].file, 1200)
    # after a server restart every slot is empty and nothing has been sent since
    assert paging.plan(1, "a", None, 0, pages, paging.PageFiles(U, M)).restore_for == "a"
    # its own request was the last to go there
    assert paging.plan(1, "a", "a", None, pages, paging.PageFiles(U, M)).empty
    # a restarted proxy whose session is still in its slot (the caller saw it in /slots)
    assert paging.plan(1, "a", "a", 1500, pages, paging.PageFiles(U, M), holds_own=True).empty


def test_a_page_from_another_model_or_build_is_never_restored():
    pages = {"a": rec("a", model="/other.gguf|b1")}
    assert paging.plan(1, "a", None, 0, pages, paging.PageFiles(U, M)).restore_file is None


def test_budget_drops_the_least_recently_saved_but_keeps_the_ones_in_use():
    pages = {"old": rec("old", saved=1, size=60), "mid": rec("mid", saved=2, size=60), "new": rec("new", saved=3,
                                                                                                size=60)}
    assert paging.over_budget(pages, 200) == []
    assert paging.over_budget(pages, 100) == ["old", "mid"]
    assert paging.over_budget(pages, 100, keep=frozenset({"old"})) == ["mid", "new"]


def test_pages_survive_the_state_file_and_go_with_forgotten_sessions():
    s = st.ServerState(U, total_slots=4)
    st.claim(s, "a", 0, 100.0)
    st.claim(s, "b", 1, 10.0)
    paging.saved(s.pages, "a", paging.page_file(U, "a"), 900, 1000, 100.0, M)
    paging.saved(s.pages, "b", paging.page_file(U, "b"), 800, 1000, 10.0, M)
    back = st.from_dict(st.to_dict(s), U)
    assert back == s
    assert st.prune(back, 120.0, 50.0) == [paging.page_file(U, "b")]
    assert set(back.pages) == {"a"}


def test_damaged_page_entries_are_dropped():
    junk = {"pages": {"a": {"file": "../../etc/passwd", "n_tokens": 5, "saved": 1.0},
                      "b": {"file": paging.page_file(U, "b"), "n_tokens": "x", "saved": 1.0},
                      "c": "no", "d": {"file": paging.page_file(U, "d"), "n_tokens": 70, "saved": 2.0}}}
    assert set(st.from_dict(junk, U).pages) == {"d"}


def test_the_page_budget_with_none_set_holds_two_full_contexts_a_slot_within_half_the_free_space():
    """8 GB held four 6K-token pages of a 70B-class model (320 KiB a token): pages went before they were read."""
    floor = paging.AUTO_FLOOR
    assert floor == 8192 << 20
    assert paging.auto_budget(4, 32768, 320 * 1024, 4 << 40) == 2 * 4 * 32768 * 320 * 1024     # ~80 GB
    assert paging.auto_budget(4, 32768, 320 * 1024, 100 << 30) == 50 << 30                    # half the free space
    assert paging.auto_budget(4, 8192, 23 * 1024, 4 << 40) == floor                             # SmolLM2: the floor
    assert paging.auto_budget(4, 32768, 320 * 1024, 1 << 30) == floor       # a small disk: never below the floor
    assert paging.auto_budget(None, 32768, 320 * 1024, None) == floor       # sizes not known yet
    assert paging.auto_budget(4, None, 320 * 1024, None) == floor
    assert paging.auto_budget(4, 32768, None, None) == floor
