"""Shared fixtures: a scripted llama-server client for fault injection, and the addon chain as mitmproxy runs it."""

from __future__ import annotations

import inspect
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis.internal.conjecture import providers as hypothesis_providers
from mitmproxy import http
from mitmproxy.test import taddons, tflow

from slotkeeper import addon as addon_module
from tests.redis_fixtures import store_server, url  # noqa: F401 (a real redis-server, for the scale-out tests)

# Hypothesis (>= 6.131) now and then draws a literal of the local modules imported so far, so a derandomized
# test's examples depended on which test files were collected before it (test_sim_stateful alone failed, after
# tests a..r it passed): no local literals, the same examples in any order.
if hasattr(hypothesis_providers, "_get_local_constants") and hasattr(hypothesis_providers, "Constants"):
    NO_LOCAL_CONSTANTS = hypothesis_providers.Constants()
    hypothesis_providers._get_local_constants = lambda: NO_LOCAL_CONSTANTS

UP = "http://127.0.0.1:8080"


def skip_reason(report: pytest.TestReport) -> str:
    """The reason a skipped test gave (`longrepr` is (path, line, "Skipped: reason") for a skip)."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say at the end what was not tested and why, so a green run is never read as "everything ran"."""
    skipped = terminalreporter.stats.get("skipped", [])
    terminalreporter.write_line(f"not tested on this machine: {len(skipped)} skipped"
                                + (", because:" if skipped else ""))
    for reason, n in Counter(skip_reason(r) for r in skipped).most_common():
        terminalreporter.write_line(f"  {n} × {reason}")


class FakeLlama:
    """Stands in for `slotkeeper.drivers.llama_http.LlamaClient`: canned /props and /slots, counts every call."""

    def __init__(self, total: int = 4, marker: str = "<__media_a__>", n_ctx: int = 8192) -> None:
        self.props_data: dict[str, Any] | None = {
            "total_slots": total, "media_marker": marker, "build_info": "b0-test", "model_path": "/m.gguf",
            "default_generation_settings": {"n_ctx": n_ctx}}
        self.slots_data: list[dict[str, Any]] | None = [
            {"id": i, "n_ctx": n_ctx, "is_processing": False, "n_prompt_tokens": 0} for i in range(total)]
        self.calls: list[str] = []
        self.fail: Exception | None = None

    async def props(self) -> dict[str, Any] | None:
        self.calls.append("props")
        if self.fail:
            raise self.fail
        return self.props_data

    async def slots(self) -> list[dict[str, Any]] | None:
        self.calls.append("slots")
        return self.slots_data

    async def post_json(self, path: str, body: Any, timeout: float) -> tuple[int, Any]:
        self.calls.append(f"post {path}")
        return 0, None

    async def aclose(self) -> None:
        pass


@pytest.fixture
def fake_llama() -> FakeLlama:
    return FakeLlama()


class Proxy:
    """slotkeeper's addons in a `taddons` context, their hooks called in chain order as mitmproxy does."""

    def __init__(self, tctx: taddons.context, addons: list[Any]) -> None:
        self.tctx = tctx
        self.addons = addons
        self.rt = addons[0].rt

    def configure(self, **options: Any) -> None:
        self.tctx.configure(self.addons[0], **options)  # every addon's `configure` sees the change

    async def hook(self, name: str, flow: http.HTTPFlow) -> None:
        for a in self.addons:
            fn = getattr(a, name, None)
            if fn is not None:
                result = fn(flow)
                if inspect.isawaitable(result):
                    await result

    async def request(self, flow: http.HTTPFlow) -> http.HTTPFlow:
        await self.hook("request", flow)
        return flow

    async def answer(self, flow: http.HTTPFlow, response: http.Response) -> http.HTTPFlow:
        flow.response = response
        await self.hook("responseheaders", flow)
        await self.hook("response", flow)
        return flow

    def command(self, name: str, *args: str) -> Any:
        return self.tctx.master.commands.call_strings(name, list(args))

    async def settle(self) -> None:
        for up in self.rt.upstreams.values():
            await up.settle()


@pytest.fixture
def proxy(tmp_path, fake_llama) -> Iterator[Proxy]:
    addons = addon_module.make_addons()
    addons[0].rt.make_client = lambda _url: fake_llama
    with taddons.context(*addons) as tctx:
        p = Proxy(tctx, addons)
        p.configure(slots_state_dir=str(tmp_path / "state"), slots_probe_interval=0,
                    slots_log_requests="mitmproxy")  # caplog sees the per-request line
        yield p


def chat(first: str = "task A", system: str = "You are a coding agent. " * 20, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": first}],
            **extra}


def flow(body: Any, path: str = "/v1/chat/completions", method: str = "POST", headers: dict[str, str] | None = None,
         raw: bytes | None = None) -> http.HTTPFlow:
    content = raw if raw is not None else json.dumps(body).encode()
    req = http.Request.make(method, UP + path, content, {"content-type": "application/json", **(headers or {})})
    return tflow.tflow(req=req)


def sent(f: http.HTTPFlow) -> dict[str, Any]:
    return json.loads(f.request.get_content())


def streamed(f: http.HTTPFlow, body: bytes, step: int = 7) -> bytes:
    """Feed `body` to the flow's stream callable in `step`-byte chunks plus the closing b"", and join what
    mitmproxy would send on: a callable may return bytes or a list of chunks (an empty list sends nothing)."""
    out = b""
    for chunk in [body[i:i + step] for i in range(0, len(body), step)] + [b""]:
        got = f.response.stream(chunk)
        out += got if isinstance(got, bytes) else b"".join(got)
    return out
