"""Seeds: a new session starts from the live or paged conversation it shares the most leading messages with."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slotlogic import lead, paging, shared
from slotlogic.answers import Observation
from slotlogic.decisions import NeedSlot, RequestFacts
from slotlogic.keeper import Keeper
from slotlogic.paging import PageAsk, PageDone, PageRecord, Seed
from slotlogic.ranking import SlotView
from slotlogic.server import ServerInfo
from slotlogic.settings import Settings

U = "http://up"
SYS = "You are a coding agent. " * 40                       # ~960 characters, as long as a short system prompt
ENV = "<environment_context><cwd>/home/u/project</cwd><shell>bash</shell></environment_context>\n" * 20
LIVE = [{"id": i, "n_prompt_tokens": 0, "is_processing": False} for i in range(4)]


def codex(prompt: str, ids: str) -> dict:
    """A Responses body as Codex sends it: developer items, an environment block, the user's words; every
    item carries a per-session id that the template never renders."""
    def item(n: int, role: str, text: str) -> dict:
        return {"type": "message", "id": f"{ids}-{n}", "role": role,
                "content": [{"type": "input_text", "text": text}]}
    return {"model": "m", "input": [item(0, "developer", SYS), item(1, "developer", "Approvals: never.\n" * 30),
                                    item(2, "user", ENV), item(3, "user", prompt)]}


def test_items_that_differ_only_in_their_ids_are_shared():
    a, b = lead.of(codex("fix the parser", "s1")), lead.of(codex("write the docs", "s2"))
    n, chars = lead.shared(a, b)
    assert n == 3 and chars == len(SYS) + len("Approvals: never.\n" * 30) + len(ENV)
    assert lead.shared(a, a) == (4, a.chars[-1])


def test_tools_are_part_of_every_digest():
    body = codex("x", "s1")
    assert lead.shared(lead.of(body), lead.of({**body, "tools": [{"type": "function", "name": "t"}]})) == (0, 0)


def test_a_lead_holds_no_text_and_is_bounded():
    secret = "my-secret-token-" * 10
    got = lead.of({"messages": [{"role": "user", "content": secret}] * (lead.MAX_ITEMS + 10)})
    assert got is not None and len(got.digests) == lead.MAX_ITEMS
    assert "secret" not in repr(got)
    assert lead.of({"messages": "text"}) is None and lead.of({"prompt": "x"}) is None
    assert lead.shared(None, got) == (0, 0)


messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                           "content": st.text(max_size=30)}), min_size=1, max_size=8)


@given(messages, messages, messages)
def test_shared_is_the_common_run_of_messages(common, a, b):
    la, lb = lead.of({"messages": common + a}), lead.of({"messages": common + b})
    n, chars = lead.shared(la, lb)
    assert n >= len(common) and lead.shared(lb, la) == (n, chars)
    assert (common + a)[:n] == (common + b)[:n]
    assert chars == sum(len(m["content"]) for m in (common + a)[:n])


def page(key: str, n: int = 900, model: str = "/m.gguf|b0") -> PageRecord:
    return PageRecord(paging.page_file(U, key), n, 1.0, 100, model)


def test_choose_seed_wants_a_share_worth_a_save_and_a_restore():
    a, b = lead.of(codex("one", "s1")), lead.of(codex("two", "s2"))
    shared_chars = lead.shared(a, b)[1]
    assert paging.choose_seed(b, [("a", a, 0)], {}, "m", beat=0) == Seed("a", shared_chars, 0)
    # the slot gives it almost as much anyway (a checkpointed prefix, the conversation left there)
    assert paging.choose_seed(b, [("a", a, 0)], {}, "m", beat=shared_chars - 10) is None
    assert paging.choose_seed(b, [("a", a, None)], {}, "m", beat=0) is None          # busy, and no page
    other = lead.of({"messages": [{"role": "system", "content": SYS + "!"}]})
    assert paging.choose_seed(other, [("a", a, 0)], {}, "m", beat=0) is None         # nothing shared


def test_a_page_is_preferred_and_must_fit_the_running_server():
    a, b = lead.of(codex("one", "s1")), lead.of(codex("two", "s2"))
    model = "/m.gguf|b0"
    assert paging.choose_seed(b, [("a", a, 0)], {"a": page("a")}, model, beat=0).slot is None  # no save needed
    assert paging.choose_seed(b, [("a", a, 0)], {"a": page("a", model="/other|b9")}, model, beat=0).slot == 0
    assert paging.choose_seed(b, [("a", a, None)], {"a": page("a", n=10)}, model, beat=0) is None  # too small


def info() -> ServerInfo:
    return ServerInfo(total_slots=4, model_path="/m.gguf", build_info="b0", raw={"total_slots": 4})


def need(k: Keeper, body: dict, key: str, now: float) -> NeedSlot:
    path = "/v1/responses" if "input" in body else "/v1/chat/completions"
    d = k.request(RequestFacts("POST", path, ((b"session-id", key.encode()),), json.dumps(body).encode(), now))
    assert isinstance(d, NeedSlot)
    return d


def placed(k: Keeper, state: shared.ServerState, body: dict, key: str, now: float, live=LIVE,
           pin: bool = True, answer: bool = True) -> int:
    """A new session through the core as the driver takes it: request, assign (the paging step comes here,
    before the pin), pin (its request goes out), its answer (`answer=False`: still running); its slot."""
    d = need(k, body, key, now)
    p = k.assign(d, state, info(), live, now)
    if pin:
        pinned = k.pin(p, now)
        if answer:
            k.outcomes.answered(pinned.ticket, Observation(cache_n=0, prompt_n=900), path="/v1/chat/completions",
                                seconds=1.0, now=now + 0.5)
    return p.slot


def keeper_with_one_session() -> tuple[Keeper, shared.ServerState, int]:
    k, state = Keeper(Settings(), U), shared.ServerState(U)
    k.facts.note_server(state, info())
    return k, state, placed(k, state, codex("fix the parser", "s1"), "s1", 0.0)


def test_a_new_session_on_an_empty_slot_is_seeded_from_the_idle_one():
    k, state, first = keeper_with_one_session()
    slot = placed(k, state, codex("write the docs", "s2"), "s2", 1.0, pin=False)
    new_key = k.table.holders[slot]
    plan = k.pager.page_plan(PageAsk(slot, new_key, SlotView(slot, 0), views=[SlotView(i) for i in range(4)]))
    assert plan.seed is not None and plan.seed.slot == first
    assert plan.restore_file == plan.seed_file and plan.seed_file.startswith("page-")
    assert [k for k, _ in plan.saves] == [plan.seed.source] and plan.save_for is None
    # the source's slot busy: no live seed; a checkpoint that covers as much: not worth one either
    busy = [SlotView(i, busy=i == first) for i in range(4)]
    assert k.pager.page_plan(PageAsk(slot, new_key, SlotView(slot, 0), views=busy)).seed is None
    assert k.pager.page_plan(PageAsk(slot, new_key, SlotView(slot, 0), views=[SlotView(i) for i in range(4)],
                       stable_chars=plan.seed.chars)).seed is None


def test_no_seed_when_the_slot_keeps_a_conversation_that_shares_as_much():
    k, state, first = keeper_with_one_session()
    placed(k, state, codex("review the tests", "s3"), "s3", 1.0)  # a third session, idle on its own slot
    placed(k, state, codex("write the docs", "s2"), "s2", 2.0, pin=False)
    new_key = next(key for key, a in k.table.sessions.items() if a.last_used == 2.0)
    holder = k.table.dispatched[first]
    views = [SlotView(i) for i in range(4)]
    plan = k.pager.page_plan(PageAsk(first, new_key, SlotView(first, 4000, owner=holder), views=views))
    assert plan.seed is None and plan.restore_file is None and plan.save_for == holder  # saved, then reused
    # the same slot emptied meanwhile: the third session's conversation is worth copying in
    assert k.pager.page_plan(PageAsk(first, new_key, SlotView(first, 0, owner=holder), views=views)).seed is not None


def test_a_seed_save_is_recorded_as_the_sources_page():
    k, state, _ = keeper_with_one_session()
    slot = placed(k, state, codex("write the docs", "s2"), "s2", 1.0, pin=False)
    plan = k.pager.page_plan(PageAsk(slot, k.table.holders[slot], SlotView(slot, 0),
            views=[SlotView(i) for i in range(4)]))
    assert plan.seed is not None
    assert k.pager.page_intent(state, plan, 2.0) == []
    assert state.pages[plan.seed.source].n_tokens == 0                 # recorded before the save, not restorable
    k.pager.pages_recorded(state, plan, PageDone(None, seed_saved=(4000, 10**6)), 3.0, 10**9, None)
    assert state.pages[plan.seed.source] == PageRecord(plan.seed_file, 4000, 3.0, 10**6, k.page_identity)
    failed = k.pager.page_plan(PageAsk(slot, k.table.holders[slot], SlotView(slot, 0),
            views=[SlotView(i) for i in range(4)]))
    assert failed.seed is not None and failed.seed.slot is None         # now its page is the seed: no save


def pi_like(prompt: str, folder: str = "/home/u/project") -> dict:
    """A chat body whose system prompt has a marker (its stable prefix), then a per-folder block."""
    return {"messages": [{"role": "system", "content": SYS + "\n<cwd>" + folder},
                         {"role": "user", "content": ENV}, {"role": "user", "content": prompt}]}


def test_a_conversation_left_in_the_slot_that_starts_with_our_prefix_is_not_warmed_over():
    k, state = Keeper(Settings(), U), shared.ServerState(U)
    k.facts.note_server(state, info())
    first = placed(k, state, pi_like("one"), "s1", 0.0)
    s1 = k.table.dispatched[first]
    d = need(k, pi_like("two"), "s2", 1.0)
    k.assign(d, state, info(), LIVE, 1.0)
    assert d.stable is not None
    # the slot's recorded prefix says nothing (another process's claim, a prefix learned since): the
    # conversation left there still starts with ours, and more
    assert k.pager.holds_prefix(d, SlotView(first, 4000, owner=s1, prefix="other"))
    assert not k.pager.holds_prefix(d, SlotView(first, 0, owner=s1, prefix="other"))       # emptied meanwhile
    d3 = need(k, pi_like("three", folder="/elsewhere"), "s3", 2.0)
    k.assign(d3, state, info(), LIVE, 2.0)
    assert not k.pager.holds_prefix(d3, SlotView(first, 4000, owner=s1, prefix="other"))   # its first message differs


def generic(prompt: str, folder: str) -> dict:
    """A system prompt with no marker: a shared part, then a per-session environment line."""
    return {"messages": [{"role": "system", "content": SYS + "\nWorking in " + folder + "\n"},
                         {"role": "user", "content": prompt}]}


def test_a_cold_prefix_is_copied_from_a_live_session_that_starts_with_it():
    k, state = Keeper(Settings(), U), shared.ServerState(U)
    k.facts.note_server(state, info())
    first = placed(k, state, generic("one", "/a"), "s1", 0.0)
    d = need(k, generic("two", "/b"), "s2", 1.0)       # the second session teaches the shared part
    p = k.assign(d, state, info(), LIVE, 1.0)
    assert d.stable is not None and d.stable.text == SYS.rstrip()
    views = [SlotView(i) for i in range(4)]
    plan = k.pager.page_plan(PageAsk(p.slot, d.ticket.session.key, SlotView(p.slot, 0), views=views, cold=d.stable))
    assert plan.seed is not None and plan.seed.prefix and plan.seed.slot == first
    assert plan.restore_file == plan.seed_file
    # no cold build coming (its checkpoint file exists): nothing to copy for the prefix alone
    assert k.pager.page_plan(PageAsk(p.slot, d.ticket.session.key, SlotView(p.slot, 0), views=views)).seed is None
    busy = [SlotView(i, busy=i == first) for i in range(4)]
    assert k.pager.page_plan(PageAsk(p.slot, d.ticket.session.key, SlotView(p.slot, 0),
            views=busy, cold=d.stable)).seed is None


def test_a_cold_prefix_is_restored_from_the_page_of_a_session_that_starts_with_it():
    """A subagent's parent was paged out (its slot went to a sibling): the parent's page holds the family
    prefix, so it is restored as it is (no save, no wait for a busy slot) rather than warmed up on a base."""
    k, state = Keeper(Settings(), U), shared.ServerState(U)
    k.facts.note_server(state, info())
    first = placed(k, state, generic("one", "/a"), "s1", 0.0)
    s1 = k.table.dispatched[first]
    d = need(k, generic("two", "/b"), "s2", 1.0)
    p = k.assign(d, state, info(), LIVE, 1.0)
    assert d.stable is not None
    k.pager.index[s1] = page(s1, model=k.page_identity)
    busy = [SlotView(i, busy=i == first) for i in range(4)]
    ask = PageAsk(p.slot, d.ticket.session.key, SlotView(p.slot, 0), views=busy, cold=d.stable)
    plan = k.pager.page_plan(ask)
    assert plan.seed == Seed(s1, len(d.stable.text), None, prefix=True)
    assert plan.restore_file == k.pager.index[s1].file and plan.seed_file is None and plan.saves == []
    assert k.pager.busy_source(ask) is None                        # nothing to wait for: the page is there
    k.pager.index[s1] = page(s1, model="/other|b9")                # saved by another server: not a seed
    assert k.pager.page_plan(ask).seed is None


def test_two_sessions_that_start_together_wait_for_the_first_to_copy_it():
    """The second session's source is still running its first request: waiting for it is worth at most what
    prefilling the copied part takes; nothing is waited for once the copy is there or a checkpoint covers it."""
    k, state = Keeper(Settings(), U), shared.ServerState(U)
    k.facts.note_server(state, info())
    first = placed(k, state, generic("one", "/a"), "s1", 0.0)
    d = need(k, generic("two", "/b"), "s2", 1.0)
    p = k.assign(d, state, info(), LIVE, 1.0)
    key, view = d.ticket.session.key, SlotView(p.slot, 0)
    busy = [SlotView(i, busy=i == first) for i in range(4)]
    found = k.pager.busy_source(PageAsk(p.slot, key, view, views=busy, cold=d.stable))
    assert found is not None and (found.slot, found.budget) == (first, Settings().seed_wait)  # no rate measured
    k.outcomes.prefill_rate = 100.0                                                 # tokens/s
    again = k.pager.busy_source(PageAsk(p.slot, key, view, views=busy, cold=d.stable))
    assert again is not None and (again.slot, again.budget) == (
        first, pytest.approx(len(d.stable.text) / paging.CHARS_PER_TOKEN / 100.0))
    idle = [SlotView(i) for i in range(4)]
    assert k.pager.busy_source(PageAsk(p.slot, key, view, views=idle, cold=d.stable)) is None    # copy it now, no wait
    # its checkpoint exists: restore that
    assert k.pager.busy_source(PageAsk(p.slot, key, view, views=busy)) is None
    k.reconfigure(Settings(seed_wait=0.0))
    assert k.pager.busy_source(PageAsk(p.slot, key, view, views=busy, cold=d.stable)) is None    # waiting turned off


def test_a_lead_seed_waits_only_when_it_gives_more_than_the_idle_choice():
    k, state, first = keeper_with_one_session()
    slot = placed(k, state, codex("write the docs", "s2"), "s2", 1.0, pin=False)
    key, view = k.table.holders[slot], SlotView(slot, 0)
    busy = [SlotView(i, busy=i == first) for i in range(4)]
    found = k.pager.busy_source(PageAsk(slot, key, view, views=busy))
    assert found is not None and (found.slot, found.budget) == (first, Settings().seed_wait)
    chars = lead.shared(k.table.sessions[key].lead, k.table.sessions[k.table.holders[first]].lead)[1]
    # its checkpoint gives as much
    assert k.pager.busy_source(PageAsk(slot, key, view, views=busy, stable_chars=chars)) is None


def test_source_wait_never_exceeds_the_prefill_it_saves_nor_the_cap():
    assert paging.source_wait(4000, 1000.0, 30.0) == 1.0
    assert paging.source_wait(4000, 10.0, 30.0) == 30.0
    assert paging.source_wait(4000, None, 30.0) == 30.0
    assert paging.source_wait(4000, 1000.0, 0.0) == 0.0 and paging.source_wait(0, 1000.0, 30.0) == 0.0


@pytest.mark.parametrize("sent", [False, True])
def test_a_session_whose_request_has_not_gone_out_or_still_runs_is_no_idle_source(sent):
    """`/slots` may call such a slot idle (the request is on its way): a copy of it would be empty, or cut
    short. One still running is waited for, and so is one placed before whose request has not gone out yet: it
    is on its way to compute what would be copied (two siblings placed together: the later waits)."""
    k, state = Keeper(Settings(), U), shared.ServerState(U)
    k.facts.note_server(state, info())
    first = placed(k, state, generic("one", "/a"), "s1", 0.0, pin=sent, answer=False)
    d = need(k, generic("two", "/b"), "s2", 1.0)
    p = k.assign(d, state, info(), LIVE, 1.0)
    key, view, idle = d.ticket.session.key, SlotView(p.slot, 0), [SlotView(i) for i in range(4)]
    assert k.pager.page_plan(PageAsk(p.slot, key, view, views=idle, cold=d.stable)).seed is None
    found = k.pager.busy_source(PageAsk(p.slot, key, view, views=idle, cold=d.stable))
    assert found is not None and (found.slot, found.budget) == (first, Settings().seed_wait)


def test_the_awaited_slot_is_idle_only_once_slots_says_so_and_its_answer_came():
    k, state = Keeper(Settings(), U), shared.ServerState(U)
    k.facts.note_server(state, info())
    d = need(k, generic("one", "/a"), "s1", 0.0)
    p = k.assign(d, state, info(), LIVE, 0.0)
    pinned = k.pin(p, 0.0)
    busy = [{**e, "is_processing": e["id"] == p.slot} for e in LIVE]
    assert not k.pager.seeds.source_idle(p.slot, LIVE)            # /slots idle, but its answer has not come yet
    k.outcomes.answered(pinned.ticket, Observation(cache_n=0, prompt_n=900), path="/v1/chat/completions", seconds=1.0,
                        now=1.0)
    seeds = k.pager.seeds
    assert seeds.source_idle(p.slot, LIVE) and not seeds.source_idle(p.slot, busy) and not seeds.source_idle(p.slot, [])


def test_a_source_still_prefilling_what_would_be_copied_is_waited_for_past_the_budget():
    """Two subagents of a new family start together: the second's budget (the copied part at the measured rate)
    runs out while the first still prefills on a shared server; prefilling the same tokens beside it would take
    at least as long, so it waits on while the source has at most twice those tokens left, never past the cap."""
    wait = paging.SourceWait(slot=0, budget=1.0, tokens=1000, cap=30.0)
    prefilling = {"id": 0, "is_processing": True, "n_prompt_tokens": 1500, "n_prompt_tokens_processed": 400,
                  "next_token": [{"n_decoded": 0}]}
    assert paging.keep_waiting(wait, None, 0.5, 0.5)                      # within the budget
    assert paging.keep_waiting(wait, prefilling, 5.0, -1.0)               # 1,100 left <= 2 x 1,000
    assert not paging.keep_waiting(wait, {**prefilling, "n_prompt_tokens": 4000}, 5.0, -1.0)  # too far behind
    assert not paging.keep_waiting(wait, {**prefilling, "next_token": [{"n_decoded": 3}]}, 5.0, -1.0)  # generating
    # generating with the decode speed measured: its prompt is all there; wait while what it has left to
    # generate costs no more than prefilling the copied part beside it (n_remain x prefill/decode speed)
    measured = paging.SourceWait(slot=0, budget=1.0, tokens=1000, cap=30.0, decode_cost=8.0)
    ending = {**prefilling, "next_token": [{"n_decoded": 3, "n_remain": 1}]}
    assert paging.keep_waiting(measured, ending, 5.0, -1.0)
    assert not paging.keep_waiting(measured, {**ending, "next_token": [{"n_decoded": 3, "n_remain": 400}]}, 5.0, -1.0)
    assert not paging.keep_waiting(measured, {**ending, "next_token": [{"n_decoded": 3, "n_remain": -1}]}, 5.0, -1.0)
    assert not paging.keep_waiting(wait, ending, 5.0, -1.0)              # decode speed unknown: as before
    assert not paging.keep_waiting(measured, ending, 30.0, -1.0)         # the cap
    # idle, but its answer has not come, or its request is on its way: on up to twice the budget
    assert paging.keep_waiting(wait, {**prefilling, "is_processing": False}, 1.5, -0.5)
    assert not paging.keep_waiting(wait, {**prefilling, "is_processing": False}, 2.0, -1.0)
    assert not paging.keep_waiting(wait, prefilling, 30.0, -1.0)          # the cap


def test_of_two_sessions_placed_together_only_the_later_waits_for_the_earlier():
    """Two siblings of a new prompt are placed back to back; the first one's request will compute the prompt,
    so the second waits for it; the first never waits for the second (each waiting for the other would hold
    both until their budgets ran out)."""
    k, state = Keeper(Settings(), U), shared.ServerState(U)
    k.facts.note_server(state, info())
    d1 = need(k, generic("one", "/a"), "s1", 0.0)
    d2 = need(k, generic("two", "/b"), "s2", 0.0)          # the second teaches the shared part
    p1 = k.assign(d1, state, info(), LIVE, 0.0)
    p2 = k.assign(d2, state, info(), LIVE, 0.0)
    idle = [SlotView(i) for i in range(4)]
    later = k.pager.busy_source(PageAsk(p2.slot, d2.ticket.session.key, SlotView(p2.slot, 0), views=idle,
                                        cold=d2.stable))
    assert later is not None and later.slot == p1.slot
    earlier = k.pager.busy_source(PageAsk(p1.slot, d1.ticket.session.key, SlotView(p1.slot, 0), views=idle,
                                          cold=d2.stable))
    assert earlier is None


def family(rules: str, folder: str, times: int = 30) -> dict:
    """A subagent's system prompt: the shared role, its family's rules, then a per-session line."""
    system = SYS + "\n" + f"{rules}\n" * times + "Working in " + folder + "\n"
    return {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "go"}]}


def test_a_cold_family_prefix_waits_for_a_session_prefilling_the_part_it_shares():
    """Subagents of two families start together: family B's prompt is cold, and a family-A subagent is prefilling
    the base role both share. B waits for it and copies that part (its warm-up prefills only the rest), unless a
    checkpoint already gives the base (then the wait would spare nothing)."""
    k, state = Keeper(Settings(), U), shared.ServerState(U)
    k.facts.note_server(state, info())
    a1 = placed(k, state, family("Family A rules.", "/a1"), "a1", 0.0, answer=False)   # running its request
    need(k, family("Family B rules.", "/b1"), "b1", 0.5)                                # seen, not placed yet
    d = need(k, family("Family B rules.", "/b2"), "b2", 0.5)
    assert d.stable is not None and d.stable.text.startswith(SYS + "\nFamily B")       # learned from b1 and b2
    p = k.assign(d, state, info(), LIVE, 0.5)
    key, view, busy = d.ticket.session.key, SlotView(p.slot, 0), [SlotView(i, busy=i == a1) for i in range(4)]
    found = k.pager.busy_source(PageAsk(p.slot, key, view, views=busy, cold=d.stable))
    assert found is not None and found.slot == a1
    assert found.tokens == len(SYS.rstrip()) // paging.CHARS_PER_TOKEN                 # the base part, not all of it
    base = len(SYS.rstrip())                                                           # a checkpoint gives the base
    assert k.pager.busy_source(PageAsk(p.slot, key, view, views=busy, cold=d.stable, base_chars=base)) is None
    k, state = Keeper(Settings(), U), shared.ServerState(U)                           # once a1 has answered
    k.facts.note_server(state, info())
    a1 = placed(k, state, family("Family A rules.", "/a1"), "a1", 0.0)
    need(k, family("Family B rules.", "/b1"), "b1", 0.5)
    d = need(k, family("Family B rules.", "/b2"), "b2", 0.5)
    p = k.assign(d, state, info(), LIVE, 0.5)
    idle = [SlotView(i) for i in range(4)]
    plan = k.pager.page_plan(PageAsk(p.slot, d.ticket.session.key, SlotView(p.slot, 0), views=idle, cold=d.stable))
    assert plan.seed is not None and plan.seed.prefix and plan.seed.slot == a1 and plan.seed.chars == len(SYS.rstrip())


def test_a_sibling_placed_after_the_one_that_taught_its_family_prefix_takes_that_prefix():
    """Two subagents of one family arrive together: the first knows only the base prompt (its family is new),
    the second teaches the family's. Placed in the other order, the first takes the family prefix at its
    placement, so it waits for its sibling's one build of it instead of prefilling the family part beside it."""
    k, state = Keeper(Settings(), U), shared.ServerState(U)
    k.facts.note_server(state, info())
    placed(k, state, family("Family A rules.", "/a1"), "a1", 0.0)
    placed(k, state, family("Family B rules.", "/b1"), "b1", 0.1)                    # the base is learned
    c1 = need(k, family("Family C rules.", "/c1"), "c1", 0.2)
    c2 = need(k, family("Family C rules.", "/c2"), "c2", 0.2)
    assert c1.stable is not None and c2.stable is not None and len(c1.stable.text) < len(c2.stable.text)
    k.assign(c2, state, info(), LIVE, 0.2)
    p1 = k.assign(c1, state, info(), LIVE, 0.2)
    assert p1.need is not None and p1.need.stable == c2.stable and p1.need.prefix == c2.stable.signature


