"""Which KV cache type (`-ctk/-ctv`) the server runs with, read off a slot save's size.

Why: llama-server does not report its cache types over HTTP (`/props` has no field for them), yet a slot file
saved under one type cannot be restored under another (llama.cpp's `state_read_data` compares each layer's K
and V type and fails the restore, wiping the slot). The option `slots_cache_type` says what the operator
meant; the save answers say what the server does: `n_written` of a save is exact to the byte for a given
model, token count and cache type (`ModelFacts.slot_file_bytes`), so the type is the one whose size matches.
The type found goes into the page identity and the checkpoint identity (`ServerInfo.kv_cache`): a page or
checkpoint saved under another type is never restored. Types of the same size (f16 and bf16) cannot be told
apart this way: the configured one is kept.
"""

from __future__ import annotations

from slotlogic.model_facts import CACHE_TYPES, ModelFacts

ORDER = ("f16", "q8_0", "q4_0", "f32", "bf16", "q4_1", "q5_0", "q5_1", "iq4_nl")  # a tie goes to the likelier


def label(k: str, v: str) -> str:
    return f"{k}/{v}"


def infer(facts: ModelFacts | None, n_saved: int, n_written: int, n_streams: int,
          configured: tuple[str, str]) -> tuple[str, str] | None:
    """The (K, V) cache types whose slot file of `n_saved` tokens is `n_written` bytes, the configured pair
    first; None when the model is not modelled or no pair matches (a file with checkpoints appended, a layout
    this build writes differently): then nothing is concluded."""
    if facts is None or not facts.modelled or n_saved <= 0:
        return None
    pairs = [configured] + [(k, v) for k in ORDER for v in ORDER if k in CACHE_TYPES and v in CACHE_TYPES]
    for streams in dict.fromkeys((n_streams, 1)):
        for k, v in pairs:
            if facts.slot_file_bytes(n_saved, k, v, n_streams=streams) == n_written:
                return k, v
    return None
