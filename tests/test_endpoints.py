"""Which routes honour id_slot."""

import pytest

from slotlogic.endpoints import Route, classify


@pytest.mark.parametrize(("method", "path", "route"), [
    ("POST", "/v1/chat/completions", Route.PINNABLE), ("POST", "/chat/completions/", Route.PINNABLE),
    ("POST", "/completion?x=1", Route.PINNABLE), ("post", "/v1/responses", Route.PINNABLE),
    ("POST", "/infill", Route.PINNABLE), ("POST", "/v1/messages?beta=true", Route.ANTHROPIC),
    ("POST", "/messages", Route.ANTHROPIC), ("POST", "/v1/messages/count_tokens", Route.OTHER),
    ("GET", "/v1/chat/completions", Route.OTHER), ("POST", "/v1/embeddings", Route.OTHER),
    ("POST", "/tokenize", Route.OTHER),
])
def test_classify(method, path, route):
    assert classify(method, path) is route
