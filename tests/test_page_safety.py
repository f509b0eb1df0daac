"""Session pages that cannot mislead: the checkpoint's identity, a check after every restore, recorded before
they are written, and orphans that count against the budget."""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

from slotkeeper.drivers.page_runner import PageRunner
from slotkeeper.drivers.upstream import Upstream
from slotlogic import events as ev
from slotlogic import paging
from slotlogic import shared as st
from slotlogic.answers import Observation
from slotlogic.decisions import RequestFacts, Ticket
from slotlogic.endpoints import Route
from slotlogic.keeper import Keeper
from slotlogic.ledger import Cause, Holds, Ledger
from slotlogic.paging import PageAsk, PageCheck, PageDone, PageFile, PagePlan, PageRecord
from slotlogic.ranking import SlotView
from slotlogic.reasons import Why
from slotlogic.server import ServerInfo
from slotlogic.session import SessionId
from slotlogic.settings import Settings
from tests.conftest import UP, FakeLlama, chat

PROPS = {"total_slots": 2, "media_marker": "<m>", "build_info": "b1", "model_path": "/m.gguf",
         "default_generation_settings": {"n_ctx": 8192}}


def info(**changes: Any) -> ServerInfo:
    props = {**PROPS, **{k: v for k, v in changes.items() if k in PROPS}}
    if "n_ctx" in changes:
        props["default_generation_settings"] = {"n_ctx": changes["n_ctx"]}
    parsed = ServerInfo.parse(props)
    assert parsed is not None
    return parsed


def test_the_page_identity_is_the_checkpoints_and_more():
    base = info().page_identity("")
    assert base == info().page_identity("")
    others = [info(n_ctx=2048).page_identity(""), info(total_slots=4).page_identity(""),
              info(build_info="b2").page_identity(""), info(model_path="/n.gguf").page_identity(""),
              info().page_identity("after-upgrade"),
              ServerInfo(**{**info().__dict__, "model_size": 10}).page_identity(""),
              ServerInfo(**{**info().__dict__, "model_mtime": 5.0}).page_identity("")]
    assert base not in others and len(set(others)) == len(others)


def test_a_page_from_a_server_with_another_n_ctx_is_not_restored():
    """The probe's case: a restart with n_ctx changed from 8192 to 2048 restored an old page."""
    k = Keeper(Settings(paging=True, save_dir="/x"), UP)
    state = st.ServerState(UP)
    k.facts.note_server(state, info())
    k.pager.index = {"a": PageRecord(paging.page_file(UP, "a"), 900, 1.0, 100, k.page_identity)}
    assert k.pager.page_plan(PageAsk(0, "a", SlotView(0, 0))).restore_for == "a"
    k.facts.note_server(state, info(n_ctx=2048, media_marker="<new>"))
    assert k.pager.page_plan(PageAsk(0, "a", SlotView(0, 0))).restore_file is None


def test_the_checks_after_a_restore():
    assert paging.restore_checked(900, 900) is None
    assert paging.restore_checked(900, 899) is PageCheck.COUNT_MISMATCH
    assert paging.doubtful(900, 880) is None and paging.doubtful(900, None) is None
    assert paging.doubtful(900, 300) is PageCheck.LOW_CACHE


