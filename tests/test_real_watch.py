"""The first-token watch and the deadline on a real llama-server behind a real mitmdump.

- queued, then prefilling: a second session's request waits behind a long generation on the only slot, then
  evaluates its prompt; the log, the JSONL file and `/_slots/status` say so while it waits;
- the deadline: a stream and a plain request still running at the deadline are ended with a clear error,
  and llama-server stops working on them (`/slots` idle soon after, "cancel task" in its log);
- a stall: every slot idle while a request gets no first byte. A real llama-server never does that on
  purpose, so a small shim in front of it forwards `/props` and `/slots` and swallows the completion request
  (fault injection): the client gets a 504 and the shim sees the upstream connection closed.
"""

from __future__ import annotations

import contextlib
import json
import select
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import httpx
import pytest

from bench.real.llama_server import LlamaServer
from bench.real.mitmdump import MitmProxy
from slotkeeper.launch.mitmdump import free_port
from tests.real_helpers import jsonl

pytestmark = pytest.mark.real

LONG = {"messages": [{"role": "user", "content": "Count from one to one thousand."}], "max_tokens": 3000,
        "ignore_eos": True, "temperature": 0}


def wait_until(predicate: Any, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return False


def idle(server_url: str) -> bool:
    return not any(s["is_processing"] for s in httpx.get(server_url + "/slots", timeout=5).json())


# Polls of /slots more often than once a second delay llama-server's notice of a closed connection on a
# request that is not streamed: its HTTP thread waits for results in 1 s slices and checks the connection
# when a slice passes empty, and every /slots answer wakes that wait and starts a new slice (measured: a
# 0.1 s poll loop kept a cancelled request running 15 s). So the checks below poll every 1.5 s.
SLOW_POLL = 1.5


def test_queued_then_prefilling_is_logged_and_shown_while_it_waits(tmp_path):
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_log_file": str(tmp_path / "req.jsonl"),
            "slots_watch_interval_ms": 400, "slots_watch_timeout_ms": 2500}
    prompt = "Read this log and say ok. " + " ".join(f"entry {i} passed." for i in range(90))
    statuses: list[dict[str, Any]] = []
    with LlamaServer(slots=1, ctx_per_slot=4096, threads=1, log_path=str(tmp_path / "s.log")) as srv, \
            MitmProxy(srv.url, opts, log_path=str(tmp_path / "p.log")) as px:
        first_chunk = threading.Event()

        def generate() -> None:
            # long enough to be still generating when the queued request's first watch line comes (2.5 s
            # after it starts, at the latest) on a fast machine too: 120 tokens were not, once, and 250 (~6 s
            # on one thread here) were not once either, in a full 3.12 suite; 400 take ~10 s
            body = {**LONG, "max_tokens": 400, "stream": True}
            with httpx.stream("POST", px.url + "/v1/chat/completions", json=body, timeout=120) as r:
                for _ in r.iter_raw():
                    first_chunk.set()

        gen = threading.Thread(target=generate)
        gen.start()
        assert first_chunk.wait(60)
        out: dict[str, Any] = {}
        queued = threading.Thread(target=lambda: out.update(r=httpx.post(
            px.url + "/v1/chat/completions", timeout=120,
            json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 2})))
        queued.start()
        while queued.is_alive():
            statuses.append(httpx.get(px.url + "/_slots/status", timeout=10).json())
            time.sleep(0.3)
        gen.join()
    assert out["r"].status_code == 200
    waits = [r for r in jsonl(tmp_path / "req.jsonl") if r["kind"] == "waiting"]
    states = [w["state"] for w in waits]
    assert "queued" in states and "prefilling" in states, states
    assert states.index("queued") < len(states) - 1 - states[::-1].index("prefilling")
    # The server may be polled in the instant it has launched the queued task on slot 0 but not yet loaded its
    # prompt: that one reading still shows the finished request's prompt length (37). A later one shows ours.
    pre = [w for w in waits if w["state"] == "prefilling"]
    assert all(w["slot"] == 0 for w in pre) and any(w["total"] > 300 for w in pre), pre
    shown = [w for s in statuses for w in s["waiting"]]
    assert {"queued", "prefilling"} <= {w["state"] for w in shown}, shown
    log = (tmp_path / "p.log").read_text()
    assert "for its first byte: queued behind slot 0" in log and "for its first byte: prefilling (" in log
    assert "Read this log" not in log
    print("\n".join(line for line in log.splitlines() if "first byte" in line))


