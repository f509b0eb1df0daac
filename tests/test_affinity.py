"""Pending-then-pinned: how each route tells which slot ran a pending request."""

import json
import logging
from dataclasses import replace

from mitmproxy import http

from slotlogic import shared
from slotlogic.affinity import Learn, method, slot_from_slots, valid
from slotlogic.answers import Observation
from slotlogic.decisions import NeedSlot, Pin, Replay, RequestFacts
from slotlogic.events import SlotLearned
from slotlogic.keeper import Keeper
from slotlogic.ranking import Policy
from slotlogic.reasons import Why
from slotlogic.server import ServerInfo
from slotlogic.settings import Settings
from tests.conftest import chat as agent_chat
from tests.conftest import flow, sent, streamed


def test_each_route_has_its_way_of_telling():
    assert method("/completion", {}) is Learn.ECHO and method("/infill", {}) is Learn.ECHO
    assert method("/v1/chat/completions", {}) is Learn.VERBOSE and method("/v1/completions/", {}) is Learn.VERBOSE
    assert method("/v1/chat/completions", {"verbose": True}) is Learn.CLIENT_VERBOSE
    assert method("/v1/chat/completions", {"verbose": False}) is Learn.SLOTS
    assert method("/v1/responses", {}) is Learn.SLOTS


def slot(i, tokens, busy=False):
    return {"id": i, "n_prompt_tokens": tokens, "is_processing": busy}


def test_the_slots_match_finds_the_one_idle_slot_holding_the_answer():
    live = [slot(0, 42), slot(1, 503), slot(2, 0)]
    assert slot_from_slots(live, 43, 3) == 0               # prompt + generated - 1
    assert slot_from_slots(live, 503, 3) == 1              # or exactly that many
    assert slot_from_slots([slot(0, 42), slot(1, 42)], 43, 2) is None   # two fit: nothing is learned
    assert slot_from_slots([slot(0, 42, busy=True)], 43, 1) is None
    assert slot_from_slots(live, None, 3) is None and slot_from_slots(live, 43, 0) is None
    assert slot_from_slots([{"id": 5, "n_prompt_tokens": 42}], 43, 4) is None  # out of range


def test_only_a_slot_in_range_is_ever_learned():
    assert valid(0, 4) and valid(3, 4) and valid(7, None)
    assert not valid(4, 4) and not valid(-1, 4) and not valid(True, 4) and not valid("1", 4)


# --- the policy through the core's public interface ---------------------------------------------------------

CHAT = "/v1/chat/completions"


def chat(first="task A", **extra):
    return {"messages": [{"role": "system", "content": "You are a coding agent. " * 4},
                         {"role": "user", "content": first}], **extra}


def facts(body, path=CHAT, now=0.0, replay=None):
    return RequestFacts("POST", path, (), json.dumps(body).encode(), now, replay)


def keeper(total=4, **settings):
    k = Keeper(Settings(policy=Policy.AFFINITY, **settings), "http://up")
    if total:
        k.facts.note_server(shared.ServerState("http://up"), ServerInfo(total_slots=total, media_marker="m1"))
    return k


def answer(k, decision, slot, now=1.0, **obs):
    report = k.outcomes.answered(decision.ticket, Observation(id_slot=slot, cache_n=0, prompt_n=10, **obs), path=CHAT,
                        seconds=0.1, now=now)
    return report, k.outcomes.warnings(report)


def test_a_new_session_goes_out_pending_then_rides_the_slot_the_server_chose():
    k = keeper()
    first = k.request(facts(chat()))
    assert isinstance(first, Pin) and first.ticket.why is Why.PENDING and first.ticket.slot is None
    out = json.loads(first.body)
    assert (out["id_slot"], out["cache_prompt"], out["verbose"]) == (-1, True, True)
    assert first.body.startswith(json.dumps(chat()).encode()[:-1])      # the client's bytes, three fields added
    report, events = answer(k, first, slot=2)
    assert report.slot == 2 and events == [SlotLearned("http://up", first.ticket.session.short, 2, Learn.VERBOSE)]
    again = k.request(facts(chat(), now=5.0))
    assert isinstance(again, Pin) and again.ticket.why is Why.KNOWN and again.ticket.slot == 2
    assert json.loads(again.body)["id_slot"] == 2 and "verbose" not in json.loads(again.body)
    assert again.ticket.session.key in k.table.dirty                   # the claim goes to the state file


