"""The real addons and drivers in front of the simulator: requests are pinned, answers observed, runs repeat."""

from __future__ import annotations

import asyncio
import sys
import time

from bench.sim.clock import VirtualClock, run
from bench.sim.harness import Outcome, Rig, Setup
from bench.sim.sweep import run_seed, run_shape
from bench.sim.traffic import SessionShape, Shape, shape_from_seed


def convo(tag: str, *turns: str, stream: bool = False) -> dict:
    msgs = [{"role": "system", "content": "You are a coding agent . " * 30 + f"\n<cwd>/home/{tag}</cwd>"}]
    msgs += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    body = {"model": "sim", "messages": msgs, "max_tokens": 4}
    return body | ({"stream": True, "stream_options": {"include_usage": True}} if stream else {})


def test_two_sessions_through_the_real_addons_keep_their_slots_warm():
    async def main() -> list:
        async with Rig(Setup(slots=2)) as rig:
            async def session(tag: str, stream: bool) -> None:
                turns = [f"task {tag}"]
                for i in range(3):
                    out = await rig.send(tag, convo(tag, *turns, stream=stream))
                    turns += [out.content, f"output {i} " * 10]
            await asyncio.gather(session("a", True), session("b", False))
            return rig.outcomes
    outcomes = run(VirtualClock(), main)
    assert len(outcomes) == 6 and all(o.done is not None and o.error is None for o in outcomes)
    later = [o for o in outcomes if o.meta["reason"] == "known"]
    assert len(later) == 4 and all(o.done.lost == 0 and o.done.cache_n == o.done.expected for o in later)
    assert {o.meta["slot"] for o in outcomes if o.tag == "a"} != {o.meta["slot"] for o in outcomes if o.tag == "b"}
    assert all(o.meta["cache_n"] == o.done.cache_n for o in outcomes)  # the proxy read the server's numbers


def test_a_restart_mid_request_is_an_error_for_the_proxy_and_a_labelled_loss():
    shape = Shape(0, Setup(slots=2), (SessionShape(turns=3, marker=True, stream=True, start=0.0,
                                                   think=(1.0, 1.0)),), restarts=((0.05, 0, False),))
    result, rig = run_shape(shape)
    assert result.error is None and any(o.error == "restart" for o in rig.outcomes)
    assert result.lost == 0


def test_a_seed_repeats_exactly():
    a, b = run_seed(7), run_seed(7)
    assert (a.prefill, a.limit, a.requests, [x.line() for x in a.losses]) == (
        b.prefill, b.limit, b.requests, [x.line() for x in b.losses])


def test_shapes_vary_per_seed():
    shapes = [shape_from_seed(s) for s in range(60)]
    assert {s.setup.slots for s in shapes} == set(range(1, 9))
    assert {s.setup.paging for s in shapes} == {True, False} and {s.setup.servers for s in shapes} == {1, 2}
    assert {s.setup.proxies for s in shapes} == {1, 2} and any(s.restarts for s in shapes)
    assert any(x.subagent_at is not None for s in shapes for x in s.sessions)
    assert {x.marker for s in shapes for x in s.sessions} == {True, False}


def test_the_invariant_checker_sees_a_slot_that_no_longer_holds_its_believed_owner():
    from bench.sim.invariants import Checker

    async def main() -> tuple[list[str], list[str]]:
        async with Rig(Setup(slots=2)) as rig:
            for tag in ("a", "b"):
                await rig.send(tag, convo(tag, f"task {tag}"))
            checker = Checker(rig)
            before = checker.violations()
            server = rig.servers["http://127.0.0.1:8080"]
            slot = next(o.done.slot for o in rig.outcomes if o.tag == "b")
            server.slots[slot].tokens = server.slots[slot].tokens[:5]  # another process wrote over it
            return before, checker.violations()
    before, after = run(VirtualClock(), main)
    # both beliefs see it: the session table's holder and the ledger's entry for the slot
    assert before == [] and len(after) == 2, after
    assert "believes b holds slot" in after[0] and "ledger: slot" in after[1] and "of b; the slot holds 5" in after[1]