def test_a_slot_whose_holder_shares_the_cold_family_prefix_keeps_it_rather_than_take_a_shorter_seed():
    """Two subagents of family B ran together; the second to be placed goes to its sibling's slot once that
    sibling has answered. The sibling's conversation stays in the slot after its page-out and holds the whole
    family prefix: no seed that shares only the base prompt (family A's page) is restored over it (bench
    subagents seed 7: a page sharing 860 tokens restored over a sibling's 1,072, then 181 warmed up again)."""
    k, state = Keeper(Settings(), U), shared.ServerState(U)
    k.facts.note_server(state, info())
    a1 = placed(k, state, family("Family A rules.", "/a1"), "a1", 0.0)
    a1_key = k.table.dispatched[a1]
    k.pager.index[a1_key] = page(a1_key, model=k.page_identity)                      # paged out: a restorable page
    b1 = placed(k, state, family("Family B rules.", "/b1"), "b1", 0.5)
    b1_key = k.table.dispatched[b1]
    d = need(k, family("Family B rules.", "/b2"), "b2", 1.0)
    assert d.stable is not None and d.stable.text.startswith(SYS + "\nFamily B")
    k.assign(d, state, info(), LIVE, 1.0)
    key, views = d.ticket.session.key, [SlotView(i) for i in range(4)]
    plan = k.pager.page_plan(PageAsk(b1, key, SlotView(b1, 4000, owner=b1_key), views=views, cold=d.stable))
    assert plan.seed is None and plan.restore_file is None and plan.save_for == b1_key    # saved, then kept
    # the same slot emptied meanwhile: the base prompt from family A's page is worth restoring
    emptied = k.pager.page_plan(PageAsk(b1, key, SlotView(b1, 0, owner=b1_key), views=views, cold=d.stable))
    assert emptied.seed is not None and emptied.seed.source == a1_key


