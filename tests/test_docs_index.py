"""The README is the index of the docs: every page in `docs/` is linked from it, and every page it links exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_links_every_docs_page_and_only_pages_that_exist():
    readme = (ROOT / "README.md").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    linked = set(re.findall(r"docs/([\w.-]+\.md)", readme))
    assert pages - linked == set() and linked - pages == set()


def test_the_readme_is_for_users_short_and_starts_with_the_two_commands():
    """What it is, why, the two commands, the line, the page, and where to read more: figures and their stories
    live in docs/performance.md and docs/reliability.md, issue numbers and commit hashes nowhere in it."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 120
    first_block = readme.split("```")[1]
    assert "make run" in first_block and "make test" in first_block
    text = re.sub(r"session=[0-9a-f]{8}", "", readme)
    assert not re.search(r"#\d+|\b(issue|PR|pull request)s? \d+", text, re.I)
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"\d", w) and re.search(r"[a-f]", w)]
    assert hashes == []
    assert "docs/performance.md" in readme and "docs/reliability.md" in readme
