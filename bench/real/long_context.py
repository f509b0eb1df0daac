"""A copy of the SmolLM2 GGUF whose header claims a longer training context, for real agent-client prompts.

Why: Claude Code, OpenCode, Codex and Qwen Code send 10K-40K-token prompts, but SmolLM2-135M's GGUF says
`llama.context_length = 8192`, and llama-server caps each slot's context at the model's training context
(`n_ctx_train`), so those prompts fail with "exceeds the available context size". Raising the metadata
value lets the server allocate bigger slots. The weights are untouched: attention past 8K positions is
out of distribution for the model, which only matters for answer quality, never for what the tests and
captures look at (routes, headers, prompt layout, `cache_n`/`prompt_n`).

The copy lives in `run/models/` (git-ignored; never commit a model) and is edited in place through the
`gguf` package's memory-mapped reader, the same way llama.cpp's `gguf_set_metadata.py` changes a scalar.

    python -m bench.real.long_context --context-length 32768          # print the cached copy's path
    python -m bench.real.long_context --bench --threads 1 2 --tokens 10000   # prefill tokens/s per thread count
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import httpx

from bench.real.llama_server import LlamaServer, model_path

ROOT = Path(__file__).resolve().parents[2]
CACHE_DIR = ROOT / "run" / "models"
DEFAULT_CONTEXT = 32768


def context_length(path: str | Path) -> int:
    """The `<arch>.context_length` a GGUF declares (the server's `n_ctx_train`)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    return int(reader.fields[f"{arch}.context_length"].contents())


def long_context_model(length: int = DEFAULT_CONTEXT, source: str | Path | None = None,
                       cache_dir: str | Path | None = None) -> Path:
    """Path of a copy of `source` (default: the SmolLM2 GGUF) declaring `length` tokens of context.

    Made once per (source name, length) and reused while its size matches the source; written to a
    temporary name and renamed, so a concurrent or interrupted run never leaves a half-written model.
    """
    from gguf import GGUFReader

    src = Path(source or model_path())
    cache = Path(cache_dir) if cache_dir is not None else CACHE_DIR
    cache.mkdir(parents=True, exist_ok=True, mode=0o700)
    dest = cache / f"{src.stem}.ctx{length}.gguf"
    if dest.exists() and dest.stat().st_size == src.stat().st_size and context_length(dest) == length:
        return dest
    fd, tmp_name = tempfile.mkstemp(prefix=dest.name, suffix=".tmp", dir=cache)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        shutil.copyfile(src, tmp)
        os.chmod(tmp, 0o600)
        reader = GGUFReader(str(tmp), "r+")
        arch = reader.fields["general.architecture"].contents()
        field = reader.fields[f"{arch}.context_length"]
        field.parts[field.data[0]][0] = length  # a view into the writable memmap
        reader.data.flush()
        del reader
        if context_length(tmp) != length:
            raise RuntimeError(f"writing {arch}.context_length={length} into {tmp} did not stick")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def filler_prompt(tokens: int) -> str:
    """Plain text of roughly `tokens` SmolLM2 tokens (about 10 tokens per line below), all distinct lines."""
    return "".join(f"line {i} of the notes.\n" for i in range(tokens // 10))


def measure_prefill(model: str | Path, threads: int, tokens: int = 10_000, ctx: int = 16384) -> dict[str, float]:
    """Prefill speed of the server (xllamacpp or $LLAMA_SERVER_BIN) for one cold prompt of ~`tokens` tokens."""
    with LlamaServer(slots=1, ctx_per_slot=ctx, threads=threads, model=str(model)) as srv:
        started = time.monotonic()
        resp = httpx.post(srv.url + "/completion", timeout=900.0,
                          json={"prompt": filler_prompt(tokens), "n_predict": 1, "cache_prompt": False})
        wall = time.monotonic() - started
    resp.raise_for_status()
    t = resp.json()["timings"]
    return {"threads": threads, "prompt_n": t["prompt_n"], "prompt_ms": round(t["prompt_ms"], 1),
            "prompt_per_second": round(t["prompt_per_second"], 1), "wall_s": round(wall, 2)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context-length", type=int, default=DEFAULT_CONTEXT)
    ap.add_argument("--bench", action="store_true", help="measure prefill tokens/s of a cold prompt")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=10_000)
    a = ap.parse_args(argv)
    path = long_context_model(a.context_length)
    if not a.bench:
        print(path)
        return
    for threads in a.threads:
        print(json.dumps(measure_prefill(path, threads, a.tokens)), flush=True)


if __name__ == "__main__":
    main()
