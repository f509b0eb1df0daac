"""The pinning addon: each completion request goes to its session's slot; each answer is read.

Its options are the core's: how slots are chosen, where the shared state lives, checkpoints and paging.
`configure` validates them once and builds one frozen `Settings`; the hooks are guards plus one call to the
request's router (`Runtime.router`: the pool of several servers, slotkeeper/drivers/pool.py, or the one server's
`OneServer`, slotkeeper/drivers/one_server.py), whose chosen `Upstream` (slotkeeper/drivers/upstream.py) asks the
pure core (slotlogic/keeper.py) and performs what it decides.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

from mitmproxy import ctx, exceptions, http
from mitmproxy.connection import ConnectionState

from slotkeeper.drivers.store import parse_url
from slotkeeper.mitm import body_decode, flows, options
from slotkeeper.mitm.runtime import Open, Runtime, guarded
from slotkeeper.mitm.sse_tap import SSETap, TranslatingTap
from slotlogic import anthropic_answer, verbose
from slotlogic.affinity import Learn
from slotlogic.answers import Observation, StreamObserver, observe_json
from slotlogic.decisions import Forward, Observe, Pin
from slotlogic.events import Failed, PagingOff, PassedThrough, RetriedElsewhere, Stage, WebUi
from slotlogic.reasons import Passed
from slotlogic.verbose import VerboseStripper

log = logging.getLogger("slotkeeper")


class Pinning:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self._web_moved: int | None = None  # mitmweb's UI port, moved off the proxy's own

    def load(self, loader: Any) -> None:
        options.add_options(loader)

    def configure(self, updated: set[str]) -> None:
        if "web_port" in updated or "mode" in updated:
            self._web_port_clear()
        if not any(name.startswith("slots_") or name == "mode" for name in updated):
            return
        o = ctx.options
        settings, state_dir = options.build_settings(o)
        try:
            parse_url(o.slots_state_url, state_dir)
        except ValueError as e:
            raise exceptions.OptionsError(f"slots_state_url: {e}") from None
        self.rt.configure(settings, state_dir, options.fronted_upstreams(o.mode), state_url=o.slots_state_url,
                          servers=options.server_list(o.mode, o.slots_upstreams),
                          health_interval=float(o.slots_health_interval), swap_max_models=o.slots_swap_max_models)

    def running(self) -> None:
        """At start, each server this proxy fronts is probed before the first request comes (whether
        /v1/messages honours id_slot; `/props` and the model check), in background tasks (a sync hook). Under
        mitmweb, where its UI is (mitmweb says so at INFO only, which `termlog_verbosity=alert` hides); without a
        save directory, how to turn paging on."""
        for url in self.rt.fronted:
            self.rt.upstream(url).start()
        port = getattr(ctx.options, "web_port", None)
        if isinstance(port, int):
            url = getattr(ctx.master, "web_url", None)  # mitmproxy 12: with its access token
            if not isinstance(url, str):
                url = f"http://{ctx.options.web_host}:{port}/"
            self.rt.emit(WebUi("", url, self._web_moved))
        if self.rt.fronted and not self.rt.settings.save_dir:
            self.rt.emit(PagingOff(""))

    def _web_port_clear(self) -> None:
        """mitmweb's UI port defaults to 8081, the port a proxy in front of llama-server usually listens on: the
        UI's listen then failed once the proxy's had succeeded, and mitmweb exited ("address already in use").
        It moves to the next port no mode of this proxy listens on and nothing else holds now (said in the `WebUi`
        line)."""
        o = ctx.options
        port = getattr(o, "web_port", None)
        if not isinstance(port, int):
            return  # mitmdump: no UI
        taken = options.listen_ports(o.mode, o.listen_port)
        if port not in taken:
            return
        new = port + 1
        while new in taken or (new < port + 64 and not _bindable(getattr(o, "web_host", "127.0.0.1"), new)):
            new += 1
        self._web_moved = port
        o.update(web_port=new)

    # ------------------------------------------------------------------------------------------- hooks

    async def request(self, flow: http.HTTPFlow) -> None:
        if (flow.live and (flow.response or flow.error)) or flow.request.method != "POST":
            return  # answered already (the local API), or a saved flow (-nr) that carries its answer
        arrived = time.monotonic()  # the line's seconds count the proxy's own placement and hold too
        original = flow.request.raw_content, flow.request.headers.fields, flow.request.path
        url, encoding = flows.upstream_url(flow), flows.get(original[1], b"content-encoding")
        router = self.rt.router(url, flow.live)  # a pool chooses the server; one server is its own router
        upstream, decision = router.server, None
        retry = original if router.retries else None  # what a re-route sends again
        try:
            limit = (upstream.settings if upstream is not None else self.rt.settings).max_body_bytes
            body = await body_decode.request_body(original[0], encoding, limit)
            if body is body_decode.TOO_LARGE_BODY:
                self.rt.emit(PassedThrough(url, flow.request.method, flow.request.path, Passed.TOO_LARGE))
                return
            facts = flows.request_facts(flow, body)
            upstream, decision = await router.decide(facts, flow.id)
            if isinstance(decision, Pin) and upstream.waits.must_wait(decision):
                # its slot runs our earlier requests: a bounded wait here (slotlogic.wait), watched like the rest
                self.rt.open[flow.id] = Open(decision.ticket, upstream, arrived, original[2], flow=flow,
                                             original=retry)
                decision = await upstream.waits.held(decision, flow.id, body if isinstance(body, bytes) else None,
                                                     time.monotonic() - arrived)
            destination = router.destination(upstream)
            await flows.apply_async(flow, decision, encoding, destination)
            if destination is not None:
                self.rt.pending[flow.client_conn.id] = flow
        except Exception as e:  # fail open: the original request goes out untouched
            self.rt.open.pop(flow.id, None)
            flow.request.raw_content, flow.request.headers.fields, flow.request.path = original
            if upstream is not None:
                if isinstance(decision, Pin | Observe):
                    upstream.abandon(decision.ticket, flow.id)
                upstream.unlock(flow.id)
            self.rt.emit(Failed(upstream.url if upstream is not None else "", Stage.REQUEST, type(e).__name__,
                                flow.request.method, flow.request.path))
            return
        if isinstance(decision, Pin | Observe):
            asked = facts.replay.path if facts.replay is not None and facts.replay.path else original[2]
            self.rt.open[flow.id] = Open(decision.ticket, upstream, arrived, asked, flow=flow, original=retry)
            if isinstance(decision, Pin):
                t = decision.ticket
                upstream.sent(flow.id, t.slot, t.session.key,
                              len(body) if isinstance(body, bytes) else 0)
        elif isinstance(decision, Forward) and decision.completion_route:
            self.rt.emit(PassedThrough(upstream.url, flow.request.method, flow.request.path, decision.reason))

    @guarded(Stage.RESPONSE_HEADERS)
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        self.rt.pending.pop(flow.client_conn.id, None)
        req = self.rt.open.get(flow.id)
        if req is None or flow.response is None:
            return
        req.upstream.unlock(flow.id)
        streamed = flow.live and flows.is_sse(flow.response)
        if streamed and flow.request.http_version == "HTTP/1.1":
            # llama-server closes the connection after a streamed answer without saying so; a client's next
            # request sent within milliseconds could go out on it and get a 502 (mitmproxy #3038). Said
            # aloud, both sides close cleanly (docs/mitmproxy.md).
            flow.response.headers["connection"] = "close"
        if not streamed and flow.live and not flow.response.raw_content:
            self._large_answer(flow, req)
        # A streamed response has no body yet; a saved flow's body is already here (read in `response`).
        if streamed and not flow.response.raw_content:
            req.stream = StreamObserver()
            keep = self._keeper_of(flow.response) if req.upstream.settings.keep_streams else None
            on_error = self._stream_error(req.upstream.url)
            converter = req.upstream.keeper.outcomes.answer_stream(req.ticket)
            # a pending request (affinity) asked for `__verbose`: stripped again (a translated answer drops it)
            strip = VerboseStripper() if req.ticket.learn is Learn.VERBOSE and converter is None else None
            flow.response.stream = (SSETap(req.stream, keep, on_error=on_error, strip=strip) if converter is None
                                    else TranslatingTap(req.stream, converter, keep, on_error=on_error))
            if (converter is not None or strip is not None) and "content-length" in flow.response.headers:
                # the client's body is not the server's: its length is unknown until the end (chunked)
                del flow.response.headers["content-length"]
                if flow.request.http_version == "HTTP/1.1":
                    flow.response.headers["transfer-encoding"] = "chunked"

    @staticmethod
    def _large_answer(flow: http.HTTPFlow, req: Any) -> None:
        """An answer that is not a stream and announces more than `slots_max_body_mb` is not buffered
        (mitmproxy buffers every answer it does not stream: a 1 GB answer cost 3.6 GB): it passes through
        unobserved, or, for a translated request, whose answer would have to be converted whole, becomes a 502
        with Anthropic's error body. An answer of unknown length stays buffered (docs/mitmproxy.md)."""
        assert flow.response is not None
        length = flows.get(flow.response.headers.fields, b"content-length")
        try:
            size = int(length) if length is not None else None
        except ValueError:
            size = None
        if size is None or size <= req.upstream.settings.max_body_bytes:
            return
        if not req.ticket.translated:
            flow.response.stream = True
            return
        flow.response.status_code = 502
        flow.response.headers["content-type"] = "application/json"
        del flow.response.headers["content-length"]
        if flow.request.http_version == "HTTP/1.1":
            flow.response.headers["transfer-encoding"] = "chunked"
        body = anthropic_answer.error_json(anthropic_answer.TOO_LARGE_ANSWER)
        flow.response.stream = lambda chunk: [] if chunk else body
        req.ended = "too-large"

    @guarded(Stage.RESPONSE)
    def response(self, flow: http.HTTPFlow) -> None:
        req = self.rt.open.pop(flow.id, None)
        if req is None or flow.response is None:
            return
        obs = observe_response(flow.response, req.stream)
        if req.ended == "too-large":
            obs.error_type = req.ended
        elif flow.error is not None and not obs.complete:  # a saved flow cut mid-answer: as the live proxy saw it
            obs.error_type = obs.error_type or "transport"
        elif req.stream is not None and not obs.complete:  # a clean end without finish_reason or [DONE]
            obs.error_type = obs.error_type or "truncated"
        if req.stream is None and flow.live and flow.response.raw_content is not None:
            answer = req.upstream.keeper.outcomes.answer_body(req.ticket, flow.response.status_code,
                                                     flows.response_body(flow.response))
            if answer is not None:  # a translated request: the native route's answer
                flow.response.status_code, flow.response.content = answer
                if answer[0] == 502:
                    flow.response.headers["content-type"] = "application/json"
                    obs.error_type = obs.error_type or "unreadable"
            elif req.ticket.learn is Learn.VERBOSE and flow.response.raw_content:
                self._strip_verbose(flow, req.upstream.url)
        self._finish(flow, req, obs)

    @guarded(Stage.RESPONSE)
    def error(self, flow: http.HTTPFlow) -> None:
        self.rt.pending.pop(flow.client_conn.id, None)
        req = self.rt.open.pop(flow.id, None)
        if req is None:
            return
        req.upstream.unlock(flow.id)
        obs = req.stream.obs if req.stream else Observation()
        if not obs.complete:  # a client that hangs up after the answer's end (Codex does) lost nothing
            obs.error_type = obs.error_type or req.ended or _transport(flow)
        tap = flow.response.stream if flow.response is not None else None
        if isinstance(tap, SSETap):
            tap.finish()  # what was streamed before the cut goes into the recording
        self._finish(flow, req, obs)

    async def server_connect(self, data: Any) -> None:
        """mitmproxy is about to open a connection to a server of the pool. A server that refuses it is
        marked down, and the request that needs it goes to another server: nothing was sent yet, so it is
        retried once, whole (a stream already under way is never replayed: it has its connection)."""
        pool = self.rt.pool
        if pool is None or data.server.address is None:
            return
        member = pool.member_at(data.server.address)
        if member is None or (member.health.up and await pool.health.connect_check(member)):
            return
        flow = self.rt.pending.pop(data.client.id, None)
        try:
            target = await self._reroute(flow, member) if flow is not None else None
        except Exception as e:  # fail open: the connection goes where it was going
            self.rt.emit(Failed(member.url, Stage.REQUEST, type(e).__name__))
            return
        if target is not None:
            data.server.address = target.address
            self.rt.emit(RetriedElsewhere(member.url, target.url))

    async def _reroute(self, flow: http.HTTPFlow, dead: Any) -> Any:
        pool = self.rt.pool
        assert pool is not None
        if flow.metadata.get("slotkeeper_retried"):
            return None
        flow.metadata["slotkeeper_retried"] = True
        req = self.rt.open.pop(flow.id, None)
        if req is not None:
            req.upstream.unlock(flow.id)
            req.upstream.ended(flow.id)
            pool.ended(req.upstream)
            if req.original is not None:
                flow.request.raw_content, flow.request.headers.fields, flow.request.path = req.original
        original = flow.request.raw_content, flow.request.headers.fields, flow.request.path
        # The same capped decode as the first attempt (never mitmproxy's uncapped decoder on the event loop).
        encoding = flows.get(original[1], b"content-encoding")
        body = await body_decode.request_body(original[0], encoding, self.rt.settings.max_body_bytes)
        if body is body_decode.TOO_LARGE_BODY:
            return None
        upstream, decision = await pool.decide(flows.request_facts(flow, body), flow.id, avoid=dead)
        member = pool.member_of(upstream)
        if member is dead or not member.health.up:
            return None
        await flows.apply_async(flow, decision, encoding, member.url)
        if isinstance(decision, Pin | Observe):
            if decision.ticket.why is not None or decision.ticket.unpinned is None:
                pool.count_retry(upstream)
            self.rt.open[flow.id] = Open(decision.ticket, upstream, time.monotonic(), original[2], flow=flow,
                                         original=original)
        return member

    def done(self) -> None:
        if self.rt.pool is not None:
            self.rt.pool.health.close()
        for up in self.rt.all_upstreams():
            up.close_sync()

    # ------------------------------------------------------------------------------------------- helpers

    def _finish(self, flow: http.HTTPFlow, req: Open, obs: Observation) -> None:
        req.upstream.ended(flow.id)
        report = req.upstream.answered(req.ticket, obs, path=req.path, seconds=time.monotonic() - req.started)
        flow.metadata["slotkeeper"] = report.metadata
        self.rt.finished(flow.id, report)

    def _strip_verbose(self, flow: http.HTTPFlow, url: str) -> None:
        """The JSON answer of a pending request without the `__verbose` member the proxy asked for (the body is
        still buffered here, so the client gets it stripped). Fails open: the member stays."""
        assert flow.response is not None
        try:
            body = flows.content(flow.response) or b""
            stripped = verbose.strip(body)
            if stripped != body:
                flows.set_content(flow.response, stripped)
        except Exception as e:
            self.rt.emit(Failed(url, Stage.RESPONSE, type(e).__name__, path=flow.request.path))

    @staticmethod
    def _keeper_of(response: http.Response) -> Any:
        def keep(body: bytes) -> None:
            response.data.content = body  # raw bytes, headers untouched
        return keep

    def _stream_error(self, url: str) -> Any:
        stages = {"observer": Stage.OBSERVER, "copy": Stage.STREAM_COPY, "convert": Stage.CONVERT,
                  "strip": Stage.STREAM_STRIP}

        def on_error(part: str, kind: str) -> None:
            self.rt.emit(Failed(url, stages[part], kind))
        return on_error