def test_an_eviction_without_paging_is_a_labelled_loss():
    shape = Shape(3, Setup(slots=1), tuple(SessionShape(turns=2, marker=True, stream=False, start=0.1 * i,
                                                        think=(0.5,)) for i in range(2)))
    result, _ = run_shape(shape)
    assert result.losses and all(x.cause == "given-away" and x.labelled for x in result.losses)
    assert result.lost == 0 and result.lost_labelled > 0


def test_a_new_session_on_the_other_server_starts_from_a_copy_of_a_slot_of_the_first():
    """Two servers of one slot each, one save dir: the second session of a client lands on the second server
    (the first's only slot is taken) and starts from a copy of the first server's slot (saved there, restored
    here), so it prefills only its own words; without the pool's seeds it prefilled the shared environment
    block again (a checkpoint holds only the system prompt)."""
    env = "environment : " + " ".join(f"file{i}.py" for i in range(150))

    def body(task: str) -> dict:
        return {"model": "sim", "max_tokens": 4, "messages": [
            {"role": "system", "content": "You are a coding agent . " * 30},
            {"role": "user", "content": env}, {"role": "user", "content": task}]}

    async def main() -> tuple[Outcome, Outcome, dict]:
        async with Rig(Setup(servers=2, slots=1, paging=True)) as rig:
            a = await rig.send("a", body("fix the parser"))
            b = await rig.send("b", body("write the docs"))
            await rig.settle()
            return a, b, {url: [(e.kind, e.slot) for e in s.events] for url, s in rig.servers.items()}
    a, b, events = run(VirtualClock(), main)
    assert a.server != b.server and a.error is None and b.error is None
    assert ("save", 0) in events[a.server] and ("restore", 0) in events[b.server]
    assert b.done.prompt_n < 20, (b.done.cache_n, b.done.prompt_n)   # its task and the template's tokens


def test_side_calls_of_two_kinds_keep_their_content_on_the_side_slot():
    """Issue 25: OpenCode's title calls and Qwen Code's memory calls took turns on the one side slot, and each
    found the other's prompt there (4,142 tokens lost in one run). Each kind now has a home: with paging, the
    other kind's content is paged out and its own paged back in, so a call that extends its kind's previous one
    finds all of it."""
    memory = "You are now acting as the managed memory extraction subagent . " * 20
    title = "You are a title generator . Write a short title for the conversation . " * 20

    def body(system: str, turns: list[str]) -> dict:
        msgs = [{"role": "system", "content": system}]
        msgs += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
        return {"model": "sim", "max_tokens": 4, "messages": msgs}

    async def main() -> tuple[list[Outcome], list[str]]:
        async with Rig(Setup(slots=3, paging=True)) as rig:
            mem: list[str] = []
            for i in range(3):
                mem.append(f"memory of turn {i} " * 30)
                out = await rig.send("memory", body(memory, mem))
                mem.append(out.content)
                await rig.send(f"title{i}", body(title, [f"conversation {i} " * 20]))
            await rig.settle()
            return rig.outcomes, [e.kind for s in rig.servers.values() for e in s.events if e.slot == 2]
    outcomes, kinds = run(VirtualClock(), main)
    calls = [o for o in outcomes if o.tag == "memory"]
    assert all(o.meta.get("reason") == "side-call" and o.error is None for o in outcomes)
    assert {o.meta["slot"] for o in outcomes} == {2}                        # one side slot for both kinds
    later = calls[1:]
    assert all(o.done.lost == 0 and o.done.cache_n >= o.done.expected - 1 for o in later), \
        [(o.done.cache_n, o.done.expected) for o in later]
    assert kinds.count("save") >= 4 and kinds.count("restore") >= 4        # paged out, and each back in
    titles = [o for o in outcomes if o.tag.startswith("title")][1:]
    assert all(o.done.cache_n > 200 for o in titles)                        # a title call finds its prompt