def test_the_deadline_ends_a_stream_and_a_plain_request_and_the_server_stops_working_on_them(tmp_path):
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_request_deadline": 3,
            "slots_log_file": str(tmp_path / "req.jsonl")}
    with LlamaServer(slots=1, ctx_per_slot=4096, threads=1, log_path=str(tmp_path / "s.log")) as srv, \
            MitmProxy(srv.url, opts, log_path=str(tmp_path / "p.log")) as px:
        t0 = time.monotonic()
        lines: list[str] = []
        with pytest.raises(httpx.HTTPError), \
                httpx.stream("POST", px.url + "/v1/chat/completions", json={**LONG, "stream": True},
                             timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                lines.append(line)
        stream_s = time.monotonic() - t0
        stream_idle = wait_until(lambda: idle(srv.url), 10, SLOW_POLL)
        t0 = time.monotonic()
        plain = httpx.post(px.url + "/v1/chat/completions", json=LONG, timeout=120)
        plain_s = time.monotonic() - t0
        plain_idle = wait_until(lambda: idle(srv.url), 10, SLOW_POLL)
        print(f"stream ended after {stream_s:.1f} s, plain after {plain_s:.1f} s, its slot idle "
              f"{time.monotonic() - t0 - plain_s:.1f} s later")
        time.sleep(0.5)
    errors = [json.loads(x[6:]) for x in lines if x.startswith("data: {\"error\"")]
    assert len(lines) > 5 and errors and errors[0]["error"]["code"] == 504, lines[-3:]
    assert "deadline of 3 s reached (slots_request_deadline)" in errors[0]["error"]["message"]
    assert 3 <= stream_s < 8 and stream_idle
    assert plain.status_code == 504 and plain.headers["content-type"] == "application/json" and 3 <= plain_s < 8
    assert "deadline of 3 s reached" in plain.json()["error"]["message"]
    assert plain_idle
    assert (tmp_path / "s.log").read_text().count("cancel task") >= 2
    ended = [r for r in jsonl(tmp_path / "req.jsonl") if r["kind"] == "ended"]
    assert [(e["end"], e["streaming"], e["closed"]) for e in ended] == [("deadline", True, True),
                                                                       ("deadline", False, True)]
    requests = [r for r in jsonl(tmp_path / "req.jsonl") if r["kind"] == "request"]
    assert [r["error"] for r in requests] == ["timeout_error", "deadline"]
    log = (tmp_path / "p.log").read_text()
    print("\n".join(line for line in log.splitlines() if "ended after" in line))


class Swallow(BaseHTTPRequestHandler):
    """Forwards GETs to the real server; reads a POST and never answers, noting when the caller hangs up."""

    upstream = ""
    closed: ClassVar[list[float]] = []

    def do_GET(self) -> None:
        r = httpx.get(self.upstream + self.path, timeout=10)
        self.send_response(r.status_code)
        self.send_header("content-type", r.headers.get("content-type", "application/json"))
        self.send_header("content-length", str(len(r.content)))
        self.end_headers()
        self.wfile.write(r.content)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.connection], [], [], 0.1)
            if ready and not self.connection.recv(1, 2):  # MSG_PEEK: b"" is the caller's close
                Swallow.closed.append(time.monotonic())
                return
        self.close_connection = True

    def log_message(self, *args: Any) -> None:
        pass


def test_a_stalled_request_gets_a_504_and_its_upstream_connection_is_closed(tmp_path):
    """The 504 is JSON in the route's shape: llama-server's error object for a chat completion, Anthropic's
    error body for /v1/messages (translated, and native on a second proxy)."""
    opts = {"slots_state_dir": str(tmp_path / "state"), "slots_watch_interval_ms": 300,
            "slots_first_token_timeout": 2, "slots_log_file": str(tmp_path / "req.jsonl")}
    native = {**opts, "slots_state_dir": str(tmp_path / "state2"), "slots_log_file": str(tmp_path / "req2.jsonl"),
              "slots_anthropic": "native"}
    messages = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]}
    with LlamaServer(slots=3, ctx_per_slot=2048, threads=1, log_path=str(tmp_path / "s.log")) as srv:
        Swallow.upstream, Swallow.closed = srv.url, []
        shim = ThreadingHTTPServer(("127.0.0.1", free_port()), Swallow)
        threading.Thread(target=shim.serve_forever, daemon=True).start()
        shim_url = f"http://127.0.0.1:{shim.server_address[1]}"
        got: dict[str, tuple[httpx.Response, float]] = {}

        def post(name: str, url: str, body: dict[str, Any]) -> None:
            t0 = time.monotonic()
            r = httpx.post(url, json=body, timeout=30)
            got[name] = (r, time.monotonic() - t0)

        try:
            with MitmProxy(shim_url, opts, log_path=str(tmp_path / "p.log")) as px, \
                    MitmProxy(shim_url, native, log_path=str(tmp_path / "p2.log")) as px2:
                calls = [threading.Thread(target=post, args=a) for a in (
                    ("chat", px.url + "/v1/chat/completions",
                     {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}),
                    ("translated", px.url + "/v1/messages", messages),
                    ("native", px2.url + "/v1/messages", messages))]
                for c in calls:
                    c.start()
                for c in calls:
                    c.join(40)
                answered = time.monotonic()
                # three closes: our requests' upstream connections (a proxy's own start-up POST is swallowed too)
                assert wait_until(lambda: len(Swallow.closed) >= 3, 5), Swallow.closed
                time.sleep(0.5)
        finally:
            shim.shutdown()
            shim.server_close()
    message = "every slot stayed idle for 2 s (slots_first_token_timeout)"
    for name, (r, took) in got.items():
        assert r.status_code == 504 and r.headers["content-type"] == "application/json", (name, r.headers)
        assert 2 <= took < 8, (name, took)
        body = r.json()
        if name == "chat":
            assert body["error"]["code"] == 504 and body["error"]["type"] == "timeout_error"
            text = body["error"]["message"]
        else:
            assert body["type"] == "error" and body["error"]["type"] == "timeout_error", (name, body)
            text = body["error"]["message"]
        assert message in text and set(body) == ({"error"} if name == "chat" else {"type", "error"}), body
    assert len(got) == 3 and sorted(Swallow.closed)[2] - answered < 2
    waits = [w for w in jsonl(tmp_path / "req.jsonl") if w["kind"] == "waiting"]
    assert waits and all(w["state"] == "stalled" for w in waits) and waits[-1]["idle_for"] >= 2 - 0.3 - 0.2
    # the last line comes from the last poll before the timeout fired: up to one interval (0.3 s) and a
    # slow poll earlier than the 2 s
    log = (tmp_path / "p.log").read_text()
    assert "stalled: every slot idle for" in log and "answered 504 and closed the upstream connection" in log
    print("\n".join(line for line in log.splitlines() if "stalled" in line or "ended after" in line))
    print({name: r.text for name, (r, _) in got.items()})


