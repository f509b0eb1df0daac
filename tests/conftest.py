"""Shared fixtures: a fake llama-server client for addon unit tests (fault injection, no sockets)."""

from __future__ import annotations

from typing import Any

import pytest


class FakeLlama:
    """Stands in for `drivers.llama_client.LlamaClient`: canned /props and /slots, counts every call."""

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

    async def aclose(self) -> None:
        pass


@pytest.fixture
def fake_llama() -> FakeLlama:
    return FakeLlama()