def test_sessions_waiting_for_one_source_copy_it_even_when_a_placement_takes_its_slot():
    """Bench subagents seed 1 under load: three sessions waited for the one session computing their prompt;
    when it ended, a fourth session took its slot (paging it out) and the three found the slot busy, no seed,
    and one of them warmed the whole prompt cold (737 tokens). Now they take its page once written, or copy the
    slot before the taker writes it; copies of one slot wait for each other instead of being refused."""
    system = "You are a coding agent . Follow the rules . " * 60

    def body(folder: str, task: str) -> dict:
        return {"model": "sim", "max_tokens": 4, "messages": [
            {"role": "system", "content": system + f"\nWorking in /home/{folder}\n"},
            {"role": "user", "content": task}]}

    async def main(taker_at: float) -> tuple[list[Outcome], int]:
        async with Rig(Setup(slots=4, paging=True)) as rig:
            async def at(t: float, tag: str, b: dict) -> Outcome:
                await asyncio.sleep(t)
                return await rig.send(tag, b)
            other = {"model": "sim", "max_tokens": 4, "messages": [
                {"role": "system", "content": "Something else entirely . " * 80}, {"role": "user", "content": "x"}]}
            outs = await asyncio.gather(at(0.0, "m0", body("a", "task zero")), *(
                at(0.1, f"m{i}", body(f"p{i}", f"task {i}")) for i in (1, 2, 3)), at(taker_at, "m4", other))
            await rig.settle()
            proxy_prefill = sum(e.after - e.reused for s in rig.servers.values() for e in s.events
                                if e.kind == "request" and e.tag is None)  # warm-ups and checks
            return list(outs), proxy_prefill
    for taker_at in (0.5, 0.7):  # its slot taken while its page is being written; or just after the copies
        outs, proxy_prefill = run(VirtualClock(), lambda t=taker_at: main(t))
        waiting = [o for o in outs if o.tag in ("m1", "m2", "m3")]
        assert all(o.meta["reason"].endswith("+seeded") for o in waiting), [o.meta["reason"] for o in waiting]
        assert proxy_prefill < 60, proxy_prefill  # the checkpoint's few boundary tokens, not the prompt again


def test_a_run_that_never_ends_fails_once_past_its_real_time_budget():
    """A poll that never ends in virtual time, or a loop that never waits, would hold a sweep's worker at 100%
    CPU for ever; past its budget the run raises `Stalled`, so the sweep reports the seed and goes on."""
    from bench.sim.clock import Stalled

    async def polls() -> None:
        while True:
            await asyncio.sleep(1.0)

    async def spins() -> None:
        while True:
            await asyncio.sleep(0)

    for main in (polls, spins):
        try:
            run(VirtualClock(budget=0.2), main)
        except Stalled as e:
            assert "virtual seconds" in str(e)
        else:
            raise AssertionError("the run should have stalled")


class _Counting:
    """The state store as the handover driver sees it, counting the transactions its beat task opens (its
    `take` for a placement opens some too)."""

    def __init__(self, store) -> None:
        self.store, self.opened = store, []

    def transaction(self):
        if sys._getframe(1).f_code.co_name == "_look":
            self.opened.append(time.monotonic())
        return self.store.transaction()

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_a_proxy_whose_placements_beat_writes_no_beat_of_its_own_until_it_goes_quiet():
    """The handover beat (`slotlogic.handover.BEAT`, every 2 s) is a state-file transaction of its own; a
    placement's transaction beats too, so while new sessions keep coming the beat task only looks. Once they
    stop it beats on its own again, so another proxy still hears that this one is alive."""
    async def main() -> tuple[int, int]:
        async with Rig(Setup(slots=4)) as rig:
            counting = None
            for i in range(8):  # a new session every second: each placement is a transaction that beats
                await rig.send(f"s{i}", convo(f"s{i}", f"task {i}"))
                if counting is None:
                    handovers = rig.proxies[0].upstream("http://127.0.0.1:8080").handovers
                    counting = handovers.store = _Counting(handovers.store)
                await asyncio.sleep(1.0)
            busy = len(counting.opened)
            await asyncio.sleep(10.0)  # quiet: the beat task writes its own beats again
            return busy, len(counting.opened) - busy
    busy, quiet = run(VirtualClock(), main)
    assert busy == 0 and quiet >= 4, (busy, quiet)