class Canned(Swallow):
    """`/props` and `/slots` of a server whose slot 0 evaluates a long prompt; completions are swallowed."""

    SLOTS: ClassVar[list[dict[str, Any]]] = [
        {"id": 0, "n_ctx": 4096, "is_processing": True, "id_task": 7, "n_prompt_tokens": 3000,
         "n_prompt_tokens_processed": 2048, "next_token": [{"n_decoded": 0}]},
        {"id": 1, "n_ctx": 4096, "is_processing": False, "id_task": 2, "n_prompt_tokens": 0}]

    def do_GET(self) -> None:
        body = json.dumps(self.SLOTS if self.path.startswith("/slots") else
                          {"total_slots": 2, "media_marker": "<__media_x__>", "model_path": "/nowhere.gguf",
                           "default_generation_settings": {"n_ctx": 4096}}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_mitmweb_shows_what_a_waiting_request_is_doing_as_its_comment(tmp_path):
    """The flow's comment and marker in mitmweb (its /flows API) while the request waits: a canned server
    (fault injection: slot 0 evaluates a prompt that never ends) keeps the request queued."""
    import subprocess

    from mitmproxy import version

    from bench.real.mitmdump import ROOT
    from slotkeeper.launch.mitmdump import mitm_argv

    shim = ThreadingHTTPServer(("127.0.0.1", free_port()), Canned)
    threading.Thread(target=shim.serve_forever, daemon=True).start()
    port, web = free_port(), free_port()
    opts: dict[str, object] = {"slots_state_dir": str(tmp_path / "state"), "slots_watch_interval_ms": 300}
    auth = {}
    if tuple(int(x) for x in version.VERSION.split(".")[:2]) >= (11, 1):  # the web API needs a token since 11.1
        opts["web_password"] = "slotkeeper-test"
        auth = {"Authorization": "Bearer slotkeeper-test"}
    argv = mitm_argv(f"http://127.0.0.1:{shim.server_address[1]}", port, opts, web=True, web_port=web)
    with open(tmp_path / "web.log", "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT), start_new_session=True)
    def waiting_client() -> None:  # never answered: it ends when mitmweb stops
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=6,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})

    client = threading.Thread(target=waiting_client, daemon=True)
    try:
        assert wait_until(lambda: _up(f"http://127.0.0.1:{port}/_slots/health"), 30)
        client.start()
        comments: list[tuple[str, str]] = []

        def seen() -> bool:
            flows = httpx.get(f"http://127.0.0.1:{web}/flows", headers=auth, timeout=5).json()
            comments[:] = [(f.get("comment", ""), f.get("marked", "")) for f in flows]
            return any("queued behind slot 0" in c for c, _ in comments)

        assert wait_until(seen, 10, 0.3), comments
    finally:
        proc.terminate()
        proc.wait(15)
        shim.shutdown()
        shim.server_close()
    comment, marked = next((c, m) for c, m in comments if "queued" in c)
    assert comment.startswith("s=") and " waiting " in comment and marked == "⏳"
    print(f"mitmweb comment: {comment!r} marker {marked!r}")


def _up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