def test_every_page_file_in_the_save_dir_counts_and_the_least_recently_saved_go_first():
    """Ours (by their record's time), orphans and other servers' pages (by mtime) in one order; never a page in
    use (`keep`, `keep_files`), nor one that is not a page file; an unrecorded file older than `keep_seconds` goes
    anyway; `incoming` (a save about to be written) counts."""
    pages = {"a": PageRecord(paging.page_file(UP, "a"), 900, 50.0, 400), "b": PageRecord("page-" + "b" * 20 + ".bin",
                                                                                     900, 30.0, 200)}
    o1, o2, young, ancient = (paging.page_file(UP, n) for n in ("o1", "o2", "young", "ancient"))
    files = {pages["a"].file: PageFile(50.0, 400), o1: PageFile(10.0, 300), o2: PageFile(40.0, 300),
             young: PageFile(990.0, 300), "prefix-0123456789abcdef.bin": PageFile(0.0, 10_000)}

    def room(budget: int, **kw: Any) -> tuple[list[str], list[str]]:
        drop, doomed, fits = paging.disk_room(files, pages, budget, 1000.0, keep_seconds=1e6, **kw)
        assert fits
        return drop, doomed

    # b's file is not there (another process deleted it): its recorded 200 bytes count until it goes
    assert room(1500) == ([], [])
    assert room(1400) == room(1200) == ([], [o1])
    assert room(1100) == room(1000) == (["b"], [o1, pages["b"].file])
    assert room(900) == (["b"], [o1, pages["b"].file, o2])
    assert room(1000, keep=frozenset({"b"})) == ([], [o1, o2])
    assert room(900, keep_files=frozenset({o2})) == (["b", "a"], [o1, pages["b"].file, pages["a"].file])
    assert room(1500, incoming=300) == ([], [o1])
    assert room(10) == (["b", "a"], [o1, pages["b"].file, o2, pages["a"].file, young])
    assert paging.disk_room(files, pages, 300, 1000.0, keep_seconds=1e6, keep=frozenset({"a"}))[2] is False
    with_old = {**files, ancient: PageFile(0.0, 1)}
    assert paging.disk_room(with_old, pages, 1 << 40, 1000.0, keep_seconds=500.0) == ([], [o1, o2, ancient], True)


class Slots:
    """llama-server's slot actions, scripted: saves can be held open, restores can answer another count."""

    def __init__(self, restored: int = 900) -> None:
        self.restored = restored
        self.hold = asyncio.Event()
        self.hold.set()
        self.entered = asyncio.Event()
        self.calls: list[str] = []

    async def post_json(self, path: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, Any]:
        action = path.split("action=")[1]
        self.calls.append(action)
        if action == "save":
            self.entered.set()
            await self.hold.wait()
            return 200, {"n_saved": 900, "n_written": 4096}
        return 200, {"n_restored": self.restored}


async def test_a_restore_that_reads_another_count_is_no_page_in(tmp_path):
    (tmp_path / paging.page_file(UP, "a")).write_bytes(b"x")
    seen: list[ev.Event] = []
    pager = PageRunner(Slots(restored=412), str(tmp_path), 1 << 30, seen.append, UP)  # type: ignore[arg-type]
    out = await pager.run(PagePlan(0, restore_for="a", restore_file=paging.page_file(UP, "a"), restore_tokens=900))
    assert out.restored_tokens is None and out.restore_failed
    assert seen == [ev.PageRejected(UP, 0, PageCheck.COUNT_MISMATCH)]


class PagingLlama(FakeLlama):
    def __init__(self, slots: Slots) -> None:
        super().__init__(total=1)
        self.slot_actions = slots

    async def post_json(self, path: str, body: Any, timeout: float) -> tuple[int, Any]:
        return await self.slot_actions.post_json(path, body, timeout)


def paging_upstream(tmp_path, client, seen=None) -> Upstream:
    save = tmp_path / "slots"
    save.mkdir(exist_ok=True)
    settings = Settings(probe_interval=0, paging=True, save_dir=str(save))
    return Upstream(UP, settings, tmp_path / "state", (seen if seen is not None else []).append, client=client)


def facts(first: str, now: float) -> RequestFacts:
    return RequestFacts("POST", "/v1/chat/completions", (), json.dumps(chat(first)).encode(), now)


def state_of(tmp_path) -> dict:
    return json.loads(next((tmp_path / "state").glob("state-*.json")).read_text())


