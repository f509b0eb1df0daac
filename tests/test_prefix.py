"""Stable-prefix extraction (pi 0.58 and newer layouts) and fingerprint stability."""

import pytest

from slotlogic.prefix import DEFAULT_MARKERS, FILE_RE, StablePrefix, extract, file_name, fingerprint

TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
NEW_PI = "You are pi.\n<tools>\nread, bash\n</tools>\n<project_context>x</project_context>  \n<cwd>/home/u/p</cwd>"
OLD_PI = "You are pi.\nTools: read, bash\nCurrent date: 2026-11-29\nCurrent working directory: /home/u/p"


def body(system, role="system", tools=TOOLS, **extra):
    return {"messages": [{"role": role, "content": system}, {"role": "user", "content": "hi"}], "tools": tools,
            **extra}


@pytest.mark.parametrize(("system", "expected"), [
    (NEW_PI, "You are pi.\n<tools>\nread, bash\n</tools>\n<project_context>x</project_context>"),
    (OLD_PI, "You are pi.\nTools: read, bash"),
    ("A\nCurrent working directory: /x\nCurrent date: 2026", "A"),
])
def test_extraction_cuts_at_earliest_marker_and_strips(system, expected):
    p = extract(body(system))
    assert p is not None and p.text == expected and p.tools == TOOLS


def test_developer_role_and_part_arrays():
    p = extract(body([{"type": "text", "text": OLD_PI}], role="developer"))
    assert p is not None and p.role == "developer" and p.text == "You are pi.\nTools: read, bash"


@pytest.mark.parametrize("b", [
    body("no marker at all"),
    body("\n<cwd>/x"),  # nothing before the marker
    {"messages": [{"role": "user", "content": OLD_PI}]},
    {"messages": []},
    {"prompt": OLD_PI},
])
def test_no_stable_prefix(b):
    assert extract(b) is None


def test_windows_in_two_projects_share_the_prefix():
    a = extract(body(NEW_PI))
    b = extract(body(NEW_PI.replace("/home/u/p", "/srv/other")))
    assert a == b and a.signature == b.signature
    assert extract(body(NEW_PI, tools=[])).signature != a.signature


def test_custom_markers():
    assert extract(body("AB|C"), markers=("|",)).text == "AB"
    assert extract(body("AB|C")) is None and "\n<cwd>" in DEFAULT_MARKERS


def test_warmup_body_renders_the_prefix():
    p = StablePrefix("S", "system", TOOLS, {"enable_thinking": False})
    assert p.warmup_body() == {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": ""}],
                               "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}
    assert p.warmup_body("probe")["messages"][1]["content"] == "probe"


def fp(prefix, **kw):
    args = {"model_path": "/m.gguf", "model_size": 10, "model_mtime": 1.5, "build_info": "b1", "server_id": "",
            "addon_version": "0.1.0"} | kw
    return fingerprint(prefix, **args)


def test_fingerprint_is_stable_and_sensitive():
    p = extract(body(NEW_PI))
    same_but_reordered = StablePrefix(p.text, p.role, [{"function": {"parameters": {"type": "object"},
                                                                     "name": "read"}, "type": "function"}], None)
    assert fp(p) == fp(p) == fp(same_but_reordered)  # canonical JSON: key order does not matter
    assert len({fp(p), fp(p, model_path="/n.gguf"), fp(p, model_size=11), fp(p, model_mtime=2.0),
                fp(p, build_info="b2"), fp(p, server_id="x"), fp(p, addon_version="0.2"),
                fp(StablePrefix(p.text + ".", p.role, p.tools, None))}) == 8
    assert len(fp(p)) == 64 and int(fp(p), 16) >= 0  # full SHA-256 hex
    assert FILE_RE.match(file_name(fp(p))) and file_name(fp(p)) == f"prefix-{fp(p)[:16]}.bin"
