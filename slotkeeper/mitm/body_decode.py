"""Request bodies with a Content-Encoding, decoded with a cap, and never inflated at length on the event loop.

Why: mitmproxy's `get_content()` inflates the whole body on the event loop; a small gzip bomb took the
proxy past 1 GB and stalled every flow. Here decoding stops at `limit` (`slots_max_body_mb`; the request then
passes untouched), and anything but a small body is decoded, and re-encoded, in a worker thread (the codecs
release the GIL). Each codec's bound: zlib's `max_length`, a bounded zstd read, brotli's
`output_buffer_limit` where the binding has it, else one byte per call (the cap overshoots by one block).
"""

from __future__ import annotations

import asyncio
import io
import zlib
from types import ModuleType

import brotli

_zstandard: ModuleType | None
_zstd_std: ModuleType | None = None
try:  # mitmproxy 11
    import zstandard as _zstandard
except ImportError:  # mitmproxy 12: the standard library's API (3.14) or its backport
    _zstandard = None
    try:
        from compression import zstd as _zstd_std  # type: ignore[import-not-found,no-redef]
    except ImportError:
        try:
            from backports import zstd as _zstd_std  # type: ignore[import-not-found,no-redef]
        except ImportError:
            _zstd_std = None

INLINE_IN = 16 << 10   # encoded bytes decoded on the event loop...
INLINE_OUT = 256 << 10  # ...as long as the decoded body stays this small (a few hundred microseconds)
_BROTLI_STEP = 1       # brotli input bytes per call when the binding cannot bound its output (one call may
                       # still emit a whole block, ~8-16 MB: the cap is checked after each)


class TooLarge(ValueError):
    """The decoded body would pass the cap (nothing more is decoded)."""


BROTLI_BOUNDED = hasattr(brotli.Decompressor, "can_accept_more_data")  # 1.2+: process(..., output_buffer_limit)


def decode(raw: bytes, encoding: str, limit: int) -> bytes:
    """`raw` decoded per its Content-Encoding, at most `limit` bytes. Raises TooLarge past the cap and
    ValueError for an unknown or broken encoding (the caller treats the body as unreadable)."""
    enc = encoding.strip().lower()
    if enc in ("", "identity", "none"):
        if len(raw) > limit:
            raise TooLarge
        return raw
    if enc in ("gzip", "x-gzip"):
        return _zlib(raw, 16 + zlib.MAX_WBITS, limit)
    if enc == "deflate":
        try:
            return _zlib(raw, zlib.MAX_WBITS, limit)
        except TooLarge:
            raise
        except ValueError:
            return _zlib(raw, -zlib.MAX_WBITS, limit)  # raw deflate, as some clients send it
    if enc == "br":
        return _brotli(raw, limit)
    if enc == "zstd":
        return _zstd(raw, limit)
    raise ValueError("unsupported content-encoding")


def _zlib(raw: bytes, wbits: int, limit: int) -> bytes:
    out = bytearray()
    data = raw
    while data:
        d = zlib.decompressobj(wbits)
        buf = data
        while True:
            try:
                chunk = d.decompress(buf, limit + 1 - len(out))
            except zlib.error:
                raise ValueError("bad compressed data") from None
            out += chunk
            if len(out) > limit:
                raise TooLarge
            buf = d.unconsumed_tail
            if d.eof or (not buf and not chunk):
                break
        if not d.eof:
            raise ValueError("truncated compressed data")
        data = d.unused_data if wbits > 16 else b""  # gzip may hold several members
    return bytes(out)


def _brotli(raw: bytes, limit: int) -> bytes:
    d = brotli.Decompressor()
    out = bytearray()
    try:
        if BROTLI_BOUNDED:
            data = raw
            while True:
                chunk = d.process(data, output_buffer_limit=limit + 1 - len(out))  # type: ignore[call-arg]
                out += chunk
                if len(out) > limit:
                    raise TooLarge
                data = b""  # the rest of the input is buffered inside: drain it with empty calls
                if d.is_finished() or not chunk:
                    break
        else:
            for i in range(0, len(raw), _BROTLI_STEP):
                out += d.process(raw[i:i + _BROTLI_STEP])
                if len(out) > limit:
                    raise TooLarge
    except brotli.error:
        raise ValueError("bad compressed data") from None
    if not d.is_finished():
        raise ValueError("truncated compressed data")
    return bytes(out)


def _zstd(raw: bytes, limit: int) -> bytes:
    if _zstandard is not None:
        try:
            with _zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw), read_across_frames=True) as r:
                out = r.read(limit + 1)
        except _zstandard.ZstdError:
            raise ValueError("bad compressed data") from None
        if len(out) > limit:
            raise TooLarge
        return out
    if _zstd_std is None:
        raise ValueError("unsupported content-encoding")
    buf = bytearray()
    data = raw
    try:
        while data:
            d = _zstd_std.ZstdDecompressor()
            while True:
                chunk = d.decompress(data, max_length=limit + 1 - len(buf))
                buf += chunk
                if len(buf) > limit:
                    raise TooLarge
                data = b""
                if d.eof or (d.needs_input and not chunk):
                    break
            if not d.eof:
                raise ValueError("truncated compressed data")
            data = d.unused_data  # several frames
    except _zstd_std.ZstdError:
        raise ValueError("bad compressed data") from None
    return bytes(buf)


async def decode_async(raw: bytes, encoding: str, limit: int) -> bytes:
    """`decode`, inline for a small body, else in a worker thread (the event loop keeps serving flows)."""
    if len(raw) <= INLINE_IN:
        try:
            return decode(raw, encoding, min(limit, INLINE_OUT))
        except TooLarge:
            if limit <= INLINE_OUT:
                raise
    return await asyncio.to_thread(decode, raw, encoding, limit)


TOO_LARGE_BODY = object()  # a body past slots_max_body_mb: passed through untouched, unread


async def request_body(raw: bytes | None, encoding: bytes | None, limit: int) -> bytes | object | None:
    """A request's decoded body (None when absent or badly encoded), or TOO_LARGE_BODY past `limit`
    (`slots_max_body_mb`): decoded with the cap, and in a worker thread unless it is small."""
    if raw is None:
        return None
    if not encoding:
        return TOO_LARGE_BODY if len(raw) > limit else raw
    try:
        return await decode_async(raw, encoding.decode("latin-1"), limit)
    except TooLarge:
        return TOO_LARGE_BODY
    except ValueError:
        return None


def encode(body: bytes, encoding: str) -> bytes:
    """Encode a rewritten body back the way the client sent it (mitmproxy's encoders)."""
    from mitmproxy.net import encoding as mitm_encoding

    return mitm_encoding.encode(body, encoding.strip().lower())


async def encode_async(body: bytes, encoding: str) -> bytes:
    if len(body) <= INLINE_OUT:
        return encode(body, encoding)
    return await asyncio.to_thread(encode, body, encoding)
