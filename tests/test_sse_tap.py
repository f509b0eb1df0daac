"""The stream callable never changes, drops or delays a byte, whatever fails inside it."""

from slotkeeper.mitm.sse_tap import SSETap
from slotlogic.answers import StreamObserver

STREAM = b'data: {"choices":[]}\n\ndata: {"timings":{"cache_n":5,"prompt_n":1}}\n\ndata: [DONE]\n\n'


def test_bytes_pass_and_numbers_are_read():
    kept: list[bytes] = []
    tap = SSETap(StreamObserver(), kept.append)
    out = b"".join(tap(STREAM[i:i + 3]) for i in range(0, len(STREAM), 3)) + tap(b"")
    assert out == STREAM and kept == [STREAM] and tap.observer.obs.cache_n == 5


def test_failures_inside_are_reported_once_and_never_escape():
    class Broken(StreamObserver):
        def feed(self, chunk: bytes) -> None:
            raise ValueError("TOP SECRET")

    errors: list[tuple[str, str]] = []

    def keep(body: bytes) -> None:
        raise OSError("no")

    tap = SSETap(Broken(), keep, on_error=lambda part, kind: errors.append((part, kind)))
    assert tap(b"data: 1\n\n") == b"data: 1\n\n" and tap(b"x") == b"x" and tap(b"") == b""
    assert errors == [("observer", "ValueError"), ("copy", "OSError")]
    angry = SSETap(Broken(), on_error=lambda part, kind: 1 / 0)  # even a failing reporter
    assert angry(b"y") == b"y"


def test_the_kept_copy_is_capped():
    kept: list[bytes] = []
    tap = SSETap(StreamObserver(), kept.append, max_copy=10)
    tap(b"0123456789")
    tap(b"more")
    tap(b"")
    assert kept == [b"0123456789"]


def test_a_chunk_that_gives_the_client_nothing_yet_is_no_chunk_at_all():
    """mitmproxy writes a returned b"" as a zero-length chunk, the end of a chunked body: a translated stream
    must return no chunks (`[]`) for llama-server's `:` keep-alive or half an event, or the client's answer
    ends there (a Claude Code request whose prefill took over 30 s was cut so)."""
    from slotkeeper.mitm.sse_tap import TranslatingTap
    from slotlogic.anthropic_answer import StreamConverter

    tap = TranslatingTap(StreamObserver(), StreamConverter())
    assert tap(b":\n\n") == [] and tap(b'data: {"choices":') == []
    first = tap(b'[{"index":0,"delta":{"role":"assistant","content":"Hi"}}],'
                b'"timings":{"cache_n":0,"prompt_n":9}}\n\n')
    assert isinstance(first, bytes) and b"message_start" in first
    assert SSETap(StreamObserver())(b":\n\n") == b":\n\n"  # passed through unchanged, as ever


def test_a_translated_stream_ended_for_a_too_large_event_is_logged_as_an_error():
    from slotkeeper.mitm.sse_tap import TranslatingTap
    from slotlogic.anthropic_answer import StreamConverter

    observer = StreamObserver()
    tap = TranslatingTap(observer, StreamConverter(max_line=100))
    out = tap(b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * 200)
    assert isinstance(out, bytes) and out.startswith(b"event: error\n") and b"api_error" in out
    assert tap(b'"}}]}\n\n') == [] and observer.obs.error_type == "too-large"
