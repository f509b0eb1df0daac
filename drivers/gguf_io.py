"""Read the key/value header of the model file llama-server loaded, and nothing else.

Why: `slotlogic.model_facts` decides from the header whether slot files can ever resume (SWA and
recurrent models cannot); the proxy learns the file's path from `/props` `model_path` and reads it once at
start. The file may live on another machine (a remote server): then there is nothing to read, and the
caller logs that in one line.

Why not `gguf.GGUFReader`: it memory-maps the file and builds a numpy view for every array element and for
every tensor before returning. Measured on SmolLM2-135M (49,152-token vocabulary, 272 tensors) it took
1.7 s and left the process ~200 MB bigger; a 256K vocabulary costs several times that. This reader walks
the same format with buffered reads, stops at the end of the key/values (never touching tensor infos or
tensor data), and does not materialise long arrays (vocabularies, merges): it keeps their element type and
length as an `UnreadArray`. The format's constants (magic, versions, value types) come from the `gguf`
package, and the tests compare this reader's output with `GGUFReader`'s on the files they write.

Rule: never raise. Every failure is a `ReadStatus`; the detail names the exception type, never content.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, BinaryIO

from gguf.constants import GGUF_MAGIC, GGUFValueType

from slotlogic.model_facts import ModelFacts

SUPPORTED_VERSIONS = (2, 3)
MAX_ARRAY = 4096            # longer arrays stay unread (per-layer arrays have at most 512 entries)
MAX_STRING_ARRAY = 64       # short string arrays (general.languages) are decoded, vocabularies are not
MAX_STRING = 16 << 20       # a longer string means a corrupt or hostile header
MAX_KV = 1 << 16
MAX_ARRAY_LEN = 1 << 32

_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}


class ReadStatus(Enum):
    OK = "ok"
    NO_PATH = "no-path"          # the server did not say which file it loaded
    MISSING = "missing"          # no such file here: the server runs elsewhere, or the path is relative to it
    UNREADABLE = "unreadable"    # exists but cannot be read (permissions, a directory, I/O error)
    NOT_GGUF = "not-gguf"        # wrong magic, unsupported version, truncated or implausible header


@dataclass(frozen=True)
class UnreadArray:
    """A long array left unread (e.g. `tokenizer.ggml.tokens`): its element type and length only."""

    item_type: str
    length: int

    def __len__(self) -> int:
        return self.length


@dataclass(frozen=True)
class HeaderRead:
    status: ReadStatus
    metadata: dict[str, Any] | None = None
    seconds: float = 0.0
    bytes_read: int = 0
    detail: str = ""

    def log_line(self) -> str:
        """One line for the proxy's log: status, cost; the path is the operator's own configuration."""
        if self.status is ReadStatus.OK:
            n = len(self.metadata or {})
            return f"model header: {n} keys read in {self.seconds * 1000:.1f} ms ({self.bytes_read} bytes)"
        reason = {
            ReadStatus.NO_PATH: "llama-server did not report model_path",
            ReadStatus.MISSING: "model file not on this machine (remote llama-server?)",
            ReadStatus.UNREADABLE: "model file not readable here",
            ReadStatus.NOT_GGUF: "model file is not a GGUF this reader understands",
        }[self.status]
        return f"model header not read: {reason}{f' ({self.detail})' if self.detail else ''}; reuse assumed as before"


class _Corrupt(Exception):
    pass


class _Reader:
    def __init__(self, f: BinaryIO, order: str) -> None:
        self.f = f
        self.order = order

    def raw(self, n: int) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise _Corrupt("truncated")
        return b

    def skip(self, n: int) -> None:
        self.f.seek(n, os.SEEK_CUR)

    def scalar(self, code: str) -> Any:
        return struct.unpack(self.order + code, self.raw(struct.calcsize(code)))[0]

    def string(self, keep: bool = True) -> str | None:
        n = self.scalar("Q")
        if n > MAX_STRING:
            raise _Corrupt("string too long")
        if not keep:
            self.skip(n)
            return None
        return self.raw(n).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        """Step over `count` length-prefixed strings in 1 MiB chunks (a vocabulary is ~10^5 of them)."""
        fmt = self.order + "Q"
        buf = b""
        i = 0
        for _ in range(count):
            if i + 8 > len(buf):
                if i > len(buf):  # the previous string ran past the chunk: step over its tail
                    self.f.seek(i - len(buf), os.SEEK_CUR)
                    buf, i = b"", 0
                buf = buf[i:] + self.f.read(1 << 20)
                i = 0
                if len(buf) < 8:
                    raise _Corrupt("truncated")
            n = struct.unpack_from(fmt, buf, i)[0]
            if n > MAX_STRING:
                raise _Corrupt("string too long")
            i += 8 + n
        self.f.seek(i - len(buf), os.SEEK_CUR)  # give back the unread rest of the chunk (or skip the tail)

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype is GGUFValueType.STRING:
            return self.string()
        if vtype is GGUFValueType.ARRAY:
            return self.array()
        return self.scalar(_SCALARS[vtype])

    def array(self) -> Any:
        itype = _vtype(self.scalar("I"))
        n = self.scalar("Q")
        if n > MAX_ARRAY_LEN:
            raise _Corrupt("array too long")
        if itype is GGUFValueType.ARRAY:
            raise _Corrupt("nested arrays")  # llama.cpp's gguf.cpp rejects them too
        if itype is GGUFValueType.STRING:
            if n <= MAX_STRING_ARRAY:
                return [self.string() for _ in range(n)]
            self.skip_strings(n)
            return UnreadArray(itype.name.lower(), n)
        code = _SCALARS[itype]
        size = struct.calcsize(code)
        if n > MAX_ARRAY:
            self.skip(n * size)
            return UnreadArray(itype.name.lower(), n)
        return list(struct.unpack(f"{self.order}{n}{code}", self.raw(n * size)))


def _vtype(raw: int) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise _Corrupt(f"value type {raw}") from None


def _parse(f: BinaryIO) -> tuple[dict[str, Any], int]:
    head = f.read(8)
    if len(head) != 8 or struct.unpack("<I", head[:4])[0] != GGUF_MAGIC:
        raise _Corrupt("magic")
    order = "<"
    version = struct.unpack("<I", head[4:])[0]
    if version & 0xFFFF == 0:  # written on a machine of the other byte order (as GGUFReader detects it)
        order = ">"
        version = struct.unpack(">I", head[4:])[0]
    if version not in SUPPORTED_VERSIONS:
        raise _Corrupt(f"version {version}")
    r = _Reader(f, order)
    n_tensors, n_kv = r.scalar("Q"), r.scalar("Q")
    if n_kv > MAX_KV:
        raise _Corrupt("too many keys")
    meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
    for _ in range(n_kv):
        key = r.string()
        assert key is not None
        meta[key] = r.value(_vtype(r.scalar("I")))
    end = f.tell()
    if end > os.fstat(f.fileno()).st_size:  # a skip ran past the end of the file
        raise _Corrupt("truncated")
    return meta, end


def read_header(path: str | os.PathLike[str] | None) -> HeaderRead:
    """Read the header's key/values of the GGUF at `path` (tensor infos and data are never read)."""
    if path is None or str(path) == "":
        return HeaderRead(ReadStatus.NO_PATH)
    t0 = time.perf_counter()
    try:
        with open(path, "rb", buffering=1 << 16) as f:
            meta, n = _parse(f)
    except FileNotFoundError:
        return HeaderRead(ReadStatus.MISSING)
    except _Corrupt as e:
        return HeaderRead(ReadStatus.NOT_GGUF, seconds=time.perf_counter() - t0, detail=str(e))
    except (OSError, ValueError) as e:
        return HeaderRead(ReadStatus.UNREADABLE, seconds=time.perf_counter() - t0, detail=type(e).__name__)
    except Exception as e:  # fail open: an odd file must never break the proxy
        return HeaderRead(ReadStatus.NOT_GGUF, seconds=time.perf_counter() - t0, detail=type(e).__name__)
    return HeaderRead(ReadStatus.OK, meta, time.perf_counter() - t0, n)


def read_metadata(path: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """The header's key/values, or None when the file is missing, unreadable or not a GGUF."""
    return read_header(path).metadata


def model_facts(model_path: str | None) -> tuple[ModelFacts | None, HeaderRead]:
    """Facts about the model at `/props` `model_path`, if that file is on this machine, plus how reading went."""
    read = read_header(model_path)
    if read.metadata is None:
        return None, read
    return ModelFacts.from_metadata(read.metadata), read