async def test_a_page_is_recorded_before_its_save_is_sent(tmp_path):
    """A process killed while the save runs leaves a page the state knows (not an orphan, not restorable)."""
    slots = Slots()
    up = paging_upstream(tmp_path, PagingLlama(slots))
    a = await up.decide(facts("A", time.time()), "fa")
    up.unlock("fa")
    up.answered(a.ticket, Observation(cache_n=0, prompt_n=900), path="/v1/chat/completions", seconds=1.0)
    slots.hold.clear()
    b = asyncio.create_task(up.decide(facts("B", time.time() + 200), "fb"))  # one slot: A is paged out
    await asyncio.wait_for(slots.entered.wait(), 5)
    page = state_of(tmp_path)["pages"][a.ticket.session.key]  # as a process started after a kill -9 reads it
    assert paging.FILE_RE.match(page["file"]) and page["n_tokens"] == 0
    slots.hold.set()
    await b
    done = state_of(tmp_path)["pages"][a.ticket.session.key]
    assert (done["file"], done["n_tokens"]) == (page["file"], 900)  # the file the intent named


async def test_a_request_that_reuses_little_of_its_restored_page_drops_the_page(tmp_path):
    seen: list[ev.Event] = []
    up = paging_upstream(tmp_path, PagingLlama(Slots()), seen)
    key = "k" * 16
    name = paging.page_file(UP, key)
    (tmp_path / "slots" / name).write_bytes(b"kv")
    async with up.store.transaction() as state:
        st.claim(state, key, 0, 1.0)
        state.pages[key] = PageRecord(name, 900, 1.0, 2, "")
        up.keeper.pager.load(state.pages)
    ticket = Ticket(SessionId(key, "content:root"), Route.PINNABLE, slot=0, why=Why.RESUMED, paged_in=True)
    up.answered(ticket, Observation(cache_n=12, prompt_n=950), path="/v1/chat/completions", seconds=1.0)
    await up.settle()
    assert key not in state_of(tmp_path)["pages"] and not (tmp_path / "slots" / name).exists()
    assert ev.PageRejected(UP, 0, PageCheck.LOW_CACHE) in seen


async def test_unrecorded_page_files_are_swept_by_size(tmp_path):
    """A lost state file left pages behind: they count against slots_page_max_mb and go, oldest first."""
    up = paging_upstream(tmp_path, PagingLlama(Slots()))
    up.pages.budget.max_bytes = 10_000  # type: ignore[union-attr]
    old = time.time() - 3600
    orphans = [tmp_path / "slots" / paging.page_file(UP, f"lost{i}") for i in range(3)]
    for i, p in enumerate(orphans):
        p.write_bytes(b"x" * 6000)
        os.utime(p, (old + i, old + i))
    a = await up.decide(facts("A", time.time()), "fa")
    up.unlock("fa")
    up.answered(a.ticket, Observation(cache_n=0, prompt_n=900), path="/v1/chat/completions", seconds=1.0)
    await up.decide(facts("B", time.time() + 200), "fb")  # one slot: A is paged out, the sweep runs
    assert [p.exists() for p in orphans] == [False, False, False]  # 18 KB of orphans + A's 4 KB page > 10 KB


async def test_two_saves_of_one_session_never_share_a_file(tmp_path):
    """Two processes may page out the same session at once: each save writes its own file, and a record only
    ever names the file its own save wrote (a shared name let one process record the other's content)."""
    k1, k2 = (Keeper(Settings(paging=True, save_dir="/x"), UP, instance=name) for name in ("p1", "p2"))
    s = st.ServerState(UP)
    plans = [k.pager.page_plan(PageAsk(0, "other", SlotView(0, 900, owner="a"))) for k in (k1, k2)]
    assert plans[0].save_file != plans[1].save_file
    assert k1.pager.page_intent(s, plans[0], 1.0) == []
    assert k2.pager.page_intent(s, plans[1], 2.0) == [plans[0].save_file]  # the older page goes
    doomed = k1.pager.pages_recorded(s, plans[0], PageDone(900, 4096), 3.0, 1 << 30, None)  # k1's save answers last
    assert doomed == [plans[0].save_file] and s.pages["a"].file == plans[1].save_file and s.pages["a"].n_tokens == 0
    k2.pager.pages_recorded(s, plans[1], PageDone(800, 4096), 4.0, 1 << 30, None)
    assert (s.pages["a"].file, s.pages["a"].n_tokens) == (plans[1].save_file, 800)