def test_a_claim_whose_request_has_not_gone_out_says_nothing_of_what_the_slot_holds():
    """Three subagents of family B arrive together while family A's conversation is the last sent to a slot; b2
    claims that slot first (it waits for it), then b3 is placed there too. b2's claim names the family prefix,
    but the slot still holds family A's conversation: b3 does not take the prefix as held, so it waits for the
    sibling computing it instead of prefilling the family's part beside it (bench subagents seed 7)."""
    k, state = Keeper(Settings(), U), shared.ServerState(U)
    k.facts.note_server(state, info())
    a1 = placed(k, state, family("Family A rules.", "/a1"), "a1", 0.0)
    need(k, family("Family B rules.", "/b1"), "b1", 0.5)
    b2 = need(k, family("Family B rules.", "/b2"), "b2", 0.5)
    k.assign(b2, state, info(), LIVE, 0.5)                                          # claimed, not sent yet
    b3 = need(k, family("Family B rules.", "/b3"), "b3", 0.5)
    assert b3.prefix == b2.prefix and b3.prefix is not None
    b2_key, a1_key = b2.ticket.session.key, k.table.dispatched[a1]
    claimed = SlotView(a1, 1000, busy=True, owner=b2_key, prefix=b3.prefix)
    assert not k.pager.holds_prefix(b3, claimed)
    k.table.dispatch(b2_key, a1)                                                    # b2's request went there
    assert k.pager.holds_prefix(b3, claimed)
    assert a1_key != b2_key


