"""The `why=` word: typed reasons rendered the way the log always printed them."""

import re
from pathlib import Path

from slotlogic.reasons import Unpinned, Why, render


def test_render():
    assert render(Why.KNOWN) == "known"
    assert render(Why.FREE_EMPTY, paged_in=True) == "free-empty+paged-in"
    assert render(Why.SHARED, displaced=True) == "displaced:shared"
    assert render(Why.EVICT_CHEAPEST, displaced=True, paged_in=True) == "displaced:evict-cheapest+paged-in"
    assert render(Why.CLIENT_SLOT, displaced=True) == "client-id_slot"
    assert render(None, Unpinned.SERVER_UNKNOWN) == "unpinned: server unknown"
    assert render(None) == "-"


def test_every_why_word_is_in_the_docs_table_and_the_table_has_no_other():
    """docs/behaviour.md's table lists every word the line's `why=` can show, one row each: a new reason fails
    here until it is documented, and a removed one until its row goes."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "behaviour.md").read_text()
    table = text.split("<!-- why-table")[1].split("<!-- /why-table -->")[0].split("|---|---|")[1]
    rows = re.findall(r"^\| `([^`]+)` \|", table, flags=re.M)
    words = [w.value for w in Why] + [u.value for u in Unpinned]
    assert sorted(rows) == sorted(set(words)) and len(rows) == len(set(rows)), set(rows) ^ set(words)