def test_a_sibling_queued_on_the_slot_its_sibling_was_placed_on_finds_the_family_prefix_there():
    """One slot, another session on it: two subagents of one family are placed on it, the second while the
    first's claim has not written the slot yet. Decided at placement, the second took the slot as holding the
    other session's prompt and warmed its family prefix up over its sibling's conversation (bench subagents seed
    15: 135 tokens); decided when its turn comes, the sibling's conversation is there and holds all of it."""
    base = "You are a coding agent . Follow the rules . " * 40
    family = "\nFamily rules : review the parser with care . " * 12

    def body(system: str, folder: str, task: str) -> dict:
        return {"model": "sim", "max_tokens": 4, "messages": [
            {"role": "system", "content": system + f"\nWorking in /home/{folder}\n"},
            {"role": "user", "content": task}]}

    async def main(gap: float) -> tuple[list[Outcome], int]:
        async with Rig(Setup(slots=1, paging=True, prefill_speed=300)) as rig:
            async def at(t: float, tag: str, b: dict) -> Outcome:
                await asyncio.sleep(t)
                return await rig.send(tag, b)
            outs = await asyncio.gather(at(0.0, "o", body("Another prompt entirely . " * 60, "o", "x")),
                                        at(0.05, "s1", body(base + family, "s1", "task one")),
                                        at(0.05 + gap, "s2", body(base + family, "s2", "task two")))
            await rig.settle()
            proxy_prefill = sum(e.after - e.reused for s in rig.servers.values() for e in s.events
                                if e.kind == "request" and e.tag is None)
            return list(outs), proxy_prefill
    for gap in (0.1, 0.5):
        outs, proxy_prefill = run(VirtualClock(), lambda g=gap: main(g))
        s1, s2 = outs[1], outs[2]
        assert s1.error is None and s2.error is None
        assert proxy_prefill == 0, (gap, proxy_prefill)                       # no warm-up over the sibling
        assert s2.done.cache_n > s1.done.prompt_n - 20, (s2.done.cache_n, s2.done.prompt_n)


