"""What the loaded model lets the proxy reuse, decided from its GGUF header key/values.

Why: sliding-window and recurrent layers cannot roll a slot back, and upstream slot files carry no context
checkpoints, so for such models a restored slot file often prefills everything again; checkpoints and pages
are then disk writes that never pay back. This module decides which kind of model is loaded (the way
llama.cpp decides it per architecture, not from the model card) and estimates KV and slot-file bytes from
llama.cpp's cache layout. Pure; odd metadata reads as absent, and an unknown model changes nothing.
docs/model-capability.md has the layouts, the sources in llama.cpp and the measurements.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

# K/V cache types llama-server accepts for -ctk/-ctv, as (block size, bytes per block) (ggml.c type traits).
CACHE_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2),
    "q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20),
    "iq4_nl": (32, 18), "q5_0": (32, 22), "q5_1": (32, 24),
}

MAX_LAYERS = 512  # LLAMA_MAX_LAYERS (src/llama-hparams.h): llama.cpp refuses larger models

# llama-server's defaults for the context-checkpoint flags (common/common.h).
DEFAULT_CTX_CHECKPOINTS = 32
DEFAULT_CHECKPOINT_MIN_STEP = 8192

# src/llama-arch.cpp llm_arch_is_recurrent: every layer is recurrent.
RECURRENT_ARCHS = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
# src/llama-arch.cpp llm_arch_is_hybrid: some layers are recurrent (which ones: _recurrent_layers).
HYBRID_ARCHS = frozenset({
    "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe",
    "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "qwen35", "qwen35moe", "deepseek4", "minimax-01"})
# Hybrids whose recurrent layers are those with no KV heads (src/models/<arch>.cpp).
_RECR_BY_ZERO_KV = frozenset({"jamba", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "kimi-linear",
                              "bailingmoe3", "kimi-k3"})
# Hybrids that list recurrent layers, or derive them from full_attention_interval (default 4).
_RECR_BY_INTERVAL = frozenset({"qwen3next", "qwen35", "qwen35moe", "minimax-01"})
# Models without a KV cache at all (src/llama-model.cpp create_memory returns nullptr).
NO_MEMORY_ARCHS = frozenset({"bert", "jina-bert-v2", "jina-bert-v3", "nomic-bert", "nomic-bert-moe",
                             "neo-bert", "eurobert", "wavtokenizer-dec", "modern-bert", "gemma-embedding",
                             "dream", "llada", "llada-moe", "rnd1", "t5encoder", "clip"})
# Layer i's state is 4-dim M-RoPE positioned: the cell metadata carries 8 more bytes (llama_kv_cell_ext).
_MROPE_ARCHS = frozenset({"qwen2vl", "qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe", "hunyuan_vl",
                          "paddleocr", "glm4v"})


@dataclass(frozen=True)
class _SwaRule:
    """How one architecture's loader in llama.cpp marks SWA layers.

    `period`: the scalar `sliding_window_pattern` (or this default) feeds `set_swa_pattern`; an array value
    is ignored by that loader (llama_model_loader::get_key_or_arr returns false for a scalar target).
    `per_layer`: the key is a per-layer bool array (a scalar is repeated over all layers).
    `period_or_array`: a scalar is a period, otherwise the array is read per layer.
    """

    mode: str                      # "period" | "per_layer" | "period_or_array" | "attention_layers"
    period: int = 0
    dense_first: bool = False
    window: int = 0                # llama.cpp's default window when the key is absent (0: key required)
    only_if_window: bool = False   # SWA only when the sliding_window key is present and > 0
    forced_window: int = 0         # the loader overwrites the window with this (llama4, smallthinker)
    chunked: bool = False          # llama4: chunked attention (same cost rules as a window)
    only_if_layers: int = 0        # exaone4: SWA only for the 64-layer (32B) model


_SWA_RULES: dict[str, _SwaRule] = {
    "gemma2": _SwaRule("period", 2, window=4096),
    "gemma3": _SwaRule("period", 6, only_if_window=True),
    "gemma3n": _SwaRule("period", 5),
    "gemma4": _SwaRule("per_layer"),
    "gemma4-assistant": _SwaRule("per_layer"),
    "cohere2": _SwaRule("period", 4),
    "cohere2moe": _SwaRule("period_or_array", 4, dense_first=True),
    "gpt-oss": _SwaRule("period", 2),
    "llama4": _SwaRule("period", 4, forced_window=8192, chunked=True),
    "exaone4": _SwaRule("period", 4, window=4096, only_if_layers=64),
    "exaone-moe": _SwaRule("period", 4, window=128),
    "afmoe": _SwaRule("period", 4, only_if_window=True),
    "olmo2": _SwaRule("period", 4, only_if_window=True),
    "plamo3": _SwaRule("period", 8, only_if_window=True),
    "smallthinker": _SwaRule("period", 4, dense_first=True, only_if_window=True, forced_window=4096),
    "laguna": _SwaRule("period", 4, dense_first=True, only_if_window=True),
    "mellum": _SwaRule("period_or_array", 4, only_if_window=True),
    "muse-glimmer": _SwaRule("period_or_array", 4),
    "mimo2": _SwaRule("per_layer"),
    "step35": _SwaRule("per_layer"),
    "granite_swa": _SwaRule("per_layer"),
    "dots3note": _SwaRule("per_layer"),
    "lfm2": _SwaRule("attention_layers", only_if_window=True),
    "phi3": _SwaRule("disabled"),   # llama.cpp: "Phi SWA is currently disabled"
}


class ReuseKind(Enum):
    """What llama-server can reuse of a cached prompt once a new request diverges from it."""

    FULL = "full"                          # every layer keeps every token: any prefix, slot files resume
    NEEDS_SWA_FULL = "needs-swa-full"      # SWA layers: only the last window, unless --swa-full
    CHECKPOINTS_ONLY = "checkpoints-only"  # recurrent state: only from in-RAM context checkpoints
    NO_MEMORY = "no-memory"                # embedding/encoder/diffusion model: nothing is cached
    UNKNOWN = "unknown"                    # header missing or not understood: nothing is changed


@dataclass(frozen=True)
class Reuse:
    """The verdict plus the ingredients of the advice, as data (the log line is built by `describe`)."""

    kind: ReuseKind
    flags_for_restore: tuple[str, ...] = ()   # llama-server flags that make a restored slot file resume
    restore_fixable: bool = True              # False: no flag makes slot files resume (needs upstream)


@dataclass(frozen=True)
class ModelFacts:
    """The numbers of one model that decide prefix reuse and cache cost (one entry per layer in tuples)."""

    architecture: str = ""
    name: str = ""
    context_length: int = 0          # trained context (`<arch>.context_length`)
    n_vocab: int = 0
    kv_heads: tuple[int, ...] = ()   # KV heads per layer (0: no attention in that layer)
    head_dim_k: int = 0
    head_dim_v: int = 0
    head_dim_k_swa: int = 0
    head_dim_v_swa: int = 0
    mla: bool = False                # multi-head latent attention: K only, no V cache
    window: int = 0                  # sliding window (or chunk) in tokens; 0: none
    chunked: bool = False
    swa: tuple[bool, ...] = ()       # per layer: sliding-window layer
    recurrent: tuple[bool, ...] = () # per layer: recurrent (fixed-size state)
    has_kv: tuple[bool, ...] = ()    # per layer: owns a KV cache (shared-KV layers and MTP heads do not)
    recurrent_state_floats: int = 0  # f32 values of one recurrent layer's state (conv/shift + ssm/wkv)
    mrope: bool = False
    modelled: bool = True            # False: a layout this module does not model (estimates are rough)

    @property
    def known(self) -> bool:
        return bool(self.architecture)

    @property
    def block_count(self) -> int:
        return len(self.kv_heads)

    @property
    def n_swa_layers(self) -> int:
        return sum(1 for i in self._attention_layers() if self.swa[i])

    @property
    def n_recurrent_layers(self) -> int:
        return sum(self.recurrent)

    @property
    def n_attention_layers(self) -> int:
        return len(self._attention_layers())

    def _attention_layers(self) -> list[int]:
        return [i for i in range(self.block_count) if self.has_kv[i] and self.kv_heads[i] > 0]

    def _row_bytes(self, i: int, cache_type_k: str, cache_type_v: str) -> int:
        dk = self.head_dim_k_swa if self.swa[i] else self.head_dim_k
        dv = 0 if self.mla else (self.head_dim_v_swa if self.swa[i] else self.head_dim_v)
        return _row(cache_type_k, self.kv_heads[i] * dk) + (_row(cache_type_v, self.kv_heads[i] * dv) if dv else 0)

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> ModelFacts:
        """Read the facts from a GGUF header's key/values. Never raises; see Rule 3."""
        try:
            return _from_metadata(meta)
        except Exception:  # odd metadata must never break the proxy (fail open)
            return cls(architecture="", modelled=False)

    def kv_bytes_per_token(self, cache_type_k: str = "f16", cache_type_v: str = "f16", n_ctx: int | None = None,
                           *, swa_full: bool = False) -> float:
        """KV cache bytes one token costs in a slot of `n_ctx` tokens (default: the trained context).

        SWA layers hold min(window, n_ctx) cells, so they are weighted by min(window, n_ctx)/n_ctx unless
        `swa_full` (then they are full size). Recurrent state is per sequence, not per token: see
        `recurrent_state_bytes`. Raises ValueError for an unknown cache type.
        """
        n = n_ctx or self.context_length or 4096
        total = 0.0
        for i in self._attention_layers():
            weight = 1.0
            if self.swa[i] and not swa_full and self.window > 0:
                weight = min(self.window, n) / n
            total += self._row_bytes(i, cache_type_k, cache_type_v) * weight
        return total

    def recurrent_state_bytes(self) -> int:
        """Bytes of one sequence's recurrent state (f32, all recurrent layers), whatever its length."""
        return self.n_recurrent_layers * self.recurrent_state_floats * 4

    def slot_file_bytes(self, n_tokens: int, cache_type_k: str = "f16", cache_type_v: str = "f16",
                        n_streams: int = 1) -> int:
        """Size of a slot file holding `n_tokens` tokens (`n_written` of `/slots/N?action=save`).

        Layout (llama-context.cpp `state_seq_save_file`, llama-kv-cache.cpp `state_write`): magic, version
        and the server's packed token list (4 header words + one word per token); then per KV cache one
        stream count, a cell count per stream, 12 bytes of metadata per cell and, per layer, a K and a V
        header plus one row per cell. An SWA cache stores only its unmasked cells, the last
        min(window, n_tokens). A recurrent memory adds one state per sequence. `n_streams`: llama-server's
        `-np` without `--kv-unified` (each other stream adds an empty 4-byte cell count). Exact to the byte
        for state-file version 4 (llama.cpp builds of Oct 2026); version 2 wrote 8 bytes less per cache.
        """
        n = max(0, int(n_tokens))
        meta = 12 + (8 if self.mrope else 0)          # pos, n_seq_id, one seq id (+ M-RoPE ext) per cell
        header = 12 + 12 * (0 if self.mla else 1)     # K type + row size, V type + row size
        total = 12 + 4 * (n + 4)
        layers = self._attention_layers()
        if layers or not self.n_recurrent_layers:
            full = [i for i in layers if not (self.swa[i] and self.window > 0)]
            swa = [i for i in layers if self.swa[i] and self.window > 0]
            groups = [(full, n)] + ([(swa, min(n, self.window))] if swa else [])
            for group, cells in groups:
                total += 4 + 4 * max(1, n_streams)
                if cells:
                    total += cells * meta + 16 + sum(header + cells * self._row_bytes(i, cache_type_k, cache_type_v)
                                                     for i in group)
        if self.n_recurrent_layers:
            total += 4                         # cell count: one cell, the sequence's running state
            if n:                              # pos + n_seq_id (no ids for one sequence), s_trans, n_layer
                total += 8 + 8 + self.n_recurrent_layers * 24 + self.recurrent_state_bytes()
        return total

    def file_has_checkpoints(self, n_saved: int, n_written: int, n_streams: int = 1) -> bool:
        """Whether a slot file is longer than its KV data: the server appended its context checkpoints.

        Upstream llama-server (server-context.cpp, Aug 2026) writes only the sequence state; builds with
        checkpoint persistence (as PRs #20819/#26004 propose; the Oct 2026 xllamacpp wheel does it) append
        them after it, and `n_written` counts them. A file without them cannot roll back on an SWA or
        recurrent model, so a restore of it does not resume.
        """
        slack = 64 + 4 * max(1, n_streams)
        return n_written - self.slot_file_bytes(n_saved, n_streams=n_streams) > slack

    def slot_file_bytes_per_1k_tokens(self, cache_type_k: str = "f16", cache_type_v: str = "f16",
                                      n_tokens: int = 1000) -> float:
        """What a saved slot file costs per 1,000 tokens for a conversation of `n_tokens` tokens."""
        n = max(1, int(n_tokens))
        return self.slot_file_bytes(n, cache_type_k, cache_type_v) * 1000 / n

    def prefix_reuse(self) -> Reuse:
        """The verdict: which prefixes llama-server can reuse, and what a restored slot file is worth."""
        if not self.known:
            return Reuse(ReuseKind.UNKNOWN)
        if self.architecture in NO_MEMORY_ARCHS:
            return Reuse(ReuseKind.NO_MEMORY, restore_fixable=False)
        if self.n_recurrent_layers or self.architecture in RECURRENT_ARCHS | HYBRID_ARCHS:
            return Reuse(ReuseKind.CHECKPOINTS_ONLY, restore_fixable=False)
        if self.n_swa_layers:
            return Reuse(ReuseKind.NEEDS_SWA_FULL, flags_for_restore=("--swa-full",))
        return Reuse(ReuseKind.FULL)

    def restore_helps(self, swa_full: bool | None = None, checkpoints_in_files: bool | None = None) -> bool:
        """Whether a restored slot file can resume (saves prefill) on a server with this model.

        `swa_full`: llama-server runs with --swa-full. `checkpoints_in_files`: its slot files carry the
        context checkpoints (see `file_has_checkpoints`). None means unknown and is read as llama-server's
        default (no --swa-full; upstream writes no checkpoints). UNKNOWN models keep the old behaviour (True).
        """
        kind = self.prefix_reuse().kind
        if kind is ReuseKind.NEEDS_SWA_FULL:
            return swa_full is True or checkpoints_in_files is True
        if kind is ReuseKind.CHECKPOINTS_ONLY:
            return checkpoints_in_files is True
        return kind in (ReuseKind.FULL, ReuseKind.UNKNOWN)


