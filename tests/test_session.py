"""Session identification: headers, body fields, conversation root, continuation."""

import json

from hypothesis import given
from hypothesis import strategies as st

from slotlogic.session import (
    PromptMark,
    SessionId,
    Threads,
    continuation,
    prefix_signature,
    prompt_mark,
    resolve,
)

SYSTEM = "You are pi, a coding agent.\n<tools>read bash edit write</tools>\n<cwd>/home/u/proj</cwd>"
TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {}}}]
CHAT = "/v1/chat/completions"


def chat(first, *more, system=SYSTEM, tools=TOOLS):
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": [{"type": "text", "text": first}]}]
    for i, m in enumerate(more):
        msgs.append({"role": "assistant" if i % 2 == 0 else "user", "content": m})
    return {"model": "m", "messages": msgs, "tools": tools, "stream": True}


def test_header_wins_over_everything():
    body = chat("hello") | {"prompt_cache_key": "pk"}
    sid = resolve({"X-Session-Affinity": "uuid-1"}, body, CHAT)
    assert sid.source == "header:x-session-affinity"
    later = body | {"messages": [*body["messages"], {"role": "assistant", "content": "hi"}]}
    assert sid == resolve({"x-session-affinity": "uuid-1"}, later, CHAT)  # its next turn
    assert sid != resolve({"x-session-affinity": "uuid-2"}, body, CHAT)


def test_a_header_never_merges_conversations_with_different_roots():
    """One client session, several conversations (a title call first, a parent and its subagent)."""
    header = {"x-session-id": "ses_1"}
    main = resolve(header, chat("fix the bug"), CHAT)
    assert main != resolve(header, chat("fix the bug", system="You are a title generator."), CHAT)
    assert main != resolve(header, chat("subagent: find the callers"), CHAT)
    assert main.source == "header:x-session-id"


def test_header_list_is_configurable_and_ordered():
    headers = {"x-a": "1", "x-b": "2"}
    assert resolve(headers, {}, CHAT, header_names=("x-b", "x-a")).source == "header:x-b"
    assert resolve(headers, chat("q"), CHAT, header_names=()).source == "content:root"


def test_blank_header_is_ignored():
    assert resolve({"session_id": "  "}, chat("q"), CHAT).source == "content:root"