def test_a_new_session_on_the_other_server_starts_from_the_page_of_a_session_displaced_there():
    """Two servers of two slots, one save dir. A session shares its environment block with a session of server X
    that another placement has just displaced (its page is being written there, after X's running prompt batch).
    Placed on server Y, it took that session as no source at all (not idle in a slot) and prefilled the block
    again; the copy of a slot taken so was refused the same way (bench subagents-2x2 seed 10: 426 tokens). Now
    the page X writes is its seed, restored on Y: the pool's servers share the save dir."""
    env = "environment : " + " ".join(f"file{i}.py" for i in range(150))

    def body(task: str) -> dict:
        return {"model": "sim", "max_tokens": 4, "messages": [
            {"role": "system", "content": "You are a coding agent . " * 30},
            {"role": "user", "content": env}, {"role": "user", "content": task}]}

    def other(tag: str, n: int) -> dict:
        return {"model": "sim", "max_tokens": 4, "messages": [
            {"role": "system", "content": f"Prompt {tag} of its own . " * n}, {"role": "user", "content": "x"}]}

    async def main(b_at: float) -> tuple[Outcome, Outcome, dict]:
        async with Rig(Setup(servers=2, slots=2, paging=True, prefill_speed=500)) as rig:
            async def at(t: float, tag: str, b: dict) -> Outcome:
                await asyncio.sleep(t)
                return await rig.send(tag, b)
            a = await rig.send("a", body("fix the parser"))
            # one long prompt beside a's slot, two short ones on the other server; c displaces a, b comes after
            outs = await asyncio.gather(at(0, "f", other("f", 100)), at(0.01, "g", other("g", 300)),
                                        at(0.02, "h", other("h", 100)), at(0.1, "c", other("c", 40)),
                                        at(b_at, "b", body("write the docs")))
            await rig.settle()
            events = {url: [(e.kind, e.tag) for e in s.events] for url, s in rig.servers.items()}
            return a, outs[-1], events
    for b_at in (2.0, 3.0):
        a, b, events = run(VirtualClock(), lambda t=b_at: main(t))
        assert b.server != a.server and b.error is None, (b.server, b.meta)
        pages = {name for kind, name in events[a.server] if kind == "save"}
        assert any(kind == "restore" and name in pages for kind, name in events[b.server]), events
        assert b.done.prompt_n < 20, (b.done.cache_n, b.done.prompt_n)   # its task and the template's tokens


def test_a_slot_handed_back_by_the_proxy_that_paged_the_session_out_pages_in_its_newest_page():
    """Two proxies of one state, one slot. Proxy 1 takes the slot for its session and pages proxy 0's session out;
    proxy 0's next turn of that session asks for the slot back a moment later. Proxy 0 read the page index before
    proxy 1 recorded the new page, was handed the slot after it, and restored the page of two turns before
    (simulator seed 986: 58 tokens lost, `stale-page`). The index is read again once the slot is handed over."""
    def body(tag: str, turns: list[str]) -> dict:
        msgs = [{"role": "system", "content": f"You are agent {tag} . " * 40}]
        msgs += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
        return {"model": "sim", "messages": msgs, "max_tokens": 4}

    async def main(gap: float) -> list[Outcome]:
        async with Rig(Setup(slots=1, paging=True, proxies=2, prefill_speed=300)) as rig:
            a, b = ["task a"], ["task b"]

            async def turn(tag: str, conv: list[str], proxy: int, at: float = 0.0) -> None:
                await asyncio.sleep(at)
                out = await rig.send(tag, body(tag, conv), proxy=proxy)
                conv += [out.content, f"output of {tag} " * 15]
            await turn("a", a, 0)
            await turn("b", b, 1)
            await turn("a", a, 0)
            await asyncio.gather(turn("b", b, 1), turn("a", a, 0, gap))
            await turn("a", a, 0)
            await rig.settle()
            return rig.outcomes
    for gap in (0.01, 0.02, 0.03):
        outcomes = run(VirtualClock(), lambda g=gap: main(g))
        assert all(o.error is None and o.done.lost == 0 and o.done.cache_n >= o.done.expected for o in outcomes), \
            [(o.tag, o.done.cache_n, o.done.expected) for o in outcomes]


def test_a_seed_copy_is_fenced_by_its_source_still_holding_the_slot():
    """bench subagents-2x2 seed 1: a copy was taken of a slot its source had left (another family's session ran
    there since), and the family's prompt was warmed up cold over those 894 tokens. A copy goes ahead only while
    the ledger says the slot holds its source's conversation."""
    async def main() -> tuple[object, object]:
        async with Rig(Setup(slots=1, paging=True)) as rig:
            await rig.send("a", convo("a", "task a"))
            await rig.send("b", convo("b", "task b"))   # the only slot: b's conversation there now
            pages = rig.proxies[0].upstream("http://127.0.0.1:8080").mover.pages
            gone = await pages.copy_out(0, "page-0000000000000000000a.bin", source=_key(rig, "a"))
            here = await pages.copy_out(0, "page-0000000000000000000b.bin", source=_key(rig, "b"))
            return gone, here
    gone, here = run(VirtualClock(), main)
    assert gone is None and here is not None and here[0] > 0