def _row(cache_type: str, n_values: int) -> int:
    try:
        block, size = CACHE_TYPES[cache_type.lower()]
    except KeyError:
        raise ValueError(f"unknown KV cache type {cache_type!r}; known: {', '.join(CACHE_TYPES)}") from None
    return n_values * size // block


# --- reading the header -----------------------------------------------------------------------------------

def _int(v: Any, default: int = 0) -> int:
    """A count from the header: GGUF stores them unsigned, so a negative one is damage, read as absent."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, int):
        return v if v >= 0 else default
    return default


def _is_array(v: Any) -> bool:
    return isinstance(v, Sequence) and not isinstance(v, str | bytes)


def _per_layer(v: Any, n: int, default: int) -> list[int]:
    """llama_model_loader::get_key_or_arr: an array of n values, or one value repeated n times."""
    if _is_array(v):
        vals = [_int(x, default) for x in v]
        return (vals + [default] * n)[:n]
    return [_int(v, default)] * n


def _length(v: Any) -> int:
    """Element count of an array value, also of one the header reader left unread (it keeps the length)."""
    if isinstance(v, str | bytes):
        return 0
    try:
        return len(v)
    except TypeError:
        return 0


def _pattern(n: int, period: int, dense_first: bool) -> list[bool]:
    """src/llama-hparams.cpp set_swa_pattern: every `period`-th layer is dense (0: all SWA, 1: none)."""
    if period <= 0:
        return [True] * n
    if dense_first:
        return [i % period != 0 for i in range(n)]
    return [i % period < period - 1 for i in range(n)]


def _from_metadata(meta: Mapping[str, Any]) -> ModelFacts:
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        return ModelFacts(architecture="", modelled=False)

    def key(suffix: str) -> Any:
        return meta.get(f"{arch}.{suffix}")

    n_layer = max(0, _int(key("block_count")))
    if n_layer > MAX_LAYERS:
        return ModelFacts(architecture=arch, modelled=False)
    n_embd = _int(key("embedding_length"))
    n_nextn = max(0, _int(key("nextn_predict_layers")))
    n_main = max(0, n_layer - n_nextn)   # hparams.n_layer(): the trunk without MTP heads
    heads = _per_layer(key("attention.head_count"), n_layer, 0)
    kv = _per_layer(key("attention.head_count_kv"), n_layer, 0) if key("attention.head_count_kv") is not None \
        else list(heads)
    n_ff = _per_layer(key("feed_forward_length"), n_layer, 0)
    n_head0 = heads[0] if heads else 0
    derived = n_embd // n_head0 if n_head0 > 0 else 0
    dk = _int(key("attention.key_length"), derived) if n_head0 > 0 else 0
    dv = _int(key("attention.value_length"), derived) if n_head0 > 0 else 0
    dk_swa = _int(key("attention.key_length_swa"), dk)
    dv_swa = _int(key("attention.value_length_swa"), dv)
    mla = _int(key("attention.key_length_mla")) > 0 and _int(key("attention.value_length_mla")) > 0
    n_vocab = _int(key("vocab_size")) or _length(meta.get("tokenizer.ggml.tokens"))

    recurrent, modelled = _recurrent_layers(arch, meta, n_layer, n_main, kv, n_ff)
    swa, window, chunked = _swa_layers(arch, meta, n_layer, n_main, recurrent)
    has_kv = _kv_layers(arch, meta, n_layer, n_main, recurrent, n_ff)

    return ModelFacts(
        architecture=arch, name=meta.get("general.name") if isinstance(meta.get("general.name"), str) else "",
        context_length=_int(key("context_length")), n_vocab=n_vocab, kv_heads=tuple(kv), head_dim_k=dk,
        head_dim_v=dv, head_dim_k_swa=dk_swa, head_dim_v_swa=dv_swa, mla=mla, window=window, chunked=chunked,
        swa=tuple(swa), recurrent=tuple(recurrent), has_kv=tuple(has_kv),
        recurrent_state_floats=_recurrent_state_floats(arch, meta, n_embd, n_head0) if any(recurrent) else 0,
        mrope=arch in _MROPE_ARCHS, modelled=modelled and arch != "deepseek4")


def _recurrent_layers(arch: str, meta: Mapping[str, Any], n_layer: int, n_main: int, kv: list[int],
                      n_ff: list[int]) -> tuple[list[bool], bool]:
    """Per-layer recurrent flags as llama.cpp sets `is_recr_impl`; the bool says whether the rule is known."""
    def key(suffix: str) -> Any:
        return meta.get(f"{arch}.{suffix}")

    if arch in RECURRENT_ARCHS or arch == "falcon-h1":
        return [True] * n_layer, True
    if arch in ("nemotron_h", "nemotron_h_moe"):
        return [i < n_main and kv[i] == 0 and n_ff[i] == 0 for i in range(n_layer)], True
    if arch in _RECR_BY_ZERO_KV:
        return [i < n_main and kv[i] == 0 for i in range(n_layer)], True
    listed = key("attention.recurrent_layers")
    interval = key("full_attention_interval")
    if arch in _RECR_BY_INTERVAL or listed is not None or interval is not None:
        if listed is not None:
            return [bool(x) for x in _per_layer(listed, n_layer, 0)], True
        every = _int(interval, 4) or 4
        return [i < n_main and (i + 1) % every != 0 for i in range(n_layer)], True
    if arch in HYBRID_ARCHS:   # deepseek4: compressed attention + SWA in its own cache type
        return [False] * n_layer, False
    if any(k.startswith(f"{arch}.ssm.") or k.startswith(f"{arch}.wkv.") for k in meta):
        # An architecture this table does not know but which carries SSM/RWKV keys: layers without KV heads
        # are the recurrent ones; without that distinction, all are.
        zero = [i < n_main and kv[i] == 0 for i in range(n_layer)]
        return (zero if any(zero) and not all(zero) else [True] * n_layer), False
    return [False] * n_layer, True


def _swa_layers(arch: str, meta: Mapping[str, Any], n_layer: int, n_main: int,
                recurrent: list[bool]) -> tuple[list[bool], int, bool]:
    """Per-layer SWA flags, the window and whether it is chunked, the way the arch's llama.cpp loader sets them."""
    none: tuple[list[bool], int, bool] = ([False] * n_layer, 0, False)
    window_v = meta.get(f"{arch}.attention.sliding_window")
    pattern_v = meta.get(f"{arch}.attention.sliding_window_pattern")
    has_window = window_v is not None
    window = _int(window_v)
    rule = _SWA_RULES.get(arch)
    if rule is None:
        # Unknown to this table: trust an explicit window plus pattern; a window alone is ignored by most
        # llama.cpp loaders (llama, qwen2, mistral), so it is ignored here too.
        if window <= 0 or pattern_v is None:
            return none
        rule = _SwaRule("period_or_array", 0)
    if rule.mode == "disabled":
        return none
    if rule.only_if_layers and n_main != rule.only_if_layers:
        return none
    if rule.only_if_window and window <= 0:
        return none
    if arch == "llama4" and has_window and window == 0:
        return none
    if rule.forced_window:
        window = rule.forced_window
    elif not has_window:
        window = rule.window
    if window <= 0:
        return none
    mode = rule.mode
    if mode == "attention_layers":
        flags = [i < n_main and not recurrent[i] for i in range(n_layer)]
    elif mode == "per_layer" or (mode == "period_or_array" and _is_array(pattern_v)):
        flags = [bool(x) for x in _per_layer(pattern_v, n_main, 0)] + [False] * (n_layer - n_main)
    else:
        period = rule.period
        if pattern_v is not None and not _is_array(pattern_v):
            period = _int(pattern_v, rule.period)
        flags = _pattern(n_main, period, rule.dense_first) + [False] * (n_layer - n_main)
    if not any(flags):
        return none
    return flags, window, rule.chunked