def test_a_save_is_labelled_with_the_last_paged_send_of_any_proxy():
    """Under a slot lock shared by proxies, the previous pager's send (another proxy's session) is what the
    slot holds when our save reaches it, unless our own send there came later."""
    k = Keeper(Settings(paging=True, save_dir="/x"), UP)
    k.facts.note_server(st.ServerState(UP), info())
    k.table.assign("ours", 0, 10.0, prefix=None)
    k.table.use("ours", 10.0)
    k.table.dispatch("ours", 0)
    k.table.assign("new", 0, 11.0, prefix=None)   # the session being placed there (claimed in the state)
    view = SlotView(0, 900, owner="ours")          # the slot before that claim
    assert k.pager.page_plan(PageAsk(0, "new", view)).save_for == "ours"
    assert k.pager.page_plan(PageAsk(0, "new", view, sent=("theirs", 12.0))).save_for == "theirs"
    assert k.pager.page_plan(PageAsk(0, "new", view, sent=("theirs", 8.0))).save_for == "ours"  # ours went after theirs
    # the slot holds the session
    assert k.pager.page_plan(PageAsk(0, "new", SlotView(0, 900), sent=("new", 12.0))).empty


def test_a_page_being_written_by_another_pager_is_worth_waiting_for():
    k = Keeper(Settings(paging=True, save_dir="/x"), UP)
    s = st.ServerState(UP)
    assert not k.pager.pages_seen(s, "a", 100.0, 10.0)                       # no page at all: nothing to wait for
    paging.intent(s.pages, "a", paging.page_file(UP, "a", "x"), 95.0, "m")
    assert k.pager.pages_seen(s, "a", 100.0, 10.0) and k.pager.index["a"].n_tokens == 0  # recorded, not written yet
    assert not k.pager.pages_seen(s, "a", 120.0, 10.0)                       # its writer gave up long ago
    paging.saved(s.pages, "a", k.pager.index["a"].file, 900, 4096, 101.0, "m")
    assert not k.pager.pages_seen(s, "a", 102.0, 10.0) and k.pager.index["a"].n_tokens == 900


class FileSlots(Slots):
    """Saves write `tokens × per_token` bytes into the save dir (as llama-server's slot files), and each save's
    moment is sampled: the save dir's page bytes right after the file is written, before the proxy sees it."""

    def __init__(self, save_dir, per_token: int, tokens: int = 900) -> None:
        super().__init__(restored=tokens)
        self.save_dir, self.per_token, self.tokens, self.peaks = save_dir, per_token, tokens, []

    def page_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.save_dir.glob("page-*.bin"))

    async def post_json(self, path: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, Any]:
        if path.endswith("action=save"):
            assert body is not None
            (self.save_dir / body["filename"]).write_bytes(b"\0" * (self.tokens * self.per_token))
            self.peaks.append(self.page_bytes())
            return 200, {"n_saved": self.tokens, "n_written": self.tokens * self.per_token}
        return await super().post_json(path, body, timeout)


