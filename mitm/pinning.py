"""The pinning addon: each completion request goes to its session's slot; each answer is read.

Its options are the core's: how slots are chosen, where the shared state lives, checkpoints and paging.
`configure` validates them once and builds one frozen `Settings`; the hooks are guards plus one call to the
request's `Upstream` (drivers/upstream.py), which asks the pure core (slotlogic/keeper.py) and performs what
it decides.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from mitmproxy import ctx, exceptions, http
from mitmproxy.proxy.mode_specs import ProxyMode, ReverseMode

from drivers import body_decode, private_dir
from drivers.store import parse_url
from drivers.store_file import default_state_dir
from mitm import flows
from mitm.runtime import Open, Runtime, guarded
from mitm.sse_tap import SSETap, TranslatingTap
from slotlogic import prefix as pfx
from slotlogic import session as sess
from slotlogic import sidecalls, verbose
from slotlogic.affinity import Learn
from slotlogic.answers import Observation, StreamObserver, observe_json
from slotlogic.decisions import Forward, Observe, Pin
from slotlogic.events import Failed, PassedThrough, RetriedElsewhere, Stage
from slotlogic.model_facts import CACHE_TYPES
from slotlogic.ranking import Policy
from slotlogic.reasons import Passed
from slotlogic.settings import AnthropicMode, CheckpointMode, Settings
from slotlogic.verbose import VerboseStripper

log = logging.getLogger("slotkeeper")
TOO_LARGE = object()  # a body past slots_max_body_mb: passed through untouched, unread


class Pinning:
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def load(self, loader: Any) -> None:
        loader.add_option("slots_policy", str, "auto",
                          "How a new session's slot is chosen: auto (prefix-aware, busy-aware), seed (seed "
                          "000's ranking), affinity (llama-server chooses on the first request, id_slot -1; "
                          "the proxy pins the slot it chose), off (observe and log only, rewrite nothing).",
                          choices=[p.value for p in Policy])
        loader.add_option("slots_state_dir", str, "",
                          "Directory of the shared state files (one per upstream server). Default: "
                          "$XDG_STATE_HOME/slotkeeper (~/.local/state/slotkeeper).")
        loader.add_option("slots_ttl", int, 120,
                          "Seconds after its last request that a session's claim on its slot expires.")
        loader.add_option("slots_override_client", bool, False,
                          "Replace a client's own valid id_slot instead of respecting it.")
        loader.add_option("slots_session_headers", Sequence[str], list(sess.DEFAULT_SESSION_HEADERS),
                          "Request headers that carry a session id, most reliable first (repeat --set).")
        loader.add_option("slots_side_patterns", Sequence[str], list(sidecalls.DEFAULT_SIDE_PATTERNS),
                          "Regexes on the system prompt that mark side calls (compaction, titles); they go "
                          "to one reserved slot when the server has 2 or more slots.")
        loader.add_option("slots_side_slot", int, -1,
                          "The slot reserved for side calls; -1 = the highest slot id.")
        loader.add_option("slots_probe_interval", int, 15,
                          "Seconds between background /props probes that detect a restarted or resized "
                          "server (0 = only when a cache loss needs explaining).")
        loader.add_option("slots_prefix_cache", str, "",
                          "Prefix checkpoints for new sessions: off, memory (warm, no disk), disk (save, "
                          "restore, verify). Empty = disk when slots_save_dir is set, else off.",
                          choices=["", *(m.value for m in CheckpointMode)])
        loader.add_option("slots_save_dir", str, "",
                          "llama-server's --slot-save-path (the same directory), for checkpoint files and their "
                          "cleanup.")
        loader.add_option("slots_paging", bool, True,
                          "Session paging (needs slots_save_dir): before a slot goes to another session, save "
                          "its holder's conversation there; when that session returns, restore it instead of "
                          "prefilling it again.")
        loader.add_option("slots_page_max_mb", int, 8192,
                          "Cap on session page files in slots_save_dir; the least recently saved go first.")
        loader.add_option("slots_server_id", str, "",
                          "Your name for the llama-server build; part of the checkpoint fingerprint (bump it "
                          "after an upgrade to force one clean rebuild).")
        loader.add_option("slots_prefix_markers", Sequence[str], list(pfx.DEFAULT_MARKERS),
                          "Where the shared system-prompt prefix ends: the earliest of these strings.")
        loader.add_option("slots_checkpoint_ttl_days", int, 30,
                          "Cleanup keeps checkpoint files used within this many days.")
        loader.add_option("slots_checkpoint_keep", int, 3,
                          "Cleanup always keeps this many most recently used checkpoint files.")
        loader.add_option("slots_checkpoint_max_mb", int, 0,
                          "Cap on checkpoint files in slots_save_dir (0 = no cap); the oldest go first.")
        loader.add_option("slots_anthropic", str, "translate",
                          "Anthropic /v1/messages requests (Claude Code): translate (send as a pinned chat "
                          "completion and convert the answer back; switches to native by itself when the server "
                          "honours id_slot there), native (pass through with id_slot added), off (observe only).",
                          choices=[m.value for m in AnthropicMode])
        loader.add_option("slots_strip_billing", bool, True,
                          "Drop Claude Code's x-anthropic-billing-header system block (vendor billing metadata "
                          "whose suffix changes per session) before llama-server sees it, so sessions share "
                          "their system prompt's cache.")
        loader.add_option("slots_prefix_min_chars", int, 512,
                          "The shortest stable prefix learned from traffic (for clients without a marker).")
        loader.add_option("slots_state_max_sessions", int, 256,
                          "Sessions kept in the state file (the most recently used, and every slot's owner); a "
                          "new session's locked read-modify-write costs what the file holds.")
        loader.add_option("slots_max_body_mb", int, 64,
                          "Request bodies larger than this (after gzip/deflate/br/zstd decoding) pass untouched "
                          "and unpinned; larger encoded bodies are decoded in a worker thread, never inflated "
                          "on the event loop beyond a small size.")
        loader.add_option("slots_api_key", str, "",
                          "llama-server's --api-key, for the proxy's own calls (/props, /slots, slot save/restore, "
                          "warm-ups). Empty: the Authorization or X-Api-Key header a client sent to that server. "
                          "Never logged or written to a file.")
        loader.add_option("slots_swa_full", bool, False,
                          "llama-server runs with --swa-full: a sliding-window model's restored slot files can "
                          "resume, so session pages and checkpoint files stay on for it (docs/model-capability.md).")
        loader.add_option("slots_cache_type", str, "f16",
                          "llama-server's KV cache type (-ctk/-ctv), for the model's KV and slot-file sizes: one "
                          "type for both, or K,V (e.g. q8_0,f16).")
        loader.add_option("slots_throughput_probe", bool, False,
                          "At start, one short completion of the proxy's own text into an empty slot measures "
                          "prefill and decode speed (status view; prefill seconds saved for answers without "
                          "timings).")
        loader.add_option("slots_upstreams", Sequence[str], [],
                          "More llama-servers (or llama-swap URLs) serving the same model, behind this one "
                          "endpoint (repeat --set); the reverse-mode target is the first. Each request goes to "
                          "its session's server and slot; a new session to the cheapest server.")
        loader.add_option("slots_state_url", str, "",
                          "Where the shared state lives: file://DIR (the default: slots_state_dir) or "
                          "redis://host:port/db, rediss://… (Redis or Valkey, shared by proxies on several "
                          "machines).")
        loader.add_option("slots_health_interval", int, 5,
                          "Seconds between /health checks of each server of slots_upstreams (a down server is "
                          "asked again with back-off).")
        loader.add_option("slots_keep_streams", bool, False,
                          "Keep a copy of streamed SSE bodies in the flow (for -w recordings, mitmweb and "
                          "server replay on mitmproxy 11; on 12.x store_streamed_bodies does the same).")

    def configure(self, updated: set[str]) -> None:
        if not any(name.startswith("slots_") or name == "mode" for name in updated):
            return
        settings, state_dir = build_settings(ctx.options)
        o = ctx.options
        fronted = fronted_upstreams(o.mode)
        try:
            parse_url(o.slots_state_url, state_dir)
        except ValueError as e:
            raise exceptions.OptionsError(f"slots_state_url: {e}") from None
        if o.slots_health_interval < 1:
            raise exceptions.OptionsError("slots_health_interval must be ≥ 1")
        servers = server_list(o.mode, o.slots_upstreams)
        self.rt.configure(settings, state_dir, fronted, state_url=o.slots_state_url, servers=servers,
                          health_interval=float(o.slots_health_interval))

    def running(self) -> None:
        """At start, each server this proxy fronts is probed before the first request comes (whether
        /v1/messages honours id_slot; `/props` and the model check), in background tasks (a sync hook)."""
        for url in self.rt.fronted:
            self.rt.upstream(url).start()

    # ------------------------------------------------------------------------------------------- hooks

    async def request(self, flow: http.HTTPFlow) -> None:
        if (flow.live and (flow.response or flow.error)) or flow.request.method != "POST":
            return  # answered already (the local API), or a saved flow (-nr) that carries its answer
        original = flow.request.raw_content, flow.request.headers.fields, flow.request.path
        pool = self.rt.pool if flow.live and self.rt.pool is not None and self.rt.pool.fronts(
            flows.upstream_url(flow)) else None
        upstream = self.rt.upstream(flows.upstream_url(flow), live=flow.live) if pool is None else None
        decision = None
        try:
            encoding = flows.get(original[1], b"content-encoding")
            limit = (upstream.settings if upstream is not None else self.rt.settings).max_body_bytes
            body = await self._body(original[0], encoding, limit)
            if body is TOO_LARGE:
                self.rt.emit(PassedThrough(upstream.url if upstream is not None else flows.upstream_url(flow),
                                           flow.request.method, flow.request.path, Passed.TOO_LARGE))
                return
            facts = flows.request_facts(flow, body)
            if pool is not None:
                upstream, decision = await pool.decide(facts, flow.id)
                flows.set_destination(flow, pool.member_of(upstream).url)
                self.rt.pending[flow.client_conn.id] = flow
            else:
                assert upstream is not None
                decision = await upstream.decide(facts, flow.id)
            await self._apply(flow, decision, encoding)
        except Exception as e:  # fail open: the original request goes out untouched
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
            self.rt.open[flow.id] = Open(decision.ticket, upstream, time.monotonic(), asked, flow=flow,
                                         original=original if pool is not None else None)
        elif isinstance(decision, Forward) and decision.completion_route:
            self.rt.emit(PassedThrough(upstream.url, flow.request.method, flow.request.path, decision.reason))

    @guarded(Stage.RESPONSE_HEADERS)
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        self.rt.pending.pop(flow.client_conn.id, None)
        req = self.rt.open.get(flow.id)
        if req is None or flow.response is None:
            return
        req.upstream.unlock(flow.id)
        # A streamed response has no body yet; a saved flow's body is already here (read in `response`).
        if flow.live and flows.is_sse(flow.response) and not flow.response.raw_content:
            req.stream = StreamObserver()
            keep = self._keeper_of(flow.response) if req.upstream.settings.keep_streams else None
            on_error = self._stream_error(req.upstream.url)
            converter = req.upstream.keeper.answer_stream(req.ticket)
            # a pending request (affinity) asked for `__verbose`: stripped again (a translated answer drops it)
            strip = VerboseStripper() if req.ticket.learn is Learn.VERBOSE and converter is None else None
            flow.response.stream = (SSETap(req.stream, keep, on_error=on_error, strip=strip) if converter is None
                                    else TranslatingTap(req.stream, converter, keep, on_error=on_error))

    @guarded(Stage.RESPONSE)
    def response(self, flow: http.HTTPFlow) -> None:
        req = self.rt.open.pop(flow.id, None)
        if req is None or flow.response is None:
            return
        obs = observe_response(flow.response, req.stream)
        if flow.error is not None:  # a saved flow whose client went away mid-answer: as the live proxy saw it
            obs.error_type = obs.error_type or "transport"
        if req.stream is None and flow.live and flow.response.raw_content is not None:
            answer = req.upstream.keeper.answer_body(req.ticket, flow.response.status_code,
                                                     flows.response_body(flow.response))
            if answer is not None:
                flow.response.content = answer  # a translated request: the native route's answer
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
        obs.error_type = obs.error_type or req.ended or "transport"
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
        if member is None or (member.health.up and await pool.connect_check(member)):
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
            pool.ended(req.upstream)
            if req.original is not None:
                flow.request.raw_content, flow.request.headers.fields, flow.request.path = req.original
        original = flow.request.raw_content, flow.request.headers.fields, flow.request.path
        upstream, decision = await pool.decide(flows.request_facts(flow), flow.id, avoid=dead)
        member = pool.member_of(upstream)
        if member is dead or not member.health.up:
            return None
        flows.set_destination(flow, member.url)
        await self._apply(flow, decision, flows.get(original[1], b"content-encoding"))
        if isinstance(decision, Pin | Observe):
            if decision.ticket.why is not None or decision.ticket.unpinned is None:
                pool.count_retry(upstream)
            self.rt.open[flow.id] = Open(decision.ticket, upstream, time.monotonic(), original[2], flow=flow,
                                         original=original)
        return member

    def done(self) -> None:
        if self.rt.pool is not None:
            self.rt.pool.close()
        for up in self.rt.all_upstreams():
            up.close_sync()

    # ------------------------------------------------------------------------------------------- helpers

    @staticmethod
    async def _body(raw: bytes | None, encoding: bytes | None, limit: int) -> bytes | object | None:
        """The decoded body (None when absent or badly encoded), or TOO_LARGE past `slots_max_body_mb`. An
        encoded body is decoded with a cap, and in a worker thread unless it is small (body_decode)."""
        if raw is None:
            return None
        if not encoding:
            return TOO_LARGE if len(raw) > limit else raw
        try:
            return await body_decode.decode_async(raw, encoding.decode("latin-1"), limit)
        except body_decode.TooLarge:
            return TOO_LARGE
        except ValueError:
            return None

    @staticmethod
    async def _apply(flow: http.HTTPFlow, decision: Any, encoding: bytes | None) -> None:
        """The decision's body onto the flow; an encoded body encoded again the same way (off the event loop
        when it is large)."""
        if encoding and isinstance(decision, Pin | Observe) and decision.body is not None:
            flows.set_raw(flow.request, await body_decode.encode_async(decision.body, encoding.decode("latin-1")))
            if isinstance(decision, Pin) and decision.path is not None:
                flow.request.path = decision.path  # a translated request's route
            return
        flows.apply(flow, decision)

    def _finish(self, flow: http.HTTPFlow, req: Open, obs: Observation) -> None:
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


def build_settings(o: Any) -> tuple[Settings, Path]:
    """The options as one frozen `Settings` (and the state dir), or `OptionsError` naming the bad option."""
    try:
        policy = Policy(o.slots_policy)
    except ValueError:
        raise exceptions.OptionsError(
            f"slots_policy must be one of {[p.value for p in Policy]}, not {o.slots_policy!r}") from None
    if o.slots_ttl <= 0:
        raise exceptions.OptionsError("slots_ttl must be a positive number of seconds")
    if o.slots_side_slot < -1:
        raise exceptions.OptionsError("slots_side_slot must be -1 (automatic) or a slot id")
    if o.slots_probe_interval < 0:
        raise exceptions.OptionsError("slots_probe_interval must be ≥ 0")
    try:
        patterns = tuple(sidecalls.compile_patterns(o.slots_side_patterns))
    except ValueError as e:
        raise exceptions.OptionsError(f"slots_side_patterns: {e}") from None
    headers = tuple(h.strip().lower() for h in o.slots_session_headers if h.strip())
    markers = tuple(m.encode().decode("unicode_escape") for m in o.slots_prefix_markers if m)
    save_dir = os.path.expanduser(o.slots_save_dir) if o.slots_save_dir else None
    try:
        mode = CheckpointMode(o.slots_prefix_cache or ("disk" if save_dir else "off"))
    except ValueError:
        raise exceptions.OptionsError(
            f"slots_prefix_cache must be off, memory or disk, not {o.slots_prefix_cache!r}") from None
    if save_dir and (mode is CheckpointMode.DISK or o.slots_paging) and not os.path.isdir(save_dir):
        raise exceptions.OptionsError(f"slots_save_dir {o.slots_save_dir!r} is not a directory")
    try:
        anthropic_mode = AnthropicMode(o.slots_anthropic)
    except ValueError:
        raise exceptions.OptionsError(
            f"slots_anthropic must be translate, native or off, not {o.slots_anthropic!r}") from None
    if o.slots_prefix_min_chars < 1:
        raise exceptions.OptionsError("slots_prefix_min_chars must be ≥ 1")
    if o.slots_page_max_mb < 1:
        raise exceptions.OptionsError("slots_page_max_mb must be ≥ 1 (turn paging off with slots_paging)")
    if min(o.slots_checkpoint_ttl_days, o.slots_checkpoint_keep, o.slots_checkpoint_max_mb) < 0:
        raise exceptions.OptionsError("slots_checkpoint_* options must be ≥ 0")
    if o.slots_state_max_sessions < 16:
        raise exceptions.OptionsError("slots_state_max_sessions must be ≥ 16")
    if o.slots_max_body_mb < 1:
        raise exceptions.OptionsError("slots_max_body_mb must be ≥ 1")
    types = [t.strip().lower() for t in o.slots_cache_type.split(",")]
    if len(types) not in (1, 2) or any(t not in CACHE_TYPES for t in types):
        raise exceptions.OptionsError(f"slots_cache_type must be one of {', '.join(CACHE_TYPES)}, or two of them "
                                      f"as K,V; not {o.slots_cache_type!r}")
    settings = Settings(
        policy=policy, ttl=float(o.slots_ttl), override_client=o.slots_override_client, session_headers=headers,
        side_patterns=patterns, side_slot=o.slots_side_slot, markers=markers or pfx.DEFAULT_MARKERS,
        checkpoints=mode, save_dir=save_dir, paging=bool(o.slots_paging and save_dir),
        page_max_bytes=o.slots_page_max_mb << 20, server_id=o.slots_server_id,
        checkpoint_ttl_days=float(o.slots_checkpoint_ttl_days), checkpoint_keep=o.slots_checkpoint_keep,
        checkpoint_max_bytes=o.slots_checkpoint_max_mb << 20, probe_interval=float(o.slots_probe_interval),
        keep_streams=o.slots_keep_streams, anthropic=anthropic_mode, strip_billing=o.slots_strip_billing,
        prefix_min_chars=o.slots_prefix_min_chars, state_max_sessions=o.slots_state_max_sessions,
        max_body_bytes=o.slots_max_body_mb << 20, api_key=o.slots_api_key.strip(), swa_full=o.slots_swa_full,
        cache_type_k=types[0], cache_type_v=types[-1], throughput_probe=o.slots_throughput_probe)
    state_dir = Path(o.slots_state_dir).expanduser() if o.slots_state_dir else default_state_dir()
    try:
        private_dir.check(state_dir)  # created 0700 on first use when missing; an existing one is never chmod-ed
    except private_dir.UnsafeDir as e:
        raise exceptions.OptionsError(f"slots_state_dir: {e}") from None
    return settings, state_dir


def server_list(modes: Sequence[str], extra: Sequence[str]) -> list[str]:
    """The servers of a pool: the reverse-mode target first, then `slots_upstreams` (each once)."""
    out: list[str] = []
    for url in [*sorted(fronted_upstreams(modes)), *(u.strip().rstrip("/") for u in extra if u.strip())]:
        p = urlsplit(url)
        if p.scheme not in ("http", "https") or not p.hostname:
            raise exceptions.OptionsError(f"slots_upstreams: {url!r} is not an http(s):// URL")
        base = f"{p.scheme}://{p.hostname}:{p.port or (443 if p.scheme == 'https' else 80)}"
        if base not in out:
            out.append(base)
    return out if extra else []


def fronted_upstreams(modes: Sequence[str]) -> frozenset[str]:
    """`scheme://host:port` of every reverse-mode upstream in the `mode` option."""
    out = set()
    for spec in modes:
        try:
            m = ProxyMode.parse(spec)
        except ValueError:
            continue
        if isinstance(m, ReverseMode):
            host, port = m.address
            out.add(f"{m.scheme}://{host}:{port}")
    return frozenset(out)