def _kv_layers(arch: str, meta: Mapping[str, Any], n_layer: int, n_main: int, recurrent: list[bool],
               n_ff: list[int]) -> list[bool]:
    """Which layers own KV cells: hybrids keep KV only in attention layers, Gemma 3n/4 share the last
    layers' KV (`n_layer_kv_from_start`), and MTP heads of some models sit in a separate context."""
    if arch in RECURRENT_ARCHS:
        return [False] * n_layer
    if arch == "falcon-h1":
        return [True] * n_layer
    if arch == "gemma3n":
        return [i < 20 for i in range(n_layer)]
    if arch == "gemma4":
        shared = _int(meta.get(f"{arch}.attention.shared_kv_layers"))
        return [i < n_layer - shared for i in range(n_layer)]
    if arch in ("nemotron_h", "nemotron_h_moe"):
        return [not recurrent[i] and n_ff[i] == 0 for i in range(n_layer)]
    if arch in _RECR_BY_INTERVAL or arch in ("step35", "hy_v3", "glm-dsa", "mimo2", "deepseek32"):
        return [i < n_main and not recurrent[i] for i in range(n_layer)]
    return [not r for r in recurrent]


def _recurrent_state_floats(arch: str, meta: Mapping[str, Any], n_embd: int, n_head: int) -> int:
    """src/llama-hparams.cpp n_embd_r() + n_embd_s(): one layer's rolling (conv/shift) and recurrent state."""
    def key(suffix: str) -> int:
        return _int(meta.get(f"{arch}.{suffix}"))

    wkv = key("wkv.head_size")
    if wkv:
        return (key("token_shift_count") or 2) * n_embd + n_embd * wkv
    d_conv, d_inner, d_state, n_group = (key("ssm.conv_kernel"), key("ssm.inner_size"), key("ssm.state_size"),
                                         key("ssm.group_count"))
    l_cache = key("shortconv.l_cache")
    kda = key("kda.head_dim")
    if l_cache:
        r = n_embd * (l_cache - 1)
    elif kda:
        r = 3 * (d_conv - 1 if d_conv > 0 else 3) * n_head * kda
    else:
        r = (d_conv - 1 if d_conv > 0 else 0) * (d_inner + 2 * n_group * d_state)
    if kda:
        s = kda * kda * n_head
    elif arch == "minimax-01":
        head = _int(meta.get(f"{arch}.attention.key_length"), n_embd // n_head if n_head else 0)
        s = head * head * n_head
    else:
        s = d_state * d_inner
    return r + s


# --- start-up log lines -----------------------------------------------------------------------------------
