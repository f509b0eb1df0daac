"""Page or recompute, measured: force a page-in and force a prefill of the same conversation, move by move, and
count how often the cost model (`slotlogic.costs`, fed only by the moves before) picks the faster one; then
compress the slot files written (zstd levels 1-3, LZ4 when installed) and weigh a compressed restore.

    python -m bench.costs                                   # the embedded server, the 8B-layout tiny model
    python -m bench.costs --llama-server PATH --model GGUF [--ngl 99] [--ctk q8_0]
    python -m bench.costs --llama-url http://host:8080 --save-dir DIR   # a running server (its --slot-save-path)

Writes one JSON report (`--out`) and prints a table. Every move uses slot 0 only: erase, prefill (n_predict 1),
save, erase, restore, then the same request again (its `cache_n` says whether the restore resumed).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from slotlogic import costs
from slotlogic.costs import SlotFileAnswer, Speeds

DEFAULT_WORDS = (12, 20, 30, 45, 60, 80, 25, 50, 70, 100)  # ~3.9 tokens a word with SmolLM2's tokenizer


def prompt(words: int, seed: int) -> str:
    return " ".join(f"w{seed}x{i}" for i in range(words))


def move(c: httpx.Client, words: int, seed: int, save_dir: Path | None) -> dict[str, Any]:
    """One conversation, both ways: its prefill, its save, its restore (wall times and the server's)."""
    body = {"prompt": prompt(words, seed), "n_predict": 1, "id_slot": 0, "cache_prompt": True, "temperature": 0}
    c.post("/slots/0?action=erase")
    t = time.monotonic()
    first = c.post("/completion", json=body).json()
    prefill_wall = time.monotonic() - t
    name = f"bench-costs-{seed}.bin"
    t = time.monotonic()
    saved = c.post("/slots/0?action=save", json={"filename": name}).json()
    save_wall = time.monotonic() - t
    c.post("/slots/0?action=erase")
    t = time.monotonic()
    restored = c.post("/slots/0?action=restore", json={"filename": name}).json()
    restore_wall = time.monotonic() - t
    again = c.post("/completion", json=body).json()
    timings = first.get("timings") or {}
    return {"tokens": timings.get("prompt_n"), "prompt_ms": timings.get("prompt_ms"),
            "prompt_per_second": timings.get("prompt_per_second"), "prefill_s": prefill_wall,
            "save": saved, "save_s": save_wall, "restore": restored, "restore_s": restore_wall,
            "resumed_cache_n": (again.get("timings") or {}).get("cache_n"),
            "file": str(save_dir / name) if save_dir else None}


def weigh(moves: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cost model's choice for each move from the speeds of the moves before it (as the proxy learns them),
    against what was measured: restore (page-in) or prefill, which was faster."""
    speeds, prefill_avg, out = Speeds(), None, []
    for m in moves:
        tokens, n_bytes = m["tokens"], (m["save"] or {}).get("n_written", 0)
        choice = costs.page_in(tokens, n_bytes, speeds.rates(prefill_avg))
        faster = "restore" if m["restore_s"] < m["prefill_s"] else "prefill"
        picked = "restore" if choice is None or choice.worth else "prefill"   # unmeasured: restore, as ever
        out.append({"tokens": tokens, "mb": round(n_bytes / 1e6, 1), "prefill_s": round(m["prefill_s"], 3),
                    "restore_s": round(m["restore_s"], 4), "est_prefill_s": choice and round(choice.prefill_s, 3),
                    "est_restore_s": choice and round(choice.move_s, 4), "picked": picked, "faster": faster,
                    "right": picked == faster, "resumed": (m["resumed_cache_n"] or 0) >= tokens - 1})
        for action, wall in (("save", m["save_s"]), ("restore", m["restore_s"])):
            answer = SlotFileAnswer.parse(action, m[action], wall * 1000)
            if answer is not None:
                speeds.note(answer)
        pps = m["prompt_per_second"]
        if pps:
            prefill_avg = pps if prefill_avg is None else prefill_avg + 0.3 * (pps - prefill_avg)
            speeds.prefill(tokens, 0, pps)
    return out


def compression(path: Path, restore_bps: float | None) -> list[dict[str, Any]]:
    """zstd levels 1-3 and LZ4 (if installed) on one slot file: ratio, MB/s each way, and whether reading the
    compressed file at the measured restore speed plus decompressing beats restoring it as it is."""
    import zstandard

    data = path.read_bytes()
    mb = len(data) / 1e6
    codecs: list[tuple[str, Any, Any]] = [
        (f"zstd-{lvl}", zstandard.ZstdCompressor(level=lvl).compress, zstandard.ZstdDecompressor().decompress)
        for lvl in (1, 2, 3)]
    try:
        import lz4.frame as lz4f
        codecs.append(("lz4", lz4f.compress, lz4f.decompress))
    except ImportError:
        pass
    rows = []
    for name, comp, decomp in codecs:
        t = time.monotonic()
        packed = comp(data)
        c_s = time.monotonic() - t
        t = time.monotonic()
        back = decomp(packed)
        d_s = time.monotonic() - t
        assert back == data
        plain = len(data) / restore_bps if restore_bps else None
        packed_s = len(packed) / restore_bps + d_s if restore_bps else None
        rows.append({"codec": name, "mb": round(mb, 1), "ratio": round(len(data) / len(packed), 3),
                     "compress_mb_s": round(mb / c_s, 1), "decompress_mb_s": round(mb / d_s, 1),
                     "restore_s": plain and round(plain, 4), "compressed_restore_s": packed_s and round(packed_s, 4),
                     "wins": bool(plain and packed_s and packed_s < plain)})
    return rows


def measure(url: str, save_dir: Path | None, words: list[int] | tuple[int, ...] = DEFAULT_WORDS, kv: str = "f16",
            compress: bool = True) -> dict[str, Any]:
    """The server's own numbers (slot 0, which the caller keeps free): model, build, KV bytes per token, prefill
    tok/s and save/restore throughput from one move per size in `words`, the cost model's choice for each, and
    (`compress`, with the server's `save_dir` readable) the compression of the largest slot file."""
    with httpx.Client(base_url=url, timeout=600) as c:
        props = c.get("/props").json()
        moves = [move(c, w, i, save_dir) for i, w in enumerate(words)]
        c.post("/slots/0?action=erase")
    rows = weigh(moves)
    speeds = Speeds()
    for m in moves:
        for action, wall in (("save", m["save_s"]), ("restore", m["restore_s"])):
            answer = SlotFileAnswer.parse(action, m[action], wall * 1000)
            if answer is not None:
                speeds.note(answer)
    files = [m for m in moves if m["file"] and Path(m["file"]).exists()]
    biggest = max(files, key=lambda m: m["tokens"] or 0, default=None)
    packed = compression(Path(biggest["file"]), speeds.restore_bps) if biggest and compress else []
    for m in files:  # the bench's own slot files, not the server's
        Path(m["file"]).unlink(missing_ok=True)
    tok_s = [m["prompt_per_second"] for m in moves if m["prompt_per_second"]]
    return {"model": props.get("model_path"), "build": props.get("build_info"), "kv": kv,
            "kv_bytes_per_token": speeds.kv_bytes_per_token, "prefill_tok_s": [m["prompt_per_second"] for m in moves],
            "prefill_tok_s_max": max(tok_s, default=None),
            "save_gb_s": speeds.save_bps and speeds.save_bps / 1e9,
            "restore_gb_s": speeds.restore_bps and speeds.restore_bps / 1e9,
            "moves": rows, "right": sum(r["right"] for r in rows), "of": len(rows), "compression": packed}


def summary(report: dict[str, Any]) -> str:
    """One line: the model, the build and the speeds measured."""
    return (f"model {report['model']}  build {report['build']}  KV {report['kv']}: "
            f"{report['kv_bytes_per_token'] or 0:,.0f} bytes/token; prefill up to "
            f"{report['prefill_tok_s_max'] or 0:,.0f} tok/s; save {report['save_gb_s'] or 0:.2f} GB/s, "
            f"restore {report['restore_gb_s'] or 0:.2f} GB/s")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", help="a llama-server binary (default: the embedded xllamacpp server)")
    ap.add_argument("--model", help="GGUF (default: the 8B-KV-layout tiny model, written to a temp dir)")
    ap.add_argument("--ngl", type=int, help="layers on the GPU (-ngl)")
    ap.add_argument("--ctk", default="f16", help="KV cache type, K and V (-ctk/-ctv)")
    ap.add_argument("--llama-url", help="a running llama-server instead (its slot save path: --save-dir)")
    ap.add_argument("--save-dir", type=Path, help="with --llama-url: the server's --slot-save-path (compression)")
    ap.add_argument("--words", default=",".join(map(str, DEFAULT_WORDS)), help="conversation sizes, in words")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/costs.json"))
    a = ap.parse_args(argv)
    words = [int(w) for w in a.words.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="slotkeeper-costs-"))
    srv = None
    if a.llama_url:
        url, save_dir = a.llama_url.rstrip("/"), a.save_dir
    else:
        from bench.real.llama_server import LlamaServer
        if a.llama_server:
            os.environ["LLAMA_SERVER_BIN"] = a.llama_server
        model = a.model
        if model is None:
            from tests import tiny_models
            model = str(tiny_models.dense_8b_kv(tmp / "dense-8b-kv.gguf"))
        save_dir = tmp / "slots"
        save_dir.mkdir()
        extra = ["-ctk", a.ctk, "-ctv", a.ctk] if a.ctk != "f16" else []
        extra += ["-ngl", str(a.ngl)] if a.ngl is not None else []
        srv = LlamaServer(slots=1, ctx_per_slot=4096, threads=a.threads, slot_save_path=str(save_dir), model=model,
                          extra=extra, log_path=str(tmp / "server.log")).start()
        url = srv.url
    try:
        report = measure(url, save_dir, words, kv=a.ctk)
    finally:
        if srv is not None:
            srv.stop()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1))
    print(summary(report))
    print("| tokens | MB | prefill s | restore s | est. prefill s | est. restore s | picked | faster | resumed |")
    print("|---:|---:|---:|---:|---:|---:|---|---|---|")
    for r in report["moves"]:
        print(f"| {r['tokens']} | {r['mb']} | {r['prefill_s']} | {r['restore_s']} | {r['est_prefill_s']} | "
              f"{r['est_restore_s']} | {r['picked']} | {r['faster']} | {r['resumed']} |")
    print(f"cost model picked the faster move {report['right']}/{report['of']}")
    if report["compression"]:
        print("| codec | MB | ratio | compress MB/s | decompress MB/s | restore s | compressed restore s | wins |")
        print("|---|---:|---:|---:|---:|---:|---:|---|")
        for p in report["compression"]:
            print(f"| {p['codec']} | {p['mb']} | {p['ratio']} | {p['compress_mb_s']} | {p['decompress_mb_s']} | "
                  f"{p['restore_s']} | {p['compressed_restore_s']} | {p['wins']} |")


if __name__ == "__main__":
    main()
