"""What the loaded model and the start-up probe mean for this proxy: slot files on or off, the page budget in
tokens, the measured speeds.

Pure. Slot files stay off only where a restore cannot resume (`ModelFacts.restore_helps`); unknown stays on.
Whether this build writes context checkpoints into slot files is the server's property, not the model's: for
sliding-window and recurrent models one probe save (`probe_request`, the proxy's own text into an empty slot,
also measuring prefill and decode) tells, and until it has, files stay off. docs/model-capability.md.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from slotlogic import numbers
from slotlogic.model_facts import ModelFacts, ReuseKind

PROBE_WORDS = 260          # ~300 tokens: long enough for a stable prefill speed and for llama-server's
PROBE_PREDICT = 24         # checkpoints near the end of a prompt; short enough to cost ~1-3 s at start
PROBE_FILE_PREFIX = "slotkeeper-probe-"


def probe_prompt() -> str:
    """The probe's prompt: deterministic, the proxy's own words."""
    return "slotkeeper start-up probe. " + " ".join(f"step {i} is fine." for i in range(PROBE_WORDS // 4))


def probe_file(upstream: str) -> str:
    """A flat file name for the probe save (never from client input)."""
    return PROBE_FILE_PREFIX + hashlib.sha256(upstream.encode()).hexdigest()[:16] + ".bin"


def probe_slot(live: Sequence[Mapping[str, Any]] | None, total_slots: int) -> int | None:
    """An empty idle slot for the probe (the highest id, like llama-server's own LRU tie-break); None when every
    slot holds something: the probe never overwrites a conversation."""
    if not live:
        return None
    empty = [e.get("id") for e in live if not e.get("is_processing") and e.get("n_prompt_tokens", 0) == 0
             and isinstance(e.get("id"), int) and 0 <= e["id"] < total_slots]
    return max(empty) if empty else None


def probe_request(slot: int) -> dict[str, Any]:
    return {"prompt": probe_prompt(), "n_predict": PROBE_PREDICT, "id_slot": slot, "cache_prompt": False,
            "temperature": 0, "ignore_eos": True}


@dataclass(frozen=True)
class Throughput:
    prefill_tok_s: float
    decode_tok_s: float
    prompt_n: int
    predicted_n: int
    slot: int


def throughput(answer: Any, slot: int) -> Throughput | None:
    """The speeds from the probe's `/completion` answer (`timings`), or None."""
    t = answer.get("timings") if isinstance(answer, Mapping) else None
    if not isinstance(t, Mapping):
        return None
    pps, dps = numbers.rate(t.get("prompt_per_second")), numbers.rate(t.get("predicted_per_second"))
    pn, dn = numbers.count(t.get("prompt_n")), numbers.count(t.get("predicted_n"))
    if pps is None or dps is None or not pn or not dn:
        return None
    return Throughput(pps, dps, pn, dn, slot)


def needs_file_check(facts: ModelFacts, swa_full: bool, files_wanted: bool) -> bool:
    """Rule 3: only a model whose restores resume exactly when the files carry checkpoints needs the probe."""
    return files_wanted and not facts.restore_helps(swa_full, None) and facts.restore_helps(swa_full, True)


@dataclass(frozen=True)
class Verdict:
    files_ok: bool                        # session pages and disk checkpoints may be written
    kind: ReuseKind
    checkpoints_in_files: bool | None     # what the probe save showed; None: not checked


def verdict(facts: ModelFacts | None, swa_full: bool, checkpoints_in_files: bool | None) -> Verdict:
    if facts is None:
        return Verdict(True, ReuseKind.UNKNOWN, checkpoints_in_files)
    return Verdict(facts.restore_helps(swa_full, checkpoints_in_files), facts.prefix_reuse().kind,
                   checkpoints_in_files)


def page_budget_tokens(facts: ModelFacts | None, budget_bytes: int, cache_type_k: str, cache_type_v: str,
                       n_ctx: int | None) -> int | None:
    """How many tokens of conversations the page budget holds: bytes / a slot file's bytes per token (for a
    slot-sized conversation, where SWA layers store only their window)."""
    if facts is None or not facts.known or facts.prefix_reuse().kind is ReuseKind.NO_MEMORY:
        return None
    try:
        per_1k = facts.slot_file_bytes_per_1k_tokens(cache_type_k, cache_type_v, n_tokens=max(1000, n_ctx or 0))
    except ValueError:
        return None
    return int(budget_bytes / (per_1k / 1000)) if per_1k > 0 else None


def status(facts: ModelFacts | None, v: Verdict | None, speed: Throughput | None, *, page_budget_bytes: int,
           paging: bool, cache_type_k: str, cache_type_v: str, n_ctx: int | None) -> dict[str, Any]:
    """The status view's model part: names and numbers only."""
    out: dict[str, Any] = {"model": None, "page_budget": None, "throughput": None}
    if facts is not None and facts.known:
        try:
            per_token = facts.kv_bytes_per_token(cache_type_k, cache_type_v, n_ctx)
            per_1k = facts.slot_file_bytes_per_1k_tokens(cache_type_k, cache_type_v, n_tokens=max(1000, n_ctx or 0))
        except ValueError:
            per_token = per_1k = 0.0
        out["model"] = {"architecture": facts.architecture, "layers": facts.block_count,
                        "kv_bytes_per_token": round(per_token), "slot_file_bytes_per_1k_tokens": round(per_1k),
                        "prefix_reuse": facts.prefix_reuse().kind.value,
                        "slot_files": None if v is None else ("on" if v.files_ok else "off"),
                        "checkpoints_in_files": None if v is None else v.checkpoints_in_files}
    if paging:
        out["page_budget"] = {"mb": page_budget_bytes >> 20,
                              "tokens": page_budget_tokens(facts, page_budget_bytes, cache_type_k, cache_type_v,
                                                           n_ctx)}
    if speed is not None:
        out["throughput"] = {"prefill_tok_s": round(speed.prefill_tok_s, 1),
                             "decode_tok_s": round(speed.decode_tok_s, 1)}
    return out