def _key(rig: Rig, tag: str) -> str:
    """The session key the proxy gave the session tagged `tag`."""
    return next(o.report.ticket.session.key for o in rig.outcomes if o.tag == tag)


def test_a_placement_held_to_the_cap_is_placed_again_pinned_and_pages_its_conversation_back_in():
    """`slotlogic.wait` Rule 9 for a placement: a displaced session's turn whose slot stays another placement's
    past the hold's cap waits in the server's queue whichever way it goes. Sent with `id_slot: -1` it prefilled
    from nothing (mix-4 run L: five turns, 24,692 tokens); placed again with no bound, its page comes back in
    once its turn on the slot comes."""
    def body(tag: str, turns: list[str]) -> dict:
        msgs = [{"role": "system", "content": f"You are agent {tag} . " * 40}]
        msgs += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
        return {"model": "sim", "messages": msgs, "max_tokens": 4}

    async def main(hold_for: float) -> Outcome:
        async with Rig(Setup(slots=1, paging=True, options=(("slots_client_patience", 90),))) as rig:
            c = ["task c"]
            out = await rig.send("c", body("c", c))
            c += [out.content, "output " * 30]
            await rig.send("d", body("d", ["task d"]))   # the only slot: c paged out
            pages = rig.proxies[0].upstream("http://127.0.0.1:8080").mover.pages
            assert await pages.hold(0, "blocker", None)   # another placement holds the slot that long
            asyncio.get_running_loop().call_later(hold_for, pages.unlock, "blocker")
            turn = await rig.send("c", body("c", c))
            await rig.settle()
            return turn
    for hold_for in (50.0, 150.0):  # past the bound (30 s) within the patience (90 s), and past it
        turn = run(VirtualClock(), lambda h=hold_for: main(h))
        assert turn.error is None and turn.meta["reason"].endswith("+paged-in"), (hold_for, turn.meta)
        assert turn.done.cache_n >= turn.done.expected > 200, (turn.done.cache_n, turn.done.expected)


def test_a_placement_waiting_for_its_slot_takes_another_that_frees_first():
    """`slotlogic.wait` Rule 10: a new session placed on a slot whose turn is another placement's (its paging lock
    held 60 s) does not wait out its bound while the other slot frees after about a second (bench mix-4 runs M-T:
    41-94 s a run with a slot idle while a request of ours waited for another). It is placed again when that slot
    frees, and not back on the slot it let go of (still another placement's turn), and starts at once."""
    async def main() -> tuple[Outcome, int, bool]:
        options = (("slots_client_patience", 90),)
        async with Rig(Setup(slots=2, paging=True, prefill_speed=100.0, options=options)) as rig:
            await rig.send("a", convo("a", "task a"))   # answered: its slot idle, its claim live
            pages = rig.proxies[0].upstream("http://127.0.0.1:8080").mover.pages
            b = asyncio.ensure_future(rig.send("b", convo("b", "task b " * 40)))  # the empty slot, ~1 s of prefill
            await asyncio.sleep(0.2)
            held = next(o.done.slot for o in rig.outcomes if o.tag == "a")
            assert await pages.hold(held, "blocker", None)  # another placement's turn on a's slot: 60 s
            asyncio.get_running_loop().call_later(60.0, pages.unlock, "blocker")
            c = await rig.send("c", convo("c", "task c"))  # a's slot ranks first (idle), b's is busy
            await b
            return c, held, "blocker" in pages.holding
    c, held, still_held = run(VirtualClock(), main)
    assert c.error is None and c.done is not None
    assert c.done.started - c.started < 5.0, c.done.started - c.started  # not the 30 s bound, not the 60 s lock
    assert still_held and c.done.slot != held