def test_nothing_is_learned_from_errors_out_of_range_slots_or_side_calls():
    k = keeper(total=2)
    first = k.request(facts(chat()))
    answer(k, first, slot=1, error_type="server_error")
    answer(k, first, slot=5)
    assert k.request(facts(chat(), now=2.0)).ticket.why is Why.PENDING
    side = k.request(facts(chat(first="x"), now=3.0))
    side = replace(side, ticket=replace(side.ticket, side=True))
    assert answer(k, side, slot=0)[1] == []


def test_routes_learn_their_own_way_and_a_clients_verbose_is_kept():
    k = keeper()
    native = k.request(facts({"prompt": "hello there"}, path="/completion"))
    assert native.ticket.learn is Learn.ECHO and "verbose" not in json.loads(native.body)
    own = k.request(facts(chat(first="b", verbose=True)))
    assert own.ticket.learn is Learn.CLIENT_VERBOSE and json.loads(own.body)["verbose"] is True
    responses = k.request(facts({"input": "hi", "model": "m"}, path="/v1/responses"))
    assert responses.ticket.learn is Learn.SLOTS and "verbose" not in json.loads(responses.body)
    assert answer(k, responses, slot=None)[1] == []                   # learned from /slots instead
    live = [{"id": 0, "n_prompt_tokens": 41, "is_processing": False},
            {"id": 3, "n_prompt_tokens": 9, "is_processing": False}]
    learned = k.outcomes.learn_from_slots(responses.ticket, Observation(tokens_total=42), live, 2.0)
    assert learned is not None and learned.slot == 0 and learned.how is Learn.SLOTS
    pinned = k.request(facts({"input": "hi", "model": "m"}, path="/v1/responses", now=3.0))
    assert pinned.ticket.why is Why.KNOWN and pinned.ticket.slot == 0


def test_a_trusted_clients_own_valid_slot_is_kept_and_its_session_claims_it():
    k = keeper(override_client=False)
    own = k.request(facts(chat(id_slot=1)))
    assert own.ticket.why is Why.CLIENT_SLOT and own.ticket.learn is None and own.ticket.slot == 1
    assert k.table.sessions[own.ticket.session.key].slot == 1 and own.ticket.session.key in k.table.dirty
    bad = k.request(facts(chat(first="c", id_slot=9)))
    assert bad.ticket.why is Why.PENDING and json.loads(bad.body)["id_slot"] == -1


def test_by_default_a_clients_id_slot_is_replaced():
    k = keeper()
    own = k.request(facts(chat(id_slot=1)))
    assert own.ticket.why is Why.PENDING and json.loads(own.body)["id_slot"] == -1


def test_a_displaced_session_and_every_session_after_a_resize_go_out_pending_again():
    k = keeper(total=0)
    state = shared.ServerState("http://up")
    k.facts.note_server(state, ServerInfo(total_slots=4, media_marker="m1"))
    a = k.request(facts(chat("A")))
    answer(k, a, slot=1)
    b = k.request(facts(chat("B")))
    answer(k, b, slot=1, now=2.0)                       # the server put B on A's slot
    assert k.request(facts(chat("A"), now=3.0)).ticket.why is Why.PENDING
    assert k.request(facts(chat("B"), now=3.0)).ticket.why is Why.KNOWN
    events = k.facts.note_server(state, ServerInfo(total_slots=2, media_marker="m1"))
    assert events and k.request(facts(chat("B"), now=4.0)).ticket.why is Why.PENDING


