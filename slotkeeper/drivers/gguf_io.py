"""Read the key/value header of the model file llama-server loaded, with the `gguf` package's `GGUFReader`.

Why: `slotlogic.model_facts` decides from it whether slot files can ever resume. `GGUFReader` is the format's
own maintained reader, but it builds a numpy view of every key, array element and tensor (seconds and
100+ MB on a small model), so a file is read once per (real path, size, mtime), in a worker thread with the
cyclic garbage collector paused (its passes held the GIL for hundreds of ms), and long arrays are kept as
`UnreadArray`. A model on another machine has nothing to read. Never raises: every failure is a `ReadStatus`
naming the exception type, never content. docs/model-capability.md has the measurements.
"""

from __future__ import annotations

import asyncio
import gc
import os
import resource
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Any, BinaryIO

from gguf import GGUFReader, GGUFValueType

from slotlogic.model_facts import ModelFacts

MAX_ARRAY = 4096            # longer arrays keep only their length (per-layer arrays have at most 512 entries)
MAX_STRING_ARRAY = 64       # short string arrays (general.languages) are decoded, vocabularies are not
CACHE_SIZE = 8
READ_WAIT = 30.0  # seconds a caller waits for another thread's read of the same file (100 MB: ~2 s)


class ReadStatus(Enum):
    OK = "ok"
    NO_PATH = "no-path"          # the server did not say which file it loaded
    MISSING = "missing"          # no such file here: the server runs elsewhere, or the path is relative to it
    UNREADABLE = "unreadable"    # exists but cannot be read (permissions, a directory, I/O error)
    NOT_GGUF = "not-gguf"        # GGUFReader refused it: wrong magic, unsupported version, truncated


@dataclass(frozen=True)
class UnreadArray:
    """A long array left unconverted (e.g. `tokenizer.ggml.tokens`): its element type and length only."""

    item_type: str
    length: int

    def __len__(self) -> int:
        return self.length


@dataclass(frozen=True)
class HeaderRead:
    status: ReadStatus
    metadata: dict[str, Any] | None = None
    seconds: float = 0.0
    peak_rss_growth: int = 0     # bytes the process's peak RSS grew while reading (the reader's cost)
    detail: str = ""


_cache: OrderedDict[tuple[str, int, int], HeaderRead] = OrderedDict()
_reading: dict[tuple[str, int, int], threading.Event] = {}  # files being read now, set when their read ends
_lock = threading.Lock()  # guards the two dicts only: never held across a file's open or read


def _value(field: Any) -> Any:
    """One `ReaderField` as a Python value; long arrays as their type and length only."""
    types = field.types
    if types and types[0] is GGUFValueType.ARRAY:
        n = len(field.data)
        item = types[-1] if len(types) > 1 else GGUFValueType.ARRAY
        limit = MAX_STRING_ARRAY if item is GGUFValueType.STRING else MAX_ARRAY
        if n > limit:
            return UnreadArray(item.name.lower(), n)
        return field.contents() if n else []
    return field.contents()


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _read(f: BinaryIO) -> HeaderRead:
    t0 = time.perf_counter()
    rss0 = _peak_rss()
    paused = gc.isenabled()
    gc.disable()  # see the module docstring: the collector's passes over the reader's objects stall the loop
    try:
        reader = GGUFReader(f)  # type: ignore[arg-type]  # numpy's memmap maps the open file itself
        meta = {name: _value(field) for name, field in reader.fields.items()}
        del reader
    except OSError as e:
        return HeaderRead(ReadStatus.UNREADABLE, seconds=time.perf_counter() - t0, detail=type(e).__name__)
    except Exception as e:  # ValueError (magic, version, empty), IndexError/TypeError (truncated): not a usable GGUF
        return HeaderRead(ReadStatus.NOT_GGUF, seconds=time.perf_counter() - t0, detail=type(e).__name__)
    finally:
        if paused:
            gc.enable()
    return HeaderRead(ReadStatus.OK, meta, time.perf_counter() - t0, max(0, _peak_rss() - rss0))


def _open(path: str | os.PathLike[str]) -> tuple[BinaryIO | None, HeaderRead | None]:
    """The model file, opened without blocking (a FIFO's open waits for a writer, for good: every worker
    thread hung on one), when it is a regular file; else why not."""
    try:
        fd = os.open(os.path.realpath(path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, HeaderRead(ReadStatus.MISSING)
    except (OSError, ValueError) as e:
        return None, HeaderRead(ReadStatus.UNREADABLE, detail=type(e).__name__)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None, HeaderRead(ReadStatus.UNREADABLE, detail="NotRegularFile")
    return os.fdopen(fd, "rb"), None


def read_header(path: str | os.PathLike[str] | None) -> HeaderRead:
    """The header's key/values of the GGUF at `path`, read once per (real path, size, mtime). Blocking: call it
    from a worker thread (`model_facts_async`). No lock is held while the file is opened or read: a caller
    asking for a file another thread is reading waits for that answer at most `READ_WAIT` seconds."""
    if path is None or str(path) == "":
        return HeaderRead(ReadStatus.NO_PATH)
    f, failed = _open(path)
    if f is None:
        return failed or HeaderRead(ReadStatus.UNREADABLE)
    with f:
        st = os.fstat(f.fileno())
        key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
        with _lock:
            hit = _cache.get(key)
            if hit is not None:
                _cache.move_to_end(key)
                return hit
            other = _reading.get(key)
            if other is None:  # one reader per file: two at once would only double the memory for one answer
                mine = _reading[key] = threading.Event()
        if other is not None:
            other.wait(READ_WAIT)
            with _lock:
                return _cache.get(key) or HeaderRead(ReadStatus.UNREADABLE, detail="TimeoutError")
        try:
            read = _read(f)
            with _lock:
                if read.status in (ReadStatus.OK, ReadStatus.NOT_GGUF):
                    _cache[key] = read
                    while len(_cache) > CACHE_SIZE:
                        _cache.popitem(last=False)
            return read
        finally:
            with _lock:
                _reading.pop(key, None)
            mine.set()


def model_facts(model_path: str | None) -> tuple[ModelFacts | None, HeaderRead]:
    """Facts about the model at `/props` `model_path`, if that file is on this machine, plus how reading went."""
    read = read_header(model_path)
    if read.metadata is None:
        return None, read
    return ModelFacts.from_metadata(read.metadata), read


async def model_facts_async(model_path: str | None) -> tuple[ModelFacts | None, HeaderRead]:
    return await asyncio.to_thread(model_facts, model_path)
