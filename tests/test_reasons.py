"""The `why=` word: typed reasons rendered the way the log always printed them."""

from slotlogic.reasons import Unpinned, Why, render


def test_render():
    assert render(Why.KNOWN) == "known"
    assert render(Why.FREE_EMPTY, paged_in=True) == "free-empty+paged-in"
    assert render(Why.SHARED, displaced=True) == "displaced:shared"
    assert render(Why.EVICT_CHEAPEST, displaced=True, paged_in=True) == "displaced:evict-cheapest+paged-in"
    assert render(Why.CLIENT_SLOT, displaced=True) == "client-id_slot"
    assert render(None, Unpinned.SERVER_UNKNOWN) == "unpinned: server unknown"
    assert render(None) == "-"