def test_a_pending_request_the_server_ran_ahead_of_a_known_turn_queued_on_its_slot_learns_nothing():
    """bench agents under `affinity`: B's pending request ran on slot 1 while A's known turn, pinned there, was
    still open (the server puts a request only on an idle slot, so A's queued behind B's). B learned slot 1 and
    its next turn, pinned there, found what A's turn left: 355 tokens lost, `unknown`. A's conversation is what
    the slot holds: B goes out pending again, A stays known there, and B's loss, if any, is `unpinned`."""
    from slotlogic.ledger import Cause

    k = keeper()
    a = k.request(facts(chat("A")))
    answer(k, a, slot=1)
    a2 = k.request(facts(chat("A"), now=2.0))
    assert a2.ticket.why is Why.KNOWN and a2.ticket.slot == 1          # A's next turn, pinned to slot 1, open
    b = k.request(facts(chat("B"), now=2.5))
    _, events = answer(k, b, slot=1, now=3.0)                          # B ran there first
    assert events == [] and k.ledger.entry(1).owner == a.ticket.session.key
    answer(k, a2, slot=1, now=4.0)                                     # then A's turn, over B's
    assert k.request(facts(chat("B"), now=5.0)).ticket.why is Why.PENDING
    assert k.request(facts(chat("A"), now=5.0)).ticket.why is Why.KNOWN
    assert k.ledger.gone.get(b.ticket.session.key) is Cause.UNPINNED


def test_pending_needs_no_server_facts_and_no_slot_choice():
    k = keeper(total=0)
    first = k.request(facts(chat()))
    assert isinstance(first, Pin) and not isinstance(first, NeedSlot) and json.loads(first.body)["id_slot"] == -1


def test_a_saved_pending_flow_replays_to_the_same_body():
    k = keeper()
    first = k.request(facts(chat()))
    replayed = keeper().request(RequestFacts("POST", CHAT, (), first.body, 0.0,
                                             Replay(client=first.ticket.client, facts=None)))
    assert replayed.body == first.body


# --- the addons: what the client receives -------------------------------------------------------------------

async def test_a_pending_json_answer_reaches_the_client_without_verbose(proxy, fake_llama, caplog):
    proxy.configure(slots_policy="affinity")
    f = await proxy.request(flow(agent_chat()))
    assert sent(f)["id_slot"] == -1 and sent(f)["verbose"] is True and fake_llama.calls in ([], ["props"])
    answer = {"choices": [{"message": {"content": "ok"}}], "id": "x", "__verbose": {"id_slot": 3, "prompt": "p"},
              "timings": {"cache_n": 0, "prompt_n": 40}}
    with caplog.at_level(logging.INFO):
        await proxy.answer(f, http.Response.make(200, json.dumps(answer), {"content-type": "application/json"}))
    body = json.loads(f.response.content)
    assert "__verbose" not in body and body["timings"] == answer["timings"]
    assert f.response.headers["content-length"] == str(len(f.response.content))
    assert f.response.headers["x-slot-id"] == "3" and "why=pending" in caplog.text and "pinned to slot 3" in caplog.text
    g = await proxy.request(flow(agent_chat()))
    assert sent(g)["id_slot"] == 3 and "verbose" not in sent(g)


async def test_a_pending_stream_reaches_the_client_without_verbose(proxy):
    proxy.configure(slots_policy="affinity")
    f = await proxy.request(flow(agent_chat(stream=True)))
    f.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
    f.response.content = None
    await proxy.hook("responseheaders", f)
    assert "x-slot-id" not in f.response.headers
    stream = (b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
              b'data: {"choices":[],"timings":{"cache_n":120,"prompt_n":8},"__verbose":{"id_slot":1,"p":"q"}}\n\n'
              b'data: [DONE]\n\n')
    out = streamed(f, stream)
    assert out == stream.replace(b',"__verbose":{"id_slot":1,"p":"q"}', b"")
    await proxy.hook("response", f)
    assert f.metadata["slotkeeper"]["slot"] == 1
    g = await proxy.request(flow(agent_chat(stream=True)))
    assert sent(g)["id_slot"] == 1