async def test_the_page_budget_holds_on_disk_at_every_moment(tmp_path):
    """Six sessions taking turns on one slot with a budget of two pages: replaced pages waited 60 s outside the
    budget and the orphan sweep ran once per process (reliability round 4: 7.4 times the budget on disk at the
    peak). Now every page file in the save dir counts, orphans and another server's included, and room is made
    before each save: the save dir never holds more than the budget, sampled at every save and every step."""
    slots = FileSlots(tmp_path / "slots", per_token=100)  # 900 tokens: 90 KB a page
    up = paging_upstream(tmp_path, PagingLlama(slots))
    budget = 200_000
    up.pages.budget.max_bytes = budget  # type: ignore[union-attr]
    slots.save_dir.mkdir(exist_ok=True)
    theirs = slots.save_dir / paging.page_file("http://other:8080", "theirs")  # another server's page, 2 h old
    theirs.write_bytes(b"\0" * 90_000)
    os.utime(theirs, (time.time() - 7200, time.time() - 7200))
    steps: list[int] = []
    now = time.time()
    for turn in range(18):  # three rounds of six sessions, each paging out the one before
        d = await up.decide(facts("ABCDEF"[turn % 6], now + turn * 10), f"f{turn}")
        up.unlock(f"f{turn}")
        kept = d.ticket.restore[1] if d.ticket.restore else 0  # a restore takes: its tokens are found cached
        up.answered(d.ticket, Observation(cache_n=kept, prompt_n=900), path="/v1/chat/completions", seconds=1.0)
        await up.settle()
        steps.append(slots.page_bytes())
    assert len(slots.peaks) >= 14 and max(slots.peaks) <= budget and max(steps) <= budget
    assert not theirs.exists()  # the oldest file went first, whoever wrote it
    pages = state_of(tmp_path)["pages"]
    assert pages and all((slots.save_dir / p["file"]).exists() for p in pages.values() if p["n_tokens"])


def test_a_page_another_slot_is_about_to_restore_is_never_deleted_to_make_room():
    """Two slots page at once on a small budget (a 70B-class model: 2 GB a page): slot 0's plan restores B's page;
    slot 1's plan, saving its holder, made room by deleting that very page between slot 0's start and its
    restore, which then failed and B's turn prefilled all of it (simulator, GPU speeds). A page a plan of this
    process is about to restore now stays until that plan ends."""
    k = Keeper(Settings(paging=True, save_dir="/x"), UP)
    s = st.ServerState(UP)
    b_page = paging.page_file(UP, "b", "x")
    s.pages["b"] = PageRecord(b_page, 900, 10.0, 1000)
    files = {b_page: PageFile(10.0, 1000)}
    restoring = PagePlan(0, restore_for="b", restore_file=b_page, restore_tokens=900)
    saving = k.pager.page_plan(PageAsk(1, "c", SlotView(1, 900, owner="a")))
    assert saving.save_for == "a"

    def room() -> list[str]:
        state = st.ServerState(UP, pages=dict(s.pages))
        return k.pager.page_room(state, saving, 20.0, 1500, files)[0]

    assert room() == [b_page]            # nothing restoring it: the oldest page goes for the incoming save
    reading = k.pager.names.reads(restoring)
    assert room() == []                   # slot 0's plan is under way: B's page stays
    k.pager.names.read_done(reading)
    assert room() == [b_page]


def test_a_conversation_let_go_by_a_cost_decision_is_lost_by_choice_not_by_fault():
    """When prefilling a conversation again measures cheaper than saving and restoring it, the proxy lets it go:
    its next turn finds an older page, or a slot a prefix was restored over, and the meter names the choice
    (`let-go`, expected), not `stale-page` or `prefix-over-owner`."""
    for cost_decision in (False, True):
        ledger = Ledger()
        ledger.total = 2
        first = ledger.pin(0, "a")
        ledger.settle("a", first, 0, 0, 1000, None)          # a's conversation: 1,000 tokens on slot 0
        ledger.pin(0, "b")                                     # b takes slot 0; a's page is older (600 tokens)
        if cost_decision:
            ledger.not_paged("a")
        ledger.write(1, Holds.PAGE, "a", 600)                 # a's page restored into slot 1
        back = ledger.pin(1, "a")
        loss = ledger.settle("a", back, 1, 600, 450, True)
        assert loss is not None and loss.tokens == 400
        assert loss.cause is (Cause.LET_GO if cost_decision else Cause.STALE_PAGE)
        assert loss.cause.expected is cost_decision
