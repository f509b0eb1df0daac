"""Model capability checks: GGUF headers the test writes itself (gguf.GGUFWriter), the real SmolLM2 file,
and one real llama-server save that checks the slot-file size estimate to the byte."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from bench.real.llama_server import LlamaServer, model_path
from slotkeeper.drivers import gguf_io
from slotlogic.model_facts import ModelFacts, ReuseKind
from slotlogic.wording import describe
from tests import tiny_models


def write_gguf(path: Path, arch: str, fill: Callable[[gguf.GGUFWriter], None], *, vocab: int = 0) -> Path:
    """A metadata-only model file: header key/values from `fill`, an optional vocabulary, one tiny tensor."""
    w = gguf.GGUFWriter(str(path), arch)
    fill(w)
    if vocab:
        w.add_token_list([f"tok{i}" for i in range(vocab)])
        w.add_token_types([1] * vocab)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def facts_of(path: Path) -> ModelFacts:
    meta = gguf_io.read_header(path).metadata
    assert meta is not None
    return ModelFacts.from_metadata(meta)


def common(w: gguf.GGUFWriter, layers: int, ctx: int = 8192, embd: int = 256, heads: int = 8) -> None:
    w.add_block_count(layers)
    w.add_context_length(ctx)
    w.add_embedding_length(embd)
    w.add_head_count(heads)


# --- a plain attention model ------------------------------------------------------------------------------

def test_plain_llama_style_model_reuses_every_prefix(tmp_path):
    def fill(w: gguf.GGUFWriter) -> None:
        common(w, layers=4, embd=256, heads=8)   # no key_length: head dim = 256 / 8 = 32
        w.add_head_count_kv(2)
        w.add_sliding_window(4096)               # a Mistral-style key llama.cpp ignores for `llama`

    f = facts_of(write_gguf(tmp_path / "llama.gguf", "llama", fill, vocab=5000))
    assert (f.architecture, f.block_count, f.head_dim_k, f.head_dim_v, f.n_vocab) == ("llama", 4, 32, 32, 5000)
    assert f.kv_bytes_per_token() == 4 * 2 * (32 + 32) * 2                   # f16
    assert f.kv_bytes_per_token("q8_0", "q8_0") == 4 * 2 * (64 * 34 // 32)   # 34 bytes per 32 values
    assert f.kv_bytes_per_token("q8_0", "q4_0") == 4 * (68 + 64 * 18 // 32)
    reuse = f.prefix_reuse()
    assert reuse.kind is ReuseKind.FULL and reuse.flags_for_restore == ()
    assert f.restore_helps(None) and f.restore_helps(False) and f.restore_helps(True)
    assert describe(f) == [
        "model: llama, 4 layers, 2 KV heads × 32+32 dims: ~1.0 KB KV per token (f16); "
        "a slot file ~1.0 MB per 1K tokens; prefixes reusable"]
    with pytest.raises(ValueError):
        f.kv_bytes_per_token("q3_k")


# --- sliding-window models --------------------------------------------------------------------------------

def test_gemma3_style_sliding_window_needs_swa_full(tmp_path):
    def fill(w: gguf.GGUFWriter) -> None:
        common(w, layers=12, embd=640, heads=4)
        w.add_head_count_kv(1)
        w.add_key_length(256)
        w.add_value_length(256)
        w.add_sliding_window(512)            # no pattern key: llama.cpp's gemma3 default, every 6th dense

    f = facts_of(write_gguf(tmp_path / "gemma3.gguf", "gemma3", fill))
    assert f.swa == tuple(i % 6 != 5 for i in range(12)) and f.window == 512
    row = 1 * (256 + 256) * 2
    assert f.kv_bytes_per_token(n_ctx=4096) == 2 * row + 10 * row * 512 / 4096
    assert f.kv_bytes_per_token(n_ctx=4096, swa_full=True) == 12 * row
    assert f.kv_bytes_per_token(n_ctx=256) == 12 * row             # a context shorter than the window
    # a slot file keeps only the last `window` cells of the SWA layers
    small, big = f.slot_file_bytes(400), f.slot_file_bytes(4000)
    assert big - small == 3600 * (2 * row + 4 + 12) + (512 - 400) * (10 * row + 12)
    reuse = f.prefix_reuse()
    assert reuse.kind is ReuseKind.NEEDS_SWA_FULL and reuse.flags_for_restore == ("--swa-full",)
    assert not f.restore_helps(None) and not f.restore_helps(False) and f.restore_helps(True)
    lines = describe(f, n_ctx=4096)
    assert lines[0].startswith("model: gemma3, 12 layers, 1 KV heads × 256+256 dims: ~")
    assert lines[1].startswith("sliding window 512 on 10 of 12 layers: prefixes beyond the window are reusable only "
                               "from llama-server's in-RAM context checkpoints, and a restored slot file cannot "
                               "resume, unless llama-server runs with --swa-full (then ~12.3 KB KV per token)")
    assert lines[2] == ("checkpoint and page files stay off: a restore could not resume "
                        "(start llama-server with --swa-full and set slots_swa_full)")
    assert len(describe(f, swa_full=True)) == 2 and "runs with --swa-full" in describe(f, swa_full=True)[1]
    assert f.restore_helps(False, checkpoints_in_files=True) and len(describe(f, checkpoints_in_files=True)) == 2
    # a file longer than its KV data carries checkpoints; one of exactly that size does not
    assert not f.file_has_checkpoints(300, f.slot_file_bytes(300))
    assert f.file_has_checkpoints(300, f.slot_file_bytes(300) + 12 + 40 + 5000)
    assert len(describe(f, files_wanted=False)) == 2


def test_sliding_window_rules_follow_llama_cpp_per_architecture(tmp_path):
    def model(arch: str, layers: int, **kv: object) -> ModelFacts:
        def fill(w: gguf.GGUFWriter) -> None:
            common(w, layers=layers)
            if "window" in kv:
                w.add_sliding_window(int(kv["window"]))  # type: ignore[call-overload]
            if "pattern" in kv:
                w.add_sliding_window_pattern(kv["pattern"])  # type: ignore[arg-type]
            if "shared" in kv:
                w.add_shared_kv_layers(int(kv["shared"]))  # type: ignore[call-overload]
        return facts_of(write_gguf(tmp_path / f"{arch}-{len(os.listdir(tmp_path))}.gguf", arch, fill))

    assert model("gemma3", 12).n_swa_layers == 0                                  # gemma3 without a window
    g2 = model("gemma2", 8)                                                       # default 4096, every 2nd dense
    assert (g2.window, g2.swa) == (4096, (True, False) * 4)
    assert model("gemma2", 8, pattern=4).swa == (True, True, True, False) * 2     # scalar period from the header
    assert model("gpt-oss", 6, window=128).swa == (True, False) * 3
    assert model("cohere2", 8, window=4096).swa == (True, True, True, False) * 2
    l4 = model("llama4", 8)                                                       # chunked 8192, 3 of 4 layers
    assert (l4.window, l4.chunked, l4.n_swa_layers) == (8192, True, 6)
    assert model("llama4", 8, window=0).n_swa_layers == 0
    pattern = [True, True, True, True, False, True, True, True, True, False]
    g4 = model("gemma4", 10, window=1024, pattern=pattern, shared=4)              # per-layer bools, shared KV
    assert g4.swa == tuple(pattern) and g4.has_kv == (True,) * 6 + (False,) * 4
    assert g4.prefix_reuse().kind is ReuseKind.NEEDS_SWA_FULL
    assert model("gemma3n", 30, window=512).has_kv == (True,) * 20 + (False,) * 10
    assert model("smallthinker", 8, window=100).swa == (False, True, True, True) * 2   # dense first, 4096 forced
    assert model("exaone4", 30, window=4096).n_swa_layers == 0                   # SWA only in the 64-layer model
    assert model("phi3", 4, window=2048).n_swa_layers == 0                       # llama.cpp disables Phi SWA
    assert model("qwen2", 4, window=4096).n_swa_layers == 0                      # a window alone is ignored
    assert model("somenewarch", 4, window=256, pattern=2).n_swa_layers == 2      # window + pattern: trusted


# --- recurrent and hybrid models --------------------------------------------------------------------------

def ssm(w: gguf.GGUFWriter, d_inner: int = 512, d_state: int = 16, d_conv: int = 4, groups: int = 0) -> None:
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(16)
    if groups:
        w.add_ssm_group_count(groups)


def test_hybrid_model_reuses_only_from_checkpoints(tmp_path):
    def fill(w: gguf.GGUFWriter) -> None:
        common(w, layers=8, embd=256, heads=4)
        w.add_head_count_kv(2)
        w.add_key_length(64)
        w.add_value_length(64)
        w.add_full_attention_interval(4)     # layers 3 and 7 attend, the rest are linear attention
        ssm(w, d_inner=512, d_state=32, d_conv=4, groups=2)

    f = facts_of(write_gguf(tmp_path / "qwen3next.gguf", "qwen3next", fill))
    assert f.recurrent == tuple((i + 1) % 4 != 0 for i in range(8))
    assert (f.n_attention_layers, f.n_recurrent_layers) == (2, 6)
    assert f.kv_bytes_per_token() == 2 * 2 * (64 + 64) * 2
    per_layer = (4 - 1) * (512 + 2 * 2 * 32) + 32 * 512          # llama-hparams.cpp n_embd_r() + n_embd_s()
    assert f.recurrent_state_bytes() == 6 * per_layer * 4
    reuse = f.prefix_reuse()
    assert reuse.kind is ReuseKind.CHECKPOINTS_ONLY and not reuse.restore_fixable
    assert not f.restore_helps(None) and not f.restore_helps(True)
    lines = describe(f)
    assert lines[0].startswith("model: qwen3next, 8 layers (2 attention, 6 recurrent), 2 KV heads × 64+64 dims")
    assert "recurrent state per sequence" in lines[0]
    assert lines[1].startswith("recurrent state in 6 of 8 layers: a prefix is reusable only from llama-server's "
                               "in-RAM context checkpoints (--ctx-checkpoints, default 32;")
    assert "upstream slot files carry none, so a restored file cannot resume (llama.cpp #25913" in lines[1]
    assert lines[2] == "checkpoint and page files stay off: a restore could not resume"
    # a server whose slot files carry the checkpoints: restores resume, files stay on
    assert f.restore_helps(None, checkpoints_in_files=True)
    persisted = describe(f, checkpoints_in_files=True)
    assert len(persisted) == 2 and persisted[1].endswith(
        "this llama-server writes its checkpoints into slot files, so a restored file resumes from the newest "
        "one before the divergence")


def test_jamba_style_hybrid_marks_layers_without_kv_heads_recurrent(tmp_path):
    def fill(w: gguf.GGUFWriter) -> None:
        common(w, layers=8, embd=256, heads=8)
        w.add_head_count_kv([0, 0, 0, 8, 0, 0, 0, 8])
        ssm(w)

    f = facts_of(write_gguf(tmp_path / "jamba.gguf", "jamba", fill))
    assert f.recurrent == (True, True, True, False) * 2
    assert f.kv_bytes_per_token() == 2 * 8 * (32 + 32) * 2
    assert f.prefix_reuse().kind is ReuseKind.CHECKPOINTS_ONLY


@pytest.mark.parametrize("arch", ["mamba", "rwkv7"])
def test_pure_recurrent_model_has_no_per_token_cache(tmp_path, arch):
    def fill(w: gguf.GGUFWriter) -> None:
        common(w, layers=4, embd=256, heads=0)
        if arch == "mamba":
            ssm(w, d_inner=512, d_state=16, d_conv=4)
        else:
            w.add_wkv_head_size(64)

    f = facts_of(write_gguf(tmp_path / f"{arch}.gguf", arch, fill))
    assert f.kv_bytes_per_token() == 0 and f.n_recurrent_layers == 4
    state = 3 * 512 + 16 * 512 if arch == "mamba" else 2 * 256 + 256 * 64
    assert f.recurrent_state_bytes() == 4 * state * 4
    assert f.slot_file_bytes(5000) - f.slot_file_bytes(1000) == 4 * 4000   # only the token ids grow
    assert f.prefix_reuse().kind is ReuseKind.CHECKPOINTS_ONLY and not f.restore_helps(True)
    assert describe(f)[0].startswith(f"model: {arch}, 4 layers (0 attention, 4 recurrent), ")


def test_unknown_or_odd_headers_change_nothing():
    assert ModelFacts.from_metadata({}).prefix_reuse().kind is ReuseKind.UNKNOWN
    assert ModelFacts.from_metadata({}).restore_helps(None)
    odd = ModelFacts.from_metadata({"general.architecture": "llama", "llama.block_count": "many",
                                    "llama.attention.head_count_kv": ["x", None]})
    assert odd.prefix_reuse().kind is ReuseKind.FULL and odd.kv_bytes_per_token() == 0
    assert ModelFacts.from_metadata({"general.architecture": "bert"}).prefix_reuse().kind is ReuseKind.NO_MEMORY
    assert describe(ModelFacts.from_metadata({}))[0].startswith("model: header not understood")


values = st.one_of(st.none(), st.booleans(), st.integers(-5, 1 << 40), st.floats(allow_nan=True), st.text(max_size=5),
                   st.lists(st.one_of(st.integers(-2, 600), st.booleans()), max_size=40))


@settings(max_examples=300, deadline=None)
@example(arch="llama", kv={"attention.head_count": None, "block_count": True, "ssm.inner_size": -118.0,
                          "ssm.conv_kernel": 2})  # a negative count once gave a negative state size
@given(arch=st.sampled_from(["llama", "gemma2", "gemma3", "gemma4", "llama4", "qwen3next", "jamba", "mamba",
                             "rwkv7", "nemotron_h", "lfm2", "x"]),
       kv=st.dictionaries(st.sampled_from(["block_count", "attention.head_count", "attention.head_count_kv",
                                           "attention.sliding_window", "attention.sliding_window_pattern",
                                           "attention.key_length", "full_attention_interval", "ssm.inner_size",
                                           "ssm.conv_kernel", "context_length", "attention.recurrent_layers",
                                           "feed_forward_length", "nextn_predict_layers"]),
                          values, max_size=8))
def test_any_header_gives_facts_and_lines_without_raising(arch, kv):
    meta = {"general.architecture": arch, **{f"{arch}.{k}": v for k, v in kv.items()}}
    f = ModelFacts.from_metadata(meta)
    assert isinstance(describe(f), list)
    assert f.kv_bytes_per_token(n_ctx=4096) >= 0 and f.slot_file_bytes(100) > 0
    assert f.restore_helps(None) == (f.prefix_reuse().kind in (ReuseKind.FULL, ReuseKind.UNKNOWN))
    assert f.restore_helps(True, True) == (f.prefix_reuse().kind is not ReuseKind.NO_MEMORY)


# --- the header reader ------------------------------------------------------------------------------------

def test_reader_gives_back_what_the_writer_wrote(tmp_path):
    """gguf.GGUFWriter writes, the proxy's reading of gguf.GGUFReader's fields must give the same values back
    (long arrays as their length), and model facts from the file equal those from the written values."""
    written: dict[str, object] = {
        "general.architecture": "gemma4", "gemma4.block_count": 6, "gemma4.context_length": 8192,
        "gemma4.embedding_length": 256, "gemma4.attention.head_count": 8,
        "gemma4.attention.head_count_kv": [2, 2, 0, 2, 2, 0],
        "gemma4.attention.sliding_window_pattern": [True, False] * 3, "gemma4.attention.sliding_window": 512,
        "general.languages": ["en", "fr"], "x.f": 1.5, "x.b": True, "x.i": -7, "x.s": "name",
        "x.u64": 1 << 40,
    }

    def fill(w: gguf.GGUFWriter) -> None:
        common(w, layers=6)
        w.add_head_count_kv([2, 2, 0, 2, 2, 0])
        w.add_sliding_window_pattern([True, False] * 3)
        w.add_sliding_window(512)
        w.add_array("general.languages", ["en", "fr"])
        w.add_float32("x.f", 1.5)
        w.add_bool("x.b", True)
        w.add_int64("x.i", -7)
        w.add_string("x.s", "name")
        w.add_uint64("x.u64", 1 << 40)

    path = write_gguf(tmp_path / "m.gguf", "gemma4", fill, vocab=10000)
    read = gguf_io.read_header(path)
    assert read.status is gguf_io.ReadStatus.OK and read.metadata is not None
    meta = read.metadata
    for key, value in written.items():
        assert meta[key] == value, key
    tokens = meta["tokenizer.ggml.tokens"]
    assert isinstance(tokens, gguf_io.UnreadArray) and (tokens.item_type, len(tokens)) == ("string", 10000)
    assert isinstance(meta["tokenizer.ggml.token_type"], gguf_io.UnreadArray)
    assert meta["GGUF.tensor_count"] == 1
    expected = ModelFacts.from_metadata({**written, "tokenizer.ggml.tokens": [f"tok{i}" for i in range(10000)]})
    assert ModelFacts.from_metadata(meta) == expected and expected.n_vocab == 10000


def test_reader_reports_missing_unreadable_and_foreign_files(tmp_path):
    assert gguf_io.read_header(None).status is gguf_io.ReadStatus.NO_PATH
    assert gguf_io.read_header(tmp_path / "nope.gguf").status is gguf_io.ReadStatus.MISSING
    assert gguf_io.read_header(tmp_path).status is gguf_io.ReadStatus.UNREADABLE
    (tmp_path / "x.bin").write_bytes(b"not a model at all")
    assert gguf_io.read_header(tmp_path / "x.bin").status is gguf_io.ReadStatus.NOT_GGUF
    (tmp_path / "empty.gguf").write_bytes(b"")
    assert gguf_io.read_header(tmp_path / "empty.gguf").status is not gguf_io.ReadStatus.OK
    good = write_gguf(tmp_path / "t.gguf", "llama", lambda w: common(w, 2), vocab=3000)
    full = good.read_bytes()
    for cut in (10, 100, len(full) // 2):   # cut inside the counts, the keys, the vocabulary
        (tmp_path / f"cut{cut}.gguf").write_bytes(full[:cut])
        read = gguf_io.read_header(tmp_path / f"cut{cut}.gguf")
        assert read.status is gguf_io.ReadStatus.NOT_GGUF and read.metadata is None, cut
        assert read.detail.isidentifier()   # a type name, never content
    facts, read = gguf_io.model_facts(str(tmp_path / "remote-only.gguf"))
    assert facts is None and read.status is gguf_io.ReadStatus.MISSING


def test_a_file_is_read_once_until_it_changes(tmp_path):
    path = write_gguf(tmp_path / "c.gguf", "llama", lambda w: common(w, 2), vocab=100)
    first = gguf_io.read_header(path)
    assert gguf_io.read_header(str(path)) is first           # cached by real path, size and mtime
    os.utime(path, ns=(1, 1))                                 # a replaced file (new mtime) is read again
    again = gguf_io.read_header(path)
    assert again is not first and again.metadata == first.metadata


def test_a_model_path_that_blocks_holds_no_thread_and_no_lock(tmp_path):
    """A FIFO at the model path (a new media_marker each probe asks again): opening it for reading waits for a
    writer, for good. Before, the reader held its lock across that open: every worker thread hung behind it,
    new sessions timed out at 45 s and mitmdump ignored SIGINT. Now each read ends at once, and a real file is
    read meanwhile."""
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    answers: list[gguf_io.HeaderRead] = []
    threads = [threading.Thread(target=lambda: answers.append(gguf_io.read_header(fifo)), daemon=True)
               for _ in range(6)]
    for t in threads:
        t.start()
    real = write_gguf(tmp_path / "real.gguf", "llama", lambda w: common(w, 2))
    try:
        for t in threads:
            t.join(5)
        other = threading.Thread(target=lambda: answers.append(gguf_io.read_header(real)), daemon=True)
        other.start()
        other.join(5)
        assert [t.is_alive() for t in (*threads, other)] == [False] * 7
        assert [a.status for a in answers[:6]] == [gguf_io.ReadStatus.UNREADABLE] * 6
        assert answers[6].status is gguf_io.ReadStatus.OK
    finally:  # a writer lets any reader still blocked in open() go
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


async def test_the_reader_runs_off_the_event_loop():
    """GGUFReader takes ~2 s on the real SmolLM2 file: the event loop must keep running meanwhile."""
    gguf_io._cache.clear()  # a fresh read, not a cached one
    gaps: list[float] = []
    stop = False

    async def tick() -> None:
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    facts, read = await gguf_io.model_facts_async(model_path())
    stop = True
    await ticker
    print(f"SmolLM2 header via GGUFReader: {read.seconds:.2f} s, peak RSS +{read.peak_rss_growth / 1e6:.0f} MB; "
          f"event-loop ticks {len(gaps)}, longest gap {max(gaps) * 1000:.0f} ms")
    assert facts is not None and read.status is gguf_io.ReadStatus.OK
    # the read takes ~2 s: a gap well under it shows it ran off the loop (0.25 s was missed once at load 13)
    assert len(gaps) > 10 and max(gaps) < 0.5
    t0 = time.perf_counter()
    assert (await gguf_io.model_facts_async(model_path()))[1] is read   # the second time: the cache
    assert time.perf_counter() - t0 < 0.1


# --- the real SmolLM2 file and a real llama-server --------------------------------------------------------

SMOLLM2_ROW = 3 * 64 * 2   # 3 KV heads × 64 dims × 2 bytes (f16), for K and again for V


def test_smollm2_file():
    facts, read = gguf_io.model_facts(model_path())
    assert facts is not None and read.status is gguf_io.ReadStatus.OK
    assert (facts.architecture, facts.block_count, facts.kv_heads[0], facts.head_dim_k) == ("llama", 30, 3, 64)
    assert facts.kv_bytes_per_token() == 30 * 2 * SMOLLM2_ROW == 23040
    assert facts.prefix_reuse().kind is ReuseKind.FULL and facts.restore_helps(None)
    assert describe(facts) == ["model: llama, 30 layers, 3 KV heads × 64+64 dims: ~23.0 KB KV per token (f16); "
                               "a slot file ~23.1 MB per 1K tokens; prefixes reusable"]


@pytest.mark.real
def test_slot_file_size_estimate_matches_a_real_save(tmp_path):
    """Save a slot after a prompt of ~600 tokens: `n_written` equals the estimate (state-file v4) within 0.1%."""
    facts, _ = gguf_io.model_facts(model_path())
    assert facts is not None
    save = tmp_path / "slots"
    save.mkdir()
    with LlamaServer(slots=2, ctx_per_slot=1024, slot_save_path=str(save), threads=1,
                     log_path=str(tmp_path / "s.log")) as srv:
        prompt = " ".join(f"item {i} is fine." for i in range(80))
        r = httpx.post(srv.url + "/completion", timeout=120,
                       json={"prompt": prompt, "n_predict": 2, "id_slot": 0, "cache_prompt": True})
        r.raise_for_status()
        t0 = time.perf_counter()
        s = httpx.post(srv.url + "/slots/0?action=save", json={"filename": "a.bin"}, timeout=60).json()
        save_s = time.perf_counter() - t0
        meta = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["meta"]
    n, written = s["n_saved"], s["n_written"]
    estimate = facts.slot_file_bytes(n, n_streams=2)
    print(f"n_saved={n} n_written={written} estimate={estimate} per token {written / n:.0f} "
          f"vs KV {facts.kv_bytes_per_token():.0f}; save {save_s * 1000:.0f} ms")
    assert n > 400
    assert abs(written - estimate) / written < 0.001
    assert abs(written / n - facts.kv_bytes_per_token()) / facts.kv_bytes_per_token() < 0.02
    assert (meta["n_embd"], meta["n_vocab"]) == (576, 49152)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tiny")
    return {"gemma3": tiny_models.gemma3(d / "gemma3.gguf"), "mamba": tiny_models.mamba(d / "mamba.gguf")}


@pytest.mark.real
@pytest.mark.parametrize(("kind", "swa_full"), [("gemma3", False), ("gemma3", True), ("mamba", False)])
def test_restore_verdict_matches_a_real_server(tmp_path, monkeypatch, tiny, kind, swa_full):
    """A tiny random-weight SWA (gemma3, window 32) or recurrent (mamba) model on a real llama-server: a
    slot saved after a ~270-token prompt is restored into another slot and the prompt is extended. Whether
    that reuses the restored tokens must be what `restore_helps` predicts from the header, --swa-full and
    whether the file carries checkpoints (read off `n_written`)."""
    facts, _ = gguf_io.model_facts(str(tiny[kind]))
    assert facts is not None
    assert facts.prefix_reuse().kind is (ReuseKind.NEEDS_SWA_FULL if kind == "gemma3" else ReuseKind.CHECKPOINTS_ONLY)
    monkeypatch.setenv("SLOTKEEPER_MODEL", str(tiny[kind]))
    save = tmp_path / "slots"
    save.mkdir()
    prompt = " ".join(f"item {i} is fine." for i in range(40))

    def ask(url: str, text: str, slot: int) -> tuple[int, int]:
        r = httpx.post(url + "/completion", timeout=120, json={"prompt": text, "n_predict": 1, "id_slot": slot,
                                                               "cache_prompt": True, "temperature": 0})
        r.raise_for_status()
        return r.json()["timings"]["cache_n"], r.json()["timings"]["prompt_n"]

    with LlamaServer(slots=2, ctx_per_slot=1024, slot_save_path=str(save), threads=1, swa_full=swa_full,
                     log_path=str(tmp_path / "s.log")) as srv:
        _, n_first = ask(srv.url, prompt, 0)
        s = httpx.post(srv.url + "/slots/0?action=save", json={"filename": "a.bin"}, timeout=60).json()
        r = httpx.post(srv.url + "/slots/1?action=restore", json={"filename": "a.bin"}, timeout=60)
        r.raise_for_status()
        cache_n, prompt_n = ask(srv.url, prompt + " And one more line.", 1)
    carries = facts.file_has_checkpoints(s["n_saved"], s["n_written"], n_streams=2)
    if not carries:   # then the file is the sequence state alone, and the estimate is exact
        assert s["n_written"] == facts.slot_file_bytes(s["n_saved"], n_streams=2)
    resumed = cache_n >= 0.9 * n_first
    print(f"{kind} swa_full={swa_full}: n_saved={s['n_saved']} n_written={s['n_written']} "
          f"KV estimate={facts.slot_file_bytes(s['n_saved'], n_streams=2)} checkpoints in file={carries}; "
          f"after restore cache_n={cache_n} prompt_n={prompt_n}")
    assert n_first > 250
    assert resumed == facts.restore_helps(swa_full, carries)
