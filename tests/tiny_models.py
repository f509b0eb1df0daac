"""Tiny random-weight GGUF models of the architectures SmolLM2 does not cover, written at test time.

Why: the reuse verdicts (`slotlogic.model_facts`) claim what a real llama-server does with a restored slot
file on a sliding-window or recurrent model. Such models are gigabytes; the claim only needs the cache
machinery, which does not care whether the weights are trained. So the tests write a few-MB model with
random weights, SmolLM2's tokenizer (copied from its header) and the smallest shapes llama.cpp's loaders
accept (src/models/gemma3.cpp, src/models/mamba.cpp `load_arch_tensors`). Nothing is downloaded and
nothing is committed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

from bench.real.llama_server import model_path

EMBD = 64


def _tokenizer(w: gguf.GGUFWriter) -> int:
    """Copy SmolLM2's BPE tokenizer into `w`; returns the vocabulary size."""
    r = gguf.GGUFReader(model_path())

    def get(key: str) -> Any:
        f = r.get_field(key)
        assert f is not None, key
        return f.contents()

    tokens = get("tokenizer.ggml.tokens")
    w.add_tokenizer_model(get("tokenizer.ggml.model"))
    w.add_tokenizer_pre(get("tokenizer.ggml.pre"))
    w.add_token_list(tokens)
    w.add_token_types(get("tokenizer.ggml.token_type"))
    w.add_token_merges(get("tokenizer.ggml.merges"))
    w.add_bos_token_id(get("tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(get("tokenizer.ggml.eos_token_id"))
    w.add_add_bos_token(False)
    return len(tokens)


def _finish(w: gguf.GGUFWriter, tensors: dict[str, np.ndarray]) -> None:
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _rand(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return (rng.standard_normal(shape) * 0.02).astype(np.float32)


def gemma3(path: Path, *, layers: int = 6, window: int = 32, ctx: int = 4096) -> Path:
    """A gemma3 model whose layers are SWA except every 6th (llama.cpp's default pattern for gemma3)."""
    rng = np.random.default_rng(1)
    heads, kv_heads, hd, ff = 4, 1, 16, 128
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(layers)
    w.add_context_length(ctx)
    w.add_embedding_length(EMBD)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(window)
    n_vocab = _tokenizer(w)
    ones = np.ones(EMBD, dtype=np.float32)
    t: dict[str, np.ndarray] = {"token_embd.weight": _rand(rng, n_vocab, EMBD).astype(np.float16),
                                "output_norm.weight": ones}
    for i in range(layers):
        t |= {f"blk.{i}.attn_norm.weight": ones, f"blk.{i}.attn_q.weight": _rand(rng, heads * hd, EMBD),
              f"blk.{i}.attn_k.weight": _rand(rng, kv_heads * hd, EMBD),
              f"blk.{i}.attn_v.weight": _rand(rng, kv_heads * hd, EMBD),
              f"blk.{i}.attn_output.weight": _rand(rng, EMBD, heads * hd),
              f"blk.{i}.post_attention_norm.weight": ones, f"blk.{i}.attn_k_norm.weight": np.ones(hd, np.float32),
              f"blk.{i}.attn_q_norm.weight": np.ones(hd, np.float32), f"blk.{i}.ffn_norm.weight": ones,
              f"blk.{i}.ffn_gate.weight": _rand(rng, ff, EMBD), f"blk.{i}.ffn_up.weight": _rand(rng, ff, EMBD),
              f"blk.{i}.ffn_down.weight": _rand(rng, EMBD, ff), f"blk.{i}.post_ffw_norm.weight": ones}
    _finish(w, t)
    return path


def mamba(path: Path, *, layers: int = 2, ctx: int = 4096) -> Path:
    """A pure recurrent Mamba model (expansion factor 2, as llama.cpp requires)."""
    rng = np.random.default_rng(2)
    d_inner, d_state, d_conv, dt_rank = 2 * EMBD, 16, 4, 4
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(layers)
    w.add_context_length(ctx)
    w.add_embedding_length(EMBD)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)
    w.add_layer_norm_rms_eps(1e-5)
    n_vocab = _tokenizer(w)
    t: dict[str, np.ndarray] = {"token_embd.weight": _rand(rng, n_vocab, EMBD).astype(np.float16),
                                "output_norm.weight": np.ones(EMBD, np.float32)}
    for i in range(layers):
        t |= {f"blk.{i}.attn_norm.weight": np.ones(EMBD, np.float32),
              f"blk.{i}.ssm_in.weight": _rand(rng, 2 * d_inner, EMBD),
              f"blk.{i}.ssm_conv1d.weight": _rand(rng, d_inner, d_conv),
              f"blk.{i}.ssm_conv1d.bias": np.zeros(d_inner, np.float32),
              f"blk.{i}.ssm_x.weight": _rand(rng, dt_rank + 2 * d_state, d_inner),
              f"blk.{i}.ssm_dt.weight": _rand(rng, d_inner, dt_rank),
              f"blk.{i}.ssm_dt.bias": np.zeros(d_inner, np.float32),
              f"blk.{i}.ssm_a": -np.ones((d_inner, d_state), np.float32),
              f"blk.{i}.ssm_d": np.ones(d_inner, np.float32),
              f"blk.{i}.ssm_out.weight": _rand(rng, EMBD, d_inner)}
    _finish(w, t)
    return path


def dense_8b_kv(path: Path, *, layers: int = 32, kv_heads: int = 8, head_dim: int = 128, ctx: int = 32768) -> Path:
    """A llama model with an 8B-class KV layout (32 layers × 8 KV heads × 128 dims: 128 KiB a token in f16, as
    Llama-3-8B) around a tiny hidden size (64), so slot files and save/restore times are an 8B model's while
    the weights stay ~20 MB. Attention is full size too (8 query heads of 128 dims): prefill slows with depth
    as a real model's does; only the matrix products of the hidden size are small."""
    rng = np.random.default_rng(3)
    heads, ff = kv_heads, 128
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(ctx)
    w.add_embedding_length(EMBD)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    n_vocab = _tokenizer(w)
    ones = np.ones(EMBD, dtype=np.float32)
    t: dict[str, np.ndarray] = {"token_embd.weight": _rand(rng, n_vocab, EMBD).astype(np.float16),
                                "output_norm.weight": ones}
    for i in range(layers):
        t |= {f"blk.{i}.attn_norm.weight": ones,
              f"blk.{i}.attn_q.weight": _rand(rng, heads * head_dim, EMBD).astype(np.float16),
              f"blk.{i}.attn_k.weight": _rand(rng, kv_heads * head_dim, EMBD).astype(np.float16),
              f"blk.{i}.attn_v.weight": _rand(rng, kv_heads * head_dim, EMBD).astype(np.float16),
              f"blk.{i}.attn_output.weight": _rand(rng, EMBD, heads * head_dim).astype(np.float16),
              f"blk.{i}.ffn_norm.weight": ones,
              f"blk.{i}.ffn_gate.weight": _rand(rng, ff, EMBD).astype(np.float16),
              f"blk.{i}.ffn_up.weight": _rand(rng, ff, EMBD).astype(np.float16),
              f"blk.{i}.ffn_down.weight": _rand(rng, EMBD, ff).astype(np.float16)}
    _finish(w, t)
    return path


def qwen3moe(path: Path, *, layers: int = 4, experts: int = 8, used: int = 2, ctx: int = 4096) -> Path:
    """A Qwen3-MoE model (src/models/qwen3moe.cpp): attention with Q/K norms, a router and `experts` FFNs per
    layer of which `used` run a token. Its KV cache is a plain attention cache: 4 layers × 2 KV heads × 32."""
    rng = np.random.default_rng(4)
    heads, kv_heads, hd, ff = 4, 2, 32, 64
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(layers)
    w.add_context_length(ctx)
    w.add_embedding_length(EMBD)
    w.add_feed_forward_length(ff)
    w.add_expert_feed_forward_length(ff)
    w.add_expert_count(experts)
    w.add_expert_used_count(used)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(1e-6)
    n_vocab = _tokenizer(w)
    ones = np.ones(EMBD, dtype=np.float32)
    t: dict[str, np.ndarray] = {"token_embd.weight": _rand(rng, n_vocab, EMBD).astype(np.float16),
                                "output_norm.weight": ones}
    for i in range(layers):
        t |= {f"blk.{i}.attn_norm.weight": ones, f"blk.{i}.attn_q.weight": _rand(rng, heads * hd, EMBD),
              f"blk.{i}.attn_k.weight": _rand(rng, kv_heads * hd, EMBD),
              f"blk.{i}.attn_v.weight": _rand(rng, kv_heads * hd, EMBD),
              f"blk.{i}.attn_output.weight": _rand(rng, EMBD, heads * hd),
              f"blk.{i}.attn_q_norm.weight": np.ones(hd, np.float32),
              f"blk.{i}.attn_k_norm.weight": np.ones(hd, np.float32), f"blk.{i}.ffn_norm.weight": ones,
              f"blk.{i}.ffn_gate_inp.weight": _rand(rng, experts, EMBD),
              f"blk.{i}.ffn_gate_exps.weight": _rand(rng, experts, ff, EMBD),
              f"blk.{i}.ffn_up_exps.weight": _rand(rng, experts, ff, EMBD),
              f"blk.{i}.ffn_down_exps.weight": _rand(rng, experts, EMBD, ff)}
    _finish(w, t)
    return path


def lfm2(path: Path, *, layers: int = 4, attention: tuple[int, ...] = (1, 3), ctx: int = 4096) -> Path:
    """A hybrid LFM2 model (src/models/lfm2.cpp): short-convolution layers (recurrent state: the last
    `l_cache` inputs) and attention layers at `attention`; a layer with 0 KV heads is a convolution one."""
    rng = np.random.default_rng(5)
    heads, kv_heads, hd, ff, l_cache = 4, 2, 16, 128, 3
    w = gguf.GGUFWriter(str(path), "lfm2")
    w.add_block_count(layers)
    w.add_context_length(ctx)
    w.add_embedding_length(EMBD)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv([kv_heads if i in attention else 0 for i in range(layers)])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_uint32("lfm2.shortconv.l_cache", l_cache)
    n_vocab = _tokenizer(w)
    ones = np.ones(EMBD, dtype=np.float32)
    t: dict[str, np.ndarray] = {"token_embd.weight": _rand(rng, n_vocab, EMBD).astype(np.float16),
                                "token_embd_norm.weight": ones}
    for i in range(layers):
        t |= {f"blk.{i}.attn_norm.weight": ones, f"blk.{i}.ffn_norm.weight": ones,
              f"blk.{i}.ffn_gate.weight": _rand(rng, ff, EMBD), f"blk.{i}.ffn_up.weight": _rand(rng, ff, EMBD),
              f"blk.{i}.ffn_down.weight": _rand(rng, EMBD, ff)}
        if i in attention:
            t |= {f"blk.{i}.attn_q.weight": _rand(rng, heads * hd, EMBD),
                  f"blk.{i}.attn_k.weight": _rand(rng, kv_heads * hd, EMBD),
                  f"blk.{i}.attn_v.weight": _rand(rng, kv_heads * hd, EMBD),
                  f"blk.{i}.attn_output.weight": _rand(rng, EMBD, heads * hd),
                  f"blk.{i}.attn_q_norm.weight": np.ones(hd, np.float32),
                  f"blk.{i}.attn_k_norm.weight": np.ones(hd, np.float32)}
        else:
            t |= {f"blk.{i}.shortconv.conv.weight": _rand(rng, EMBD, l_cache),
                  f"blk.{i}.shortconv.in_proj.weight": _rand(rng, 3 * EMBD, EMBD),
                  f"blk.{i}.shortconv.out_proj.weight": _rand(rng, EMBD, EMBD)}
    _finish(w, t)
    return path
