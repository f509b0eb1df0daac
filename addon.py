"""slotkeeper: a mitmproxy addon that pins every agent session to its own llama-server KV-cache slot.

    mitmdump -s addon.py --mode reverse:http://127.0.0.1:8080@127.0.0.1:8081 --set connection_strategy=lazy

This file is the thin adapter (options, hooks, commands). Decisions live in the pure package `slotlogic`;
I/O (httpx to llama-server, the locked state file) lives in `drivers/`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `mitmdump -s` from any cwd

from mitmproxy import command, ctx, exceptions, http
from mitmproxy.proxy.mode_specs import ProxyMode, ReverseMode

from drivers import raw_headers
from drivers.checkpoints import CheckpointSettings
from drivers.flow_state import FlowInfo, RequestLog, SSETap
from drivers.server_runtime import ServerRuntime
from drivers.state_store import default_state_dir
from slotlogic import core, fastpath, rewrite, sidecalls
from slotlogic import prefix as pfx
from slotlogic import session as sess
from slotlogic import state as st
from slotlogic.observe import Observation, StreamObserver, observe_json
from slotlogic.ranking import Policy

log = logging.getLogger("slotkeeper")
MARKERS = {"hit": ":zap:", "partial": ":large_orange_diamond:", "miss": ":snail:", "error": ":x:",
           "unknown": ":warning:"}
LOCAL_PREFIX = "/_slots/"


class SlotKeeper:
    def __init__(self) -> None:
        self.cfg = core.Config()
        self.state_dir: Path = default_state_dir()
        self.runtimes: dict[str, ServerRuntime] = {}
        self.flows: dict[str, FlowInfo] = {}
        self.log_file: str | None = None
        self.flush_interval = 2.0
        self.probe_interval = 15.0
        self.checkpoints: CheckpointSettings | None = None
        self.page_max_mb = 8192
        self.session_headers = frozenset(h.encode() for h in sess.DEFAULT_SESSION_HEADERS)
        self.fronted: set[str] = set()
        self.keep_streams = False
        self.request_log = RequestLog("mitmproxy", "info")

    # ------------------------------------------------------------------------------------------- options

    def load(self, loader: Any) -> None:
        loader.add_option("slots_policy", str, "auto",
                          "How a new session's slot is chosen: auto (prefix-aware, busy-aware), seed (seed "
                          "000's ranking), off (observe and log only, rewrite nothing).",
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
                          choices=["", "off", "memory", "disk"])
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
        loader.add_option("slots_keep_streams", bool, False,
                          "Keep a copy of streamed SSE bodies in the flow (for -w recordings, mitmweb and "
                          "server replay on mitmproxy 11; on 12.x store_streamed_bodies does the same).")
        loader.add_option("slots_log_requests", str, "direct",
                          "Where the per-request line goes: direct (straight to the terminal, cheap: mitmproxy's "
                          "log pipeline costs ~0.15 ms a line), mitmproxy (through mitmproxy's log, e.g. to "
                          "mitmweb's event log), off.", choices=["direct", "mitmproxy", "off"])
        loader.add_option("slots_log_file", str, "",
                          "Append one JSON line per completion request to this file (hashes, counts).")

    def configure(self, updated: set[str]) -> None:
        if not any(name.startswith("slots_") or name == "mode" for name in updated):
            return
        o = ctx.options
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
        mode = o.slots_prefix_cache or ("disk" if o.slots_save_dir else "off")
        if mode not in ("off", "memory", "disk"):
            raise exceptions.OptionsError(f"slots_prefix_cache must be off, memory or disk, not {mode!r}")
        uses_dir = mode == "disk" or o.slots_paging
        if uses_dir and o.slots_save_dir and not os.path.isdir(os.path.expanduser(o.slots_save_dir)):
            raise exceptions.OptionsError(f"slots_save_dir {o.slots_save_dir!r} is not a directory")
        if o.slots_page_max_mb < 1:
            raise exceptions.OptionsError("slots_page_max_mb must be ≥ 1 (turn paging off with slots_paging)")
        if min(o.slots_checkpoint_ttl_days, o.slots_checkpoint_keep, o.slots_checkpoint_max_mb) < 0:
            raise exceptions.OptionsError("slots_checkpoint_* options must be ≥ 0")
        self.checkpoints = CheckpointSettings(
            mode=mode, save_dir=os.path.expanduser(o.slots_save_dir) if o.slots_save_dir else None,
            server_id=o.slots_server_id, markers=markers or pfx.DEFAULT_MARKERS,
            ttl_days=float(o.slots_checkpoint_ttl_days), keep_recent=o.slots_checkpoint_keep,
            max_mb=o.slots_checkpoint_max_mb)
        self.fronted = fronted_upstreams(o.mode)
        self.cfg = core.Config(policy=policy, ttl=float(o.slots_ttl),
                               override_client=o.slots_override_client, header_names=headers,
                               side_patterns=patterns, side_slot=o.slots_side_slot,
                               markers=markers or pfx.DEFAULT_MARKERS,
                               paging=bool(o.slots_paging and o.slots_save_dir))
        self.page_max_mb = o.slots_page_max_mb
        self.session_headers = frozenset(h.encode("latin-1") for h in headers)
        self.state_dir = Path(o.slots_state_dir).expanduser() if o.slots_state_dir else default_state_dir()
        self.probe_interval = float(o.slots_probe_interval)
        self.log_file = o.slots_log_file or None
        if o.slots_log_requests not in ("direct", "mitmproxy", "off"):
            raise exceptions.OptionsError("slots_log_requests must be direct, mitmproxy or off")
        self.request_log = RequestLog(o.slots_log_requests, getattr(o, "termlog_verbosity", "info"))
        self.keep_streams = o.slots_keep_streams
        for rt in self.runtimes.values():
            if rt.offline:
                continue
            rt.reconfigure(self.cfg, self.state_dir)
            rt.probe_interval = self.probe_interval
            rt.enable_checkpoints(self.checkpoint_settings(rt.upstream), self.state_dir)
            rt.enable_paging(self.page_dir(rt.upstream), self.page_max_mb)

    def checkpoint_settings(self, upstream: str) -> CheckpointSettings | None:
        """Checkpoints act only for a server this proxy fronts in reverse mode (never for other hosts)."""
        return self.checkpoints if upstream in self.fronted else None

    def page_dir(self, upstream: str) -> str | None:
        """Paging, like checkpoints, acts only for a server this proxy fronts in reverse mode."""
        return self.checkpoints.save_dir if self.checkpoints and upstream in self.fronted else None

    def runtime(self, upstream: str, *, offline: bool = False) -> ServerRuntime:
        """The driver for one upstream. Saved flows (`mitmdump -nr`) get a separate offline runtime with a
        throw-away state dir: a replay never touches the network or the live state."""
        key = f"replay:{upstream}" if offline else upstream
        rt = self.runtimes.get(key)
        if rt is None:
            state_dir = Path(tempfile.mkdtemp(prefix="slotkeeper-replay-")) if offline else self.state_dir
            rt = ServerRuntime(upstream, state_dir, self.cfg, flush_interval=self.flush_interval,
                               probe_interval=self.probe_interval)
            rt.offline = offline
            if not offline:
                rt.enable_checkpoints(self.checkpoint_settings(upstream), self.state_dir)
                rt.enable_paging(self.page_dir(upstream), self.page_max_mb)
            rt.log_event = self.write_jsonl
            self.runtimes[key] = rt
        return rt

    # ------------------------------------------------------------------------------------------- hooks

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.live and (flow.response or flow.error):  # a saved flow (-nr) carries its recorded answer
            return
        if flow.request.path.startswith(LOCAL_PREFIX):
            self.answer_local(flow)
            return
        original = flow.request.raw_content
        original_fields = flow.request.headers.fields  # an immutable tuple: a free snapshot
        try:
            await self._request(flow)
        except Exception as e:  # fail open: the original request goes out untouched
            flow.request.headers.fields = original_fields
            flow.request.raw_content = original
            self.release(flow)
            self.flows.pop(flow.id, None)
            log.warning("slotkeeper: internal error on %s %s, forwarded unchanged: %r",
                        flow.request.method, flow.request.path, e)

    async def _request(self, flow: http.HTTPFlow) -> None:
        req = flow.request
        if req.method != "POST":
            return
        upstream = f"{req.scheme}://{req.host}:{req.port}"
        rt = self.runtime(upstream, offline=not flow.live)
        # The request's own start time: live it is now; replaying saved flows it keeps the recorded clock.
        now = req.timestamp_start or time.time()
        recorded = flow.metadata.get("slotkeeper") if not flow.live else None
        known = self.recognise(flow, rt, now) if flow.live and rt.shapes else None
        if known is not None:
            content, body, plan = known
        else:
            content, body = read_json(req)  # decoded once: a gzip body is not inflated twice on the hot path
            if isinstance(recorded, dict) and isinstance(body, dict):
                body = restore_client_fields(body, recorded.get("client"))  # undo our own rewrite
                client = recorded.get("client")
                if isinstance(client, dict) and client.get("id_slot") is None and client.get("cache_prompt") is None:
                    original = rewrite.unsplice(content)
                    if original is not None:
                        req.content = content = original  # the client's bytes, so the replayed rewrite matches
            plan = core.plan(self.cfg, rt.table, req.method, req.path, LowerHeaders(req.headers), body, now,
                             total_slots=rt.total_slots, known_prompts=rt.marks)
            if plan.kind == "pass":
                if plan.route.value != "other":
                    log.info("slotkeeper: %s %s passed through: %s", req.method, req.path, plan.reason)
                return
            if flow.live and plan.session is not None and fastpath.fields_absent(body):
                rt.shapes.learn(req.path, content, plan.session, plan.side)
        info = FlowInfo(plan=plan, upstream=upstream, started=time.monotonic(), reason=plan.reason)
        self.flows[flow.id] = info
        assert plan.session is not None and isinstance(body, dict)
        info.client_fields = {k: body.get(k) for k in ("id_slot", "cache_prompt")}
        rt.remember_prompt(plan.session.key, sess.prompt_mark(body))
        if plan.kind == "observe":
            return
        slot = plan.slot
        if plan.kind == "need_slot":
            choice, info.facts = await rt.new_session(
                plan, now, facts=recorded.get("facts") if isinstance(recorded, dict) else None, flow_id=flow.id)
            if choice is None:
                info.reason = "unpinned: server unknown"
                return
            slot = choice.slot
            info.reason = f"displaced:{choice.reason}" if plan.reason == "displaced" else choice.reason
        assert slot is not None
        total = rt.total_slots or slot + 1
        result = rewrite.pin(body, slot, total, override_client=self.cfg.override_client)
        info.slot = result.slot
        if result.client_slot_kept and result.slot != slot:
            info.reason = "client-id_slot"
        rt.table.dispatch("" if info.reason == "side-call" else plan.session.key, result.slot)
        if plan.side:
            rt.table.side_call(now)
        if plan.session.key in rt.table.sessions:  # side calls on the reserved slot are not sessions
            rt.use(plan.session.key, now)
        if result.changed:
            raw_headers.set_content(req, rewrite.splice(content, body, result) or json.dumps(
                result.body, ensure_ascii=False, separators=(",", ":")).encode())

    def release(self, flow: http.HTTPFlow) -> None:
        """Let the next pager of this flow's slot go: the request has reached the server, or never will."""
        info = self.flows.get(flow.id)
        rt = self.runtimes.get(info.upstream) if info is not None and flow.live else None
        if rt is not None and rt.pager is not None:
            rt.release_slot(flow.id)

    def recognise(self, flow: http.HTTPFlow, rt: ServerRuntime, now: float
                  ) -> tuple[bytes, dict[str, Any], core.Plan] | None:
        """The hot path without a parse (slotlogic/fastpath.py): a known session's next chat request, with
        an empty stand-in for the body (the byte match proved it carries no id_slot/cache_prompt)."""
        req = flow.request
        if any(k.lower() in self.session_headers for k, _ in req.headers.fields):
            return None  # a header names the session: the full path reads it
        try:
            content = raw_headers.content(req)
        except ValueError:
            return None
        shape = rt.shapes.match(req.path, content) if content else None
        plan = shape and core.plan_known_body(self.cfg, rt.table, req.path, shape.key, shape.side, now,
                                              total_slots=rt.total_slots)
        return (content, {}, plan) if plan and content else None

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        info = self.flows.get(flow.id)
        if info is None or flow.response is None:
            return
        self.release(flow)
        try:
            added = []
            if info.slot is not None:
                added.append((b"x-slot-id", str(info.slot).encode()))
            if info.plan.session is not None:
                added.append((b"x-slot-session", info.plan.session.short.encode()))
            flow.response.headers.fields += tuple(added)
            # A streamed response has no body yet; a saved flow's body is already here (parsed in `response`).
            if flow.live and raw_headers.is_sse(flow.response) and not flow.response.raw_content:
                info.stream = StreamObserver()
                keep = None
                if self.keep_streams:
                    response = flow.response

                    def keep(body: bytes, response: http.Response = response) -> None:
                        response.data.content = body  # raw bytes, headers untouched (mitmproxy.md §2.6)
                flow.response.stream = SSETap(info.stream, keep)
        except Exception as e:
            log.warning("slotkeeper: could not prepare response observation: %r", e)

    def response(self, flow: http.HTTPFlow) -> None:
        info = self.flows.pop(flow.id, None)
        if info is None or flow.response is None:
            return
        try:
            if info.stream is not None:
                obs = info.stream.obs
            elif flow.response.raw_content is not None and raw_headers.is_sse(flow.response):
                replayed = StreamObserver()  # a saved stream (kept copy): parse it as the live tap did
                replayed.feed(response_body(flow.response))
                replayed.feed(b"")
                obs = replayed.obs
            elif flow.response.raw_content is not None:
                obs = observe_json(response_body(flow.response))
            else:
                obs = Observation()
            if flow.response.status_code >= 400 and obs.error_type is None:
                obs.error_type = f"http-{flow.response.status_code}"
            self.finish(flow, info, obs)
        except Exception as e:
            log.warning("slotkeeper: could not read the response of %s: %r", flow.request.path, e)

    def error(self, flow: http.HTTPFlow) -> None:
        self.release(flow)
        info = self.flows.pop(flow.id, None)
        if info is None:
            return
        obs = info.stream.obs if info.stream else Observation()
        obs.error_type = obs.error_type or "transport"
        obs.error_message = flow.error.msg if flow.error else None
        self.finish(flow, info, obs)

    def done(self) -> None:
        self.request_log.flush()
        for rt in self.runtimes.values():
            if not rt.offline:
                rt.flush_sync()
        self.log_summary()
        for rt in self.runtimes.values():
            if rt.offline:  # a replay's throw-away state
                shutil.rmtree(rt.store.dir, ignore_errors=True)

    # ------------------------------------------------------------------------------------------- reporting

    def finish(self, flow: http.HTTPFlow, info: FlowInfo, obs: Observation) -> None:
        plan = info.plan
        rt = self.runtimes.get(info.upstream if flow.live else f"replay:{info.upstream}")
        slot = obs.id_slot if obs.id_slot is not None else info.slot
        key = plan.session.key if plan.session else "-"
        short = plan.session.short if plan.session else "-"
        source = plan.session.source if plan.session else "-"
        stats = rt.record(key, source, slot, obs) if rt and plan.session else None
        reuse = f"{100 * obs.reuse:.0f}%" if obs.reuse is not None else "?"
        took = time.monotonic() - info.started
        line = (f"slotkeeper: {flow.request.path} session={short} ({source}) slot={fmt(slot)} "
                f"why={info.reason} cache_n={fmt(obs.cache_n)} prompt_n={fmt(obs.prompt_n)} reuse={reuse} "
                f"{took:.2f}s")
        if obs.error_type:
            line += f" error={obs.error_type}"
        self.request_log.emit(line)
        flow.comment = (f"s={short} slot={fmt(slot)} {info.reason} | cache {fmt(obs.cache_n)}"
                        f"/{fmt((obs.cache_n or 0) + (obs.prompt_n or 0))} {reuse}")
        flow.marked = MARKERS[obs.outcome]
        flow.metadata["slotkeeper"] = {
            "session": key, "source": source, "slot": slot, "reason": info.reason, "side": plan.side,
            "cache_n": obs.cache_n, "prompt_n": obs.prompt_n, "outcome": obs.outcome,
            "client": info.client_fields, "facts": info.facts,
        }
        self.warn_about(obs, info, rt, stats)
        if self.log_file:
            self.write_jsonl({"kind": "request", "path": flow.request.path, "upstream": info.upstream,
                              "session": key, "source": source, "slot": slot, "reason": info.reason,
                              "cache_n": obs.cache_n, "prompt_n": obs.prompt_n, "error": obs.error_type,
                              "seconds": round(took, 4)})

    def warn_about(self, obs: Observation, info: FlowInfo, rt: ServerRuntime | None, stats: Any) -> None:
        if obs.error_type == "exceed_context_size_error":
            log.warning("slotkeeper: request of %s tokens exceeds the per-slot context n_ctx=%s on %s. "
                        "Without unified KV each slot gets -c / -np tokens: raise -c, lower -np, or use "
                        "--kv-unified-per-slot N.", fmt(obs.n_prompt_tokens), fmt(obs.n_ctx), info.upstream)
        if (rt is not None and not rt.offline and info.plan.kind == "pin" and info.reason == "known"
                and info.slot is not None and obs.cache_n == 0 and stats is not None and stats.requests > 1):
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().create_task(rt.explain_cache_loss(info.slot))

    def write_jsonl(self, record: dict[str, Any]) -> None:
        if not self.log_file:
            return
        record = {"t": time.time(), **record}
        try:
            fd = os.open(self.log_file or "", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with os.fdopen(fd, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            log.warning("slotkeeper: cannot write %s: %r", self.log_file, e)

    def summary_lines(self) -> list[str]:
        lines = []
        for rt in self.runtimes.values():
            if not rt.stats:
                continue
            lines.append(f"slotkeeper: sessions on {rt.upstream}")
            lines.append(f"  {'session':8} {'slot':>4} {'reqs':>5} {'prefill':>8} {'cached':>8} {'reuse':>6} "
                         f"{'saved_s':>8}")
            for key, s in rt.stats.items():
                reuse = f"{100 * s.reuse:.0f}%" if s.reuse is not None else "?"
                lines.append(f"  {key[:8]:8} {fmt(s.slot):>4} {s.requests:>5} {s.prefill:>8} {s.cached:>8} "
                             f"{reuse:>6} {s.saved_s:>8.1f}")
        return lines

    def log_summary(self) -> None:
        for line in self.summary_lines():
            log.info(line)

    # ------------------------------------------------------------------------------------------- local API

    def answer_local(self, flow: http.HTTPFlow) -> None:
        path = flow.request.path.split("?", 1)[0]
        if path == "/_slots/health":
            body: Any = {"ok": True}
        elif path == "/_slots/status":
            body = self.status_data()
        else:
            flow.response = http.Response.make(404, b'{"error":"unknown slotkeeper endpoint"}',
                                               {"content-type": "application/json"})
            return
        flow.response = http.Response.make(200, json.dumps(body, indent=1),
                                           {"content-type": "application/json"})

    def status_data(self) -> dict[str, Any]:
        return {"policy": self.cfg.policy.value, "ttl": self.cfg.ttl, "state_dir": str(self.state_dir),
                "servers": [rt.status() for rt in self.runtimes.values()]}

    @command.command("slots.release")
    def release_command(self, session: str) -> str:
        """Forget a session (its 8-hex id from the log): its slot is free for the next new session."""
        done = []
        for rt in self.live_runtimes():
            with rt.store.transaction_sync() as state:
                for key in st.match_sessions(list({*state.sessions, *rt.table.sessions}), session):
                    rt.table.release(key)
                    slot = st.release(state, key)
                    page = state.pages.pop(key, None)
                    if page is not None and rt.pager is not None:
                        rt.pager.delete([page.file])
                    done.append(f"{key[:8]} (slot {fmt(slot)}) on {rt.upstream}")
        return "released: " + (", ".join(done) or f"no session matches {session!r}")

    @command.command("slots.pin")
    def pin_command(self, session: str, slot: int) -> str:
        """Move a known session (its 8-hex id from the log) to a slot of your choice."""
        done = []
        now = time.time()
        for rt in self.live_runtimes():
            total = rt.total_slots or 0
            if not 0 <= slot < total:
                return f"slot {slot} is out of range 0..{total - 1} on {rt.upstream}"
            with rt.store.transaction_sync() as state:
                for key in st.match_sessions(list({*state.sessions, *rt.table.sessions}), session):
                    known = rt.table.sessions.get(key)
                    rt.table.assign(key, slot, now, prefix=known.prefix if known else None, reason="manual",
                                    requests=known.requests if known else 0)
                    st.claim(state, key, slot, now, prefix=known.prefix if known else None)
                    done.append(f"{key[:8]} → slot {slot} on {rt.upstream}")
        return "pinned: " + (", ".join(done) or f"no session matches {session!r}")

    def live_runtimes(self) -> list[ServerRuntime]:
        return [rt for rt in self.runtimes.values() if not rt.offline]

    @command.command("slots.cleanup")
    def cleanup_command(self) -> str:
        """Delete stale prefix-checkpoint files now (only prefix-<16 hex>.bin in slots_save_dir)."""
        deleted: list[str] = []
        for rt in self.runtimes.values():
            if rt.checkpoints is not None:
                deleted += rt.checkpoints.cleanup_sync()
        return "deleted: " + (", ".join(deleted) or "nothing")

    @command.command("slots.status")
    def status_command(self) -> str:
        """The slot table and per-session summary as text."""
        return json.dumps(self.status_data(), indent=1) + "\n" + "\n".join(self.summary_lines())


def read_json(req: http.Request) -> tuple[bytes, Any]:
    """The decoded body and its JSON, or (b"", None) for no body, a streamed body, a bad encoding or non-JSON."""
    try:
        content = raw_headers.content(req)
    except ValueError:
        return b"", None
    if not content:
        return b"", None
    try:
        return content, json.loads(content)
    except (ValueError, UnicodeDecodeError):
        return content, None


class LowerHeaders(dict[str, str]):
    """Request headers as a plain dict with lower-case names, built straight from the raw fields (mitmproxy's
    multidict look-ups are slow on the hot path). The first value of a repeated header wins."""

    lowercase_keys = True

    def __init__(self, headers: http.Headers) -> None:
        super().__init__()
        for k, v in headers.fields:
            self.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))


def response_body(response: http.Response) -> bytes:
    """The decoded response body; the raw bytes when the encoding is bad (observation only)."""
    try:
        return raw_headers.content(response) or b""
    except ValueError:
        return response.raw_content or b""


def restore_client_fields(body: dict[str, Any], client: Any) -> dict[str, Any]:
    """A saved flow holds the body we sent upstream; put back what the client itself had sent."""
    if not isinstance(client, dict):
        return body
    out = dict(body)
    for field in ("id_slot", "cache_prompt"):
        if field in client:
            if client[field] is None:
                out.pop(field, None)
            else:
                out[field] = client[field]
    return out


def fronted_upstreams(modes: Sequence[str]) -> set[str]:
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
    return out


def fmt(v: object) -> str:
    return "-" if v is None else str(v)


addons = [SlotKeeper()]