def test_a_seed_that_shares_a_short_family_part_more_than_the_slot_holder_is_restored():
    """The slot's holder is another family's subagent (it shares the base role only); the family's parent is paged
    out and shares the whole family prefix, whose own part is short (fewer characters than a seed's minimum, still
    tokens a prefill pays for): its page is the seed (bench subagents seed 17: 73 tokens, 192 characters, were
    warmed up cold on a slot whose holder shared only the base)."""
    k, state = Keeper(Settings(), U), shared.ServerState(U)
    k.facts.note_server(state, info())
    a1 = placed(k, state, family("Family A rules.", "/a1"), "a1", 0.0)
    a1_key = k.table.dispatched[a1]
    b1 = placed(k, state, family("B only.", "/b1", times=8), "b1", 0.5)
    b1_key = k.table.dispatched[b1]
    k.pager.index[b1_key] = page(b1_key, model=k.page_identity)
    d = need(k, family("B only.", "/b2", times=8), "b2", 1.0)
    assert d.stable is not None and 0 < len(d.stable.text) - len(SYS) < paging.SEED_MIN_CHARS
    k.assign(d, state, info(), LIVE, 1.0)
    key, views = d.ticket.session.key, [SlotView(i) for i in range(4)]
    plan = k.pager.page_plan(PageAsk(a1, key, SlotView(a1, 4000, owner=a1_key), views=views, cold=d.stable))
    assert plan.seed is not None and plan.seed.source == b1_key and plan.seed.prefix


def test_a_slot_whose_holder_is_a_sibling_already_holds_the_family_prefix():
    """Subagents of one family differ in their system message's last line, so they share no whole message; a
    subagent queued on its sibling's slot still finds all of its stable prefix there, and no warm-up restores
    the base over the sibling's conversation to prefill the family's part again (bench subagents seed 15: 111
    and 135 tokens)."""
    k, state = Keeper(Settings(), U), shared.ServerState(U)
    k.facts.note_server(state, info())
    b1 = placed(k, state, family("Family B rules.", "/b1"), "b1", 0.0)
    b1_key = k.table.dispatched[b1]
    d = need(k, family("Family B rules.", "/b2"), "b2", 0.5)
    assert d.stable is not None and d.stable.text.startswith(SYS + "\nFamily B")
    assert k.pager.holds_prefix(d, SlotView(b1, 1000, owner=b1_key))
    a1 = placed(k, state, family("Family A rules.", "/a1"), "a1", 1.0)            # another family's slot: no
    assert not k.pager.holds_prefix(d, SlotView(a1, 1000, owner=k.table.dispatched[a1]))