def test_claude_code_metadata_user_id_json_and_legacy():
    new = {"metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "S1"})}}
    legacy = {"metadata": {"user_id": "user_abc_account_123_session_S1"}}
    a, b = resolve({}, new, "/v1/messages"), resolve({}, legacy, "/v1/messages")
    assert a.source == b.source == "body:metadata.user_id"
    assert a.key == b.key  # both name session S1


def test_body_keys_in_order():
    assert resolve({}, {"prompt_cache_key": "k", "user": "u"}, CHAT).source == "body:prompt_cache_key"
    assert resolve({}, {"promptCacheKey": "k"}, CHAT).source == "body:promptCacheKey"
    assert resolve({}, {"user": "u"}, CHAT).source == "body:user"


def test_root_is_stable_across_turns():
    t1 = resolve({}, chat("fix the parser"), CHAT)
    t3 = resolve({}, chat("fix the parser", "ok", "tool output", "done"), CHAT)
    assert t1 == t3 and t1.source == "content:root"


def test_two_windows_same_project_are_two_sessions():
    assert resolve({}, chat("fix the parser"), CHAT) != resolve({}, chat("write docs"), CHAT)


def test_subagent_with_fresh_first_message_is_its_own_session():
    parent = resolve({}, chat("refactor module", "calling subagent"), CHAT)
    sub = resolve({}, chat("search for usages of foo"), CHAT)
    assert parent != sub


def test_keys_never_contain_prompt_text():
    sid = resolve({}, chat("secret-token-123"), CHAT)
    assert len(sid.key) == 16 and all(c in "0123456789abcdef" for c in sid.key)


def test_prefix_signature_shared_by_windows_not_by_other_systems():
    assert prefix_signature(chat("a"), CHAT) == prefix_signature(chat("b"), CHAT)
    assert prefix_signature(chat("a"), CHAT) != prefix_signature(chat("a", system="other"), CHAT)
    assert prefix_signature(chat("a"), CHAT) != prefix_signature(chat("a", tools=[]), CHAT)
    assert prefix_signature({"messages": [{"role": "user", "content": "x"}]}, CHAT) is None


def test_responses_route_uses_instructions_and_input():
    body = {"instructions": SYSTEM, "input": [{"role": "user", "content": "hi"}]}
    other = {"instructions": SYSTEM, "input": [{"role": "user", "content": "bye"}]}
    a = resolve({}, body, "/v1/responses")
    assert a.source == "content:root" and a != resolve({}, other, "/v1/responses")
    assert resolve({}, {"instructions": SYSTEM, "input": "hi"}, "/v1/responses").source == "content:root"


def test_completion_continuation_rule():
    first = {"prompt": "SYSTEM\nUser: hi\nAssistant:"}
    sid = resolve({}, first, "/completion")
    assert sid.source == "content:prompt"
    known = {sid.key: prompt_mark(first)}
    later = {"prompt": first["prompt"] + " hello\nUser: more\nAssistant:"}
    cont = resolve({}, later, "/completion", known_prompts=known)
    assert cont.key == sid.key and cont.source == "content:continuation"
    unrelated = resolve({}, {"prompt": "SYSTEM\nUser: other"}, "/completion", known_prompts=known)
    assert unrelated.key != sid.key


def test_continuation_prefers_the_longest_match():
    text = "abcdefghij"
    known = {"short": PromptMark(3, prompt_mark({"prompt": "abc"}).digest),
             "long": PromptMark(6, prompt_mark({"prompt": "abcdef"}).digest)}
    assert continuation({"prompt": text}, known).key == "long"


def test_token_prompts_and_infill_get_keys():
    assert resolve({}, {"prompt": [1, 2, 3]}, "/completion").source == "content:prompt"
    assert resolve({}, {"input_prefix": "def f(", "input_suffix": ")"}, "/infill").source == "content:prompt"
    assert resolve({}, {"foo": 1}, "/completion").source == "content:body"


# ------------------------------------------------------------------------------- one root, several conversations

QWEN_SYSTEM = {"role": "system", "content": "You are Qwen Code."}
PRIMER = [{"role": "user", "content": "This is the Qwen Code. The project is /p."},
          {"role": "assistant", "content": "Got it. Thanks for the context!"}]


def qwen(*turns: str) -> dict:
    msgs = [QWEN_SYSTEM, *PRIMER]
    for i, t in enumerate(turns):
        msgs.append({"role": "user", "content": t})
        if i < len(turns) - 1:
            msgs.append({"role": "assistant", "content": f"answer {i}"})
    return {"messages": msgs}


def test_conversations_with_one_scripted_opening_are_told_apart_by_their_user_messages():
    threads = Threads()

    def key(body: dict) -> SessionId:
        return resolve({}, body, "/v1/chat/completions", threads=threads)

    first = key(qwen("hello"))
    assert key(qwen("hello")).key == first.key  # the same opening: indistinguishable, so the same session
    second = key(qwen("name a colour"))
    assert first.source == second.source == "content:root"
    assert first.key == resolve({}, qwen("hello"), "/v1/chat/completions").key  # the first keeps the root key
    assert second.key != first.key
    assert key(qwen("hello", "again")).key == first.key
    assert key(qwen("name a colour", "another")).key == second.key
    assert key(qwen("hello")).key not in (first.key, second.key)  # a new conversation with an old opening


def test_aider_turns_stay_one_conversation_and_its_sessions_are_told_apart():
    """aider sends the prompt with a reminder appended, keeps only the bare prompt in the next turn's history,
    and moves its file context after that history (the shape of the recording: a fixed example exchange first)."""
    threads = Threads()
    context = [{"role": "user", "content": "I added these files."}, {"role": "assistant", "content": "Ok."}]

    def aider(history: list[str], prompt: str) -> dict:
        msgs = [QWEN_SYSTEM, {"role": "user", "content": "Change get_factorial() to use math.factorial"},
                {"role": "assistant", "content": "To make this change we need to modify `mathweb/flask/app.py`"}]
        for h in history:
            msgs += [{"role": "user", "content": h + "  \n"}, {"role": "assistant", "content": "ok"}]
        msgs += [*context, {"role": "user", "content": prompt + "\n\nReturn whole files.\nReply in English."}]
        return {"messages": msgs}

    def key(body: dict) -> str:
        return resolve({}, body, "/v1/chat/completions", threads=threads).key

    one, two = key(aider([], "fix the bug")), key(aider([], "add a test"))
    assert one != two
    assert key(aider(["fix the bug"], "and the docs")) == one
    assert key(aider(["add a test"], "make it pass")) == two


@given(st.lists(st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=5), min_size=1, max_size=6))
def test_every_request_of_an_append_only_conversation_keeps_its_first_key(conversations):
    threads = Threads()
    keys = {}
    for n, conv in enumerate(conversations):
        turns = [f"{n}:{t}" if i == 0 else t for i, t in enumerate(conv)]  # distinct openings
        for end in range(1, len(turns) + 1):
            got = resolve({}, qwen(*turns[:end]), "/v1/chat/completions", threads=threads).key
            assert keys.setdefault(n, got) == got
    assert len(set(keys.values())) == len(conversations)
