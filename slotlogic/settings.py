"""Everything the proxy was told to do for one upstream, built once and never changed afterwards.

Rule 1: frozen. The mitmproxy side validates its options once (`configure`) and builds one `Settings` per
        upstream; a changed option builds a new object, which replaces the old one whole. Nothing flips a
        flag on a live object.
Rule 2: what a server may get depends on whether this proxy fronts it in reverse mode: prefix checkpoints,
        session paging and `slots_api_key` act only there (`for_upstream`), never on a host a regular-mode
        client happens to name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import cached_property

from slotlogic import prefix as pfx
from slotlogic import scheduler, sidecalls
from slotlogic import session as sess
from slotlogic.ranking import Policy


class CheckpointMode(Enum):
    OFF = "off"
    MEMORY = "memory"  # warm the prefix into a new session's slot, keep no file
    DISK = "disk"      # also save it to, and restore it from, llama-server's --slot-save-path


class AnthropicMode(Enum):
    TRANSLATE = "translate"  # send /v1/messages as a pinned chat completion and convert the answer back
    NATIVE = "native"        # pass /v1/messages through with id_slot added (a server that honours it)
    OFF = "off"              # observe and log only


SESSION_KEEP_SECONDS = 7 * 24 * 3600  # the state file forgets a session (and deletes its page) after this


@dataclass(frozen=True)
class Settings:
    policy: Policy = Policy.AUTO
    ttl: float = 120.0
    override_client: bool = True   # the proxy owns id_slot; False: clients are trusted to choose (docs/behaviour.md)
    session_headers: tuple[str, ...] = sess.DEFAULT_SESSION_HEADERS
    side_patterns: tuple[re.Pattern[str], ...] = field(
        default_factory=lambda: tuple(sidecalls.compile_patterns(sidecalls.DEFAULT_SIDE_PATTERNS)))
    side_slot: int = -1
    markers: tuple[str, ...] = pfx.DEFAULT_MARKERS
    prefix_min_chars: int = 512        # the shortest stable prefix worth learning from traffic
    patience: float = 90.0             # seconds a request may be held in all (slotlogic.scheduler)
    seed_wait: float = 30.0            # seconds a new session may wait for the slot it would copy (paging.source_wait)
    checkpoints: CheckpointMode = CheckpointMode.OFF
    save_dir: str | None = None        # llama-server's --slot-save-path, as this machine sees it
    paging: bool = False               # session paging through save_dir (needs it, or save_remote)
    save_remote: bool = False          # the server's save dir is out of this machine's reach: pages only through
    #                                    its save and restore, names from a bounded ring, sizes from its answers
    page_max_bytes: int = 8192 << 20
    page_budget_auto: bool = False     # the budget sized from the model's KV and the slots (`paging.auto_budget`)
    server_id: str = ""
    checkpoint_ttl_days: float = 30.0
    checkpoint_keep: int = 3
    checkpoint_max_bytes: int = 2048 << 20  # a quarter of the page budget (`checkpoint_cleanup.default_cap`)
    probe_interval: float = 15.0
    flush_interval: float = 2.0
    keep_streams: bool = False
    anthropic: AnthropicMode = AnthropicMode.TRANSLATE
    strip_billing: bool = True         # drop Claude Code's per-session billing block before the server sees it
    state_max_sessions: int = 256      # sessions kept in the state file (slot owners always kept)
    max_body_bytes: int = 64 << 20     # decoded request bodies above this pass untouched (gzip bombs)
    api_key: str = field(default="", repr=False)  # for the proxy's own calls to llama-server; never shown
    swa_full: bool = False             # llama-server runs with --swa-full (what a restore can resume depends on it)
    cache_type_k: str = "f16"          # its -ctk / -ctv (KV and slot-file sizes)
    cache_type_v: str = "f16"
    throughput_probe: bool = False     # one short completion at start measures prefill and decode speed
    cost_model: bool = True            # weigh page and prefix moves by their measured cost (False: always move)

    @property
    def wait_bound(self) -> float:
        """Seconds after which a held request may leave its own slot: a third of its client's patience (the
        rest goes to holding it for its own slot or a free one, then to sending it where it starts soonest)."""
        return self.patience / scheduler.PATIENCE_BOUNDS

    @cached_property
    def header_bytes(self) -> frozenset[bytes]:
        """The session header names as the raw header fields spell them (lower-case bytes; built once, it is
        asked for every header of every request)."""
        return frozenset(h.encode("latin-1") for h in self.session_headers)

    def for_upstream(self, fronted: bool) -> Settings:
        """The settings for one server: no checkpoints and no slot files unless this proxy fronts it in
        reverse mode."""
        if fronted:
            return self
        # Nor the operator's API key: a regular-mode client may name any host, and the key is for ours.
        return replace(self, save_dir=None, paging=False, checkpoints=CheckpointMode.OFF, api_key="")
