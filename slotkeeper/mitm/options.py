"""The proxy's options (`--set slots_…`): one table, and their validation into one frozen `Settings`.

Every option is checked once in `configure`; a bad value stops mitmproxy with an `OptionsError` naming the
option, before any request is touched. docs/options.md lists them for users.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from mitmproxy import exceptions
from mitmproxy.proxy.mode_specs import ProxyMode, ReverseMode

from slotkeeper.drivers import origins, private_dir
from slotkeeper.drivers.store_file import default_state_dir
from slotlogic import checkpoint_cleanup, paging, sidecalls
from slotlogic import prefix as pfx
from slotlogic import session as sess
from slotlogic.model_facts import CACHE_TYPES
from slotlogic.ranking import Policy
from slotlogic.settings import AnthropicMode, CheckpointMode, Settings

E = TypeVar("E", bound=enum.Enum)


@dataclass(frozen=True)
class Option:
    name: str
    typespec: Any
    default: Any
    help: str
    choices: Sequence[str] | None = None


OPTIONS: tuple[Option, ...] = (
    Option("slots_policy", str, "auto",
           "How a new session's slot is chosen: auto (prefix-aware, busy-aware), seed (seed "
           "000's ranking), affinity (llama-server chooses on the first request, id_slot -1; "
           "the proxy pins the slot it chose), off (observe and log only, rewrite nothing).",
           choices=[p.value for p in Policy]),
    Option("slots_state_dir", str, "",
           "Directory of the shared state files (one per upstream server). Default: "
           "$XDG_STATE_HOME/slotkeeper (~/.local/state/slotkeeper)."),
    Option("slots_ttl", int, 120,
           "Seconds after its last request that a session's claim on its slot expires."),
    Option("slots_override_client", bool, True,
           "The proxy owns id_slot: a client's own id_slot is replaced. false: clients are trusted, and a "
           "client's valid id_slot is honoured (its session's claim moves to that slot)."),
    Option("slots_session_headers", Sequence[str], list(sess.DEFAULT_SESSION_HEADERS),
           "Request headers that carry a session id, most reliable first (repeat --set)."),
    Option("slots_side_patterns", Sequence[str], list(sidecalls.DEFAULT_SIDE_PATTERNS),
           "Regexes on the system prompt that mark side calls (compaction, titles); they go "
           "to one reserved slot when the server has 2 or more slots."),
    Option("slots_side_slot", int, -1,
           "The slot reserved for side calls; -1 = the highest slot id."),
    Option("slots_probe_interval", int, 15,
           "Seconds between background /props probes that detect a restarted or resized "
           "server (0 = only when a cache loss needs explaining)."),
    Option("slots_prefix_cache", str, "",
           "Prefix checkpoints for new sessions: off, memory (warm, no disk), disk (save, "
           "restore, verify). Empty = disk with slots_save_dir or slots_save_remote, else off.",
           choices=["", *(m.value for m in CheckpointMode)]),
    Option("slots_save_dir", str, "",
           "llama-server's --slot-save-path (the same directory), for checkpoint files and their "
           "cleanup."),
    Option("slots_save_remote", bool, False,
           "llama-server has a --slot-save-path this machine cannot read (another host or container): "
           "page conversations through its own save and restore, reusing a bounded set of file names "
           "so its disk stays within slots_page_max_mb."),
    Option("slots_paging", bool, True,
           "Session paging (needs slots_save_dir or slots_save_remote): before a slot goes to another session, save "
           "its holder's conversation there; when that session returns, restore it instead of "
           "prefilling it again."),
    Option("slots_page_max_mb", int, 0,
           "Cap on session page files in slots_save_dir; the least recently saved go first. 0 = sized "
           "from the model: two full contexts a slot, at least 8192, at most half the free space."),
    Option("slots_server_id", str, "",
           "Your name for the llama-server build; part of the checkpoint fingerprint (bump it "
           "after an upgrade to force one clean rebuild)."),
    Option("slots_prefix_markers", Sequence[str], list(pfx.DEFAULT_MARKERS),
           "Where the shared system-prompt prefix ends: the earliest of these strings."),
    Option("slots_checkpoint_ttl_days", int, 30,
           "Cleanup keeps checkpoint files used within this many days."),
    Option("slots_checkpoint_keep", int, 3,
           "Cleanup always keeps this many most recently used checkpoint files."),
    Option("slots_checkpoint_max_mb", int, -1,
           "Cap on prefix checkpoint files in slots_save_dir, held at every moment: the least "
           "recently used go first, a file that cannot fit is not saved. -1 = a quarter of "
           "slots_page_max_mb; 0 = no cap."),
    Option("slots_anthropic", str, "translate",
           "Anthropic /v1/messages requests (Claude Code): translate (send as a pinned chat "
           "completion and convert the answer back; switches to native by itself when the server "
           "honours id_slot there), native (pass through with id_slot added), off (observe only).",
           choices=[m.value for m in AnthropicMode]),
    Option("slots_strip_billing", bool, True,
           "Drop Claude Code's x-anthropic-billing-header system block (vendor billing metadata "
           "whose suffix changes per session) before llama-server sees it, so sessions share "
           "their system prompt's cache."),
    Option("slots_prefix_min_chars", int, 512,
           "The shortest stable prefix learned from traffic (for clients without a marker)."),
    Option("slots_client_patience", int, 90,
           "Seconds the proxy may hold a request in all while its slot is busy with this proxy's earlier "
           "requests; keep it under your clients' own timeouts (docs/clients.md). After a third of it a held "
           "request may leave its slot for a free one; at the end it is sent where it starts soonest. "
           "0 = never hold (the server queues it)."),
    Option("slots_seed_wait", int, 30,
           "Seconds a new session may wait for another session's slot to finish its request, when it "
           "would start from a copy of that conversation (two sessions that start together): at most "
           "what prefilling the copied part takes at the server's measured speed (0 = never wait)."),
    Option("slots_state_max_sessions", int, 256,
           "Sessions kept in the state file (the most recently used, and every slot's owner); a "
           "new session's locked read-modify-write costs what the file holds."),
    Option("slots_max_body_mb", int, 64,
           "Request bodies larger than this (after gzip/deflate/br/zstd decoding) pass untouched "
           "and unpinned; larger encoded bodies are decoded in a worker thread, never inflated "
           "on the event loop beyond a small size."),
    Option("slots_api_key", str, "",
           "llama-server's --api-key, for the proxy's own calls (/props, /slots, slot save/restore, "
           "warm-ups). Empty: the Authorization or X-Api-Key header a client sent to that server. "
           "Never logged or written to a file."),
    Option("slots_swa_full", bool, False,
           "llama-server runs with --swa-full: a sliding-window model's restored slot files can "
           "resume, so session pages and checkpoint files stay on for it (docs/model-capability.md)."),
    Option("slots_cache_type", str, "f16",
           "llama-server's KV cache type (-ctk/-ctv), for the model's KV and slot-file sizes: one "
           "type for both, or K,V (e.g. q8_0,f16)."),
    Option("slots_throughput_probe", bool, False,
           "At start, one short completion of the proxy's own text into an empty slot measures "
           "prefill and decode speed (status view; prefill seconds saved for answers without "
           "timings); with slots_save_dir, its slot is saved and restored once: the save and restore "
           "speeds and the KV cache type the cost model uses from the start."),
    Option("slots_cost_model", bool, True,
           "Once the save, restore and prefill speeds are measured, weigh each page-in, page-out, "
           "live-slot copy and prefix restore against prefilling the same tokens, and make only the "
           "quicker one (docs/paging.md). false: always page and restore where possible, as before the "
           "speeds are measured (the speeds are still measured and shown)."),
    Option("slots_upstreams", Sequence[str], [],
           "More llama-servers (or llama-swap URLs) serving the same model, behind this one "
           "endpoint (repeat --set); the reverse-mode target is the first. Each request goes to "
           "its session's server and slot; a new session to the cheapest server."),
    Option("slots_state_url", str, "",
           "Where the shared state lives: file://DIR (the default: slots_state_dir) or "
           "redis://host:port/db, rediss://… (Redis or Valkey, shared by proxies on several "
           "machines)."),
    Option("slots_health_interval", int, 5,
           "Seconds between /health checks of each server of slots_upstreams (a down server is "
           "asked again with back-off)."),
    Option("slots_swap_max_models", int, 16,
           "llama-swap in slots_upstreams: the most of its models that get a server of their own at once "
           "(only models it lists in /v1/models or /running do; an idle one makes room)."),
    Option("slots_keep_streams", bool, False,
           "Keep a copy of streamed SSE bodies in the flow (for -w recordings, mitmweb and "
           "server replay on mitmproxy 11; on 12.x store_streamed_bodies does the same)."),
)

# option -> the smallest value it accepts, and what the error says
MINIMUMS: dict[str, tuple[int, str]] = {
    "slots_ttl": (1, "a positive number of seconds"),
    "slots_side_slot": (-1, "-1 (automatic) or a slot id"),
    "slots_probe_interval": (0, "≥ 0"),
    "slots_prefix_min_chars": (1, "≥ 1"),
    "slots_seed_wait": (0, "≥ 0 (0 = never wait)"),
    "slots_client_patience": (0, "≥ 0 (0 = never hold)"),
    "slots_page_max_mb": (0, "0 (sized from the model) or a size in MB (turn paging off with slots_paging)"),
    "slots_checkpoint_ttl_days": (0, "≥ 0"),
    "slots_checkpoint_keep": (0, "≥ 0"),
    "slots_checkpoint_max_mb": (-1, "-1 (a quarter of slots_page_max_mb), 0 (no cap) or a size in MB"),
    "slots_state_max_sessions": (16, "≥ 16"),
    "slots_max_body_mb": (1, "≥ 1"),
    "slots_health_interval": (1, "≥ 1"),
    "slots_swap_max_models": (1, "≥ 1"),
}


def add_options(loader: Any, table: Sequence[Option] = OPTIONS) -> None:
    """Declare `table` (the core's options by default; an addon with options of its own passes its table)."""
    for opt in table:
        loader.add_option(opt.name, opt.typespec, opt.default, opt.help, choices=opt.choices)


def check_minimums(o: Any, minimums: dict[str, tuple[int, str]] = MINIMUMS) -> None:
    """`OptionsError` naming the first option below its smallest accepted value."""
    for name, (least, wording) in minimums.items():
        if getattr(o, name) < least:
            raise exceptions.OptionsError(f"{name} must be {wording}")


def build_settings(o: Any) -> tuple[Settings, Path]:
    """The options as one frozen `Settings` (and the state dir), or `OptionsError` naming the bad option."""
    check_minimums(o)
    save_dir = os.path.expanduser(o.slots_save_dir) if o.slots_save_dir else None
    mode = _choice(o, "slots_prefix_cache", CheckpointMode, o.slots_prefix_cache or (
        "disk" if save_dir or o.slots_save_remote else "off"))
    if save_dir and (mode is CheckpointMode.DISK or o.slots_paging) and not os.path.isdir(save_dir):
        raise exceptions.OptionsError(f"slots_save_dir {o.slots_save_dir!r} is not a directory")
    try:
        patterns = tuple(sidecalls.compile_patterns(o.slots_side_patterns))
    except ValueError as e:
        raise exceptions.OptionsError(f"slots_side_patterns: {e}") from None
    cache_k, cache_v = _cache_types(o.slots_cache_type)
    markers = tuple(m.encode().decode("unicode_escape") for m in o.slots_prefix_markers if m)
    settings = Settings(
        policy=_choice(o, "slots_policy", Policy, o.slots_policy), ttl=float(o.slots_ttl),
        override_client=o.slots_override_client,
        session_headers=tuple(h.strip().lower() for h in o.slots_session_headers if h.strip()),
        side_patterns=patterns, side_slot=o.slots_side_slot, markers=markers or pfx.DEFAULT_MARKERS,
        checkpoints=mode, save_dir=save_dir, paging=bool(o.slots_paging and (save_dir or o.slots_save_remote)),
        save_remote=bool(o.slots_save_remote and not save_dir),
        page_max_bytes=(o.slots_page_max_mb << 20) or paging.AUTO_FLOOR, page_budget_auto=not o.slots_page_max_mb,
        server_id=o.slots_server_id,
        checkpoint_ttl_days=float(o.slots_checkpoint_ttl_days), checkpoint_keep=o.slots_checkpoint_keep,
        checkpoint_max_bytes=checkpoint_cleanup.default_cap((o.slots_page_max_mb << 20) or paging.AUTO_FLOOR)
        if o.slots_checkpoint_max_mb < 0 else o.slots_checkpoint_max_mb << 20,
        probe_interval=float(o.slots_probe_interval),
        keep_streams=o.slots_keep_streams, anthropic=_choice(o, "slots_anthropic", AnthropicMode, o.slots_anthropic),
        strip_billing=o.slots_strip_billing, prefix_min_chars=o.slots_prefix_min_chars,
        seed_wait=float(o.slots_seed_wait), patience=float(o.slots_client_patience),
        state_max_sessions=o.slots_state_max_sessions, max_body_bytes=o.slots_max_body_mb << 20,
        api_key=o.slots_api_key.strip(), swa_full=o.slots_swa_full, cache_type_k=cache_k, cache_type_v=cache_v,
        throughput_probe=o.slots_throughput_probe, cost_model=o.slots_cost_model)
    return settings, _state_dir(o.slots_state_dir)


def _choice(o: Any, name: str, cls: type[E], value: str) -> E:
    try:
        return cls(value)
    except ValueError:
        raise exceptions.OptionsError(
            f"{name} must be one of {', '.join(str(m.value) for m in cls)}, not {value!r}") from None


def _cache_types(value: str) -> tuple[str, str]:
    types = [t.strip().lower() for t in value.split(",")]
    if len(types) not in (1, 2) or any(t not in CACHE_TYPES for t in types):
        raise exceptions.OptionsError(f"slots_cache_type must be one of {', '.join(CACHE_TYPES)}, or two of them "
                                      f"as K,V; not {value!r}")
    return types[0], types[-1]


def _state_dir(option: str) -> Path:
    state_dir = Path(option).expanduser() if option else default_state_dir()
    try:
        private_dir.check(state_dir)  # created 0700 on first use when missing; an existing one is never chmod-ed
    except private_dir.UnsafeDir as e:
        raise exceptions.OptionsError(f"slots_state_dir: {e}") from None
    return state_dir


def server_list(modes: Sequence[str], extra: Sequence[str]) -> list[str]:
    """The servers of a pool: the reverse-mode target first, then `slots_upstreams` (each once)."""
    out: list[str] = []
    for url in [*sorted(fronted_upstreams(modes)), *(u.strip().rstrip("/") for u in extra if u.strip())]:
        p = urlsplit(url)
        if p.scheme not in ("http", "https") or not p.hostname:
            raise exceptions.OptionsError(f"slots_upstreams: {url!r} is not an http(s):// URL")
        base = origins.base_of(url)
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
            out.add(origins.origin(m.scheme, host, port))
    return frozenset(out)


def listen_ports(modes: Sequence[str], default: int | None) -> frozenset[int]:
    """The ports the proxy's modes listen on (`default`: the `listen_port` option, for a mode that names none)."""
    out = set()
    for spec in modes:
        try:
            port = ProxyMode.parse(spec).listen_port(default)
        except ValueError:
            continue
        if port is not None:
            out.add(port)
    return frozenset(out)