def _transport(flow: http.HTTPFlow) -> str:
    """Which side cut a request off: `client-gone` when the client hung up (its connection can no longer be
    read: mitmproxy clears `CAN_READ` when the client's end closes, before the error hook; proxy/server.py),
    else `transport`. A label for the log line; the state is a typed fact, not the error's words."""
    gone = flow.live and not flow.client_conn.state & ConnectionState.CAN_READ  # a loaded flow keeps no state
    return "client-gone" if gone else "transport"


def observe_response(response: http.Response, stream: StreamObserver | None) -> Observation:
    """The server's numbers from an answer: the live stream's observer, a saved stream's kept copy, or a
    JSON body."""
    if stream is not None:
        obs = stream.obs
    elif response.raw_content is not None and flows.is_sse(response):
        replayed = StreamObserver()  # a saved stream (kept copy): parse it as the live tap did
        replayed.feed(flows.response_body(response))
        replayed.feed(b"")
        obs = replayed.obs
    elif response.raw_content is not None:
        obs = observe_json(flows.response_body(response))
    else:
        obs = Observation()
    if response.status_code >= 400 and obs.error_type is None:
        obs.error_type = f"http-{response.status_code}"
    return obs


def _bindable(host: str, port: int) -> bool:
    """Whether a listening socket can be opened on (host, port) now (another process may hold the port)."""
    try:
        with socket.create_server((host or "127.0.0.1", port)):
            return True
    except OSError:
        return False
