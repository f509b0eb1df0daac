"""The Responses converter against a real llama-server: a Codex-shaped request (developer items, an answer,
a function call and its output, function and non-function tools) renders, through `bench.responses.to_chat`
and `/apply-template` + `/tokenize`, to exactly the prompt size the server's own `/v1/responses` handler
reports. Once with SmolLM2's template and once with a tool-aware one (tools and tool calls rendered too)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from bench import limit, responses
from bench.real.llama_server import LlamaServer
from tests.hermes_server import HermesServer
from tests.test_bench_clients import CODEX_TURN_2

pytestmark = pytest.mark.real


@pytest.fixture(scope="module", params=["smollm2", "hermes"])
def server(request: pytest.FixtureRequest) -> Iterator[str]:
    kind = HermesServer if request.param == "hermes" else LlamaServer
    with kind(slots=1, ctx_per_slot=4096, threads=1) as srv:
        yield srv.url


def served_prompt_tokens(url: str, body: dict) -> int:
    r = httpx.post(url + "/v1/responses", json={**body, "stream": False, "max_output_tokens": 1}, timeout=120)
    r.raise_for_status()
    return r.json()["usage"]["input_tokens"]


def rendered(url: str, body: dict) -> int:
    with httpx.Client(timeout=60) as c:
        return len(limit.render_body_tokens(url, responses.to_chat(body), c))


def test_codex_request_renders_to_what_the_server_prefilled(server: str) -> None:
    assert rendered(server, CODEX_TURN_2) == served_prompt_tokens(server, CODEX_TURN_2)


def test_a_string_input_with_instructions(server: str) -> None:
    body = {"model": "m", "instructions": "Answer in one word.", "input": "What is a trie?"}
    assert rendered(server, body) == served_prompt_tokens(server, body)


def test_the_check_notices_a_wrong_conversion(server: str) -> None:
    """Dropping the tool output from the rendered conversation must change the count (the check can fail)."""
    lost = {**CODEX_TURN_2, "input": [i for i in CODEX_TURN_2["input"] if i.get("type") != "function_call_output"]}
    assert rendered(server, lost) != served_prompt_tokens(server, CODEX_TURN_2)
