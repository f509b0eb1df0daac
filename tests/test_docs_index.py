"""The README is the index of the docs: every page in `docs/` is linked from it, and every page it links exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_links_every_docs_page_and_only_pages_that_exist():
    readme = (ROOT / "README.md").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    linked = set(re.findall(r"docs/([\w.-]+\.md)", readme))
    assert pages - linked == set() and linked - pages == set()
