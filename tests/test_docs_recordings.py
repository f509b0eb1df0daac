"""The docs about the recordings stay in step with them: recordings/README.md lists every recording with its
flow count, and the example lines of docs/debugging.md name the sessions the recordings give."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORDINGS = ROOT / "recordings"


def test_the_recordings_readme_lists_every_recording_with_its_flows():
    manifest = json.loads((RECORDINGS / "manifest.json").read_text())
    files = {p.stem for p in RECORDINGS.glob("*.mitm")}
    assert files == set(manifest)
    rows = dict(re.findall(r"^\| `(\w+)\.mitm` \| .+? \| (\d+) \|", (RECORDINGS / "README.md").read_text(), re.M))
    assert set(rows) == files
    assert {name: int(flows) for name, flows in rows.items()} == {n: m["flows"] for n, m in manifest.items()}


def golden_sessions(name: str) -> set[str]:
    lines = (RECORDINGS / f"{name}.golden.json").read_text().strip().strip("[]").splitlines()
    return {json.loads(line.rstrip(","))["session"] for line in lines if line.strip()}


def test_the_debugging_examples_name_the_sessions_their_recording_gives():
    """Each command that reads a recording is followed by the lines it prints: the sessions there are the
    recording's (its golden decisions), not those of an older recording."""
    text = (ROOT / "docs" / "debugging.md").read_text()
    blocks = re.findall(r"```(\w*)\n(.*?)```", text, re.S)
    checked = 0
    for (lang, command), (_, output) in itertools.pairwise(blocks):
        named = re.search(r"recordings/(\w+)\.mitm", command)
        shown = set(re.findall(r"session=([0-9a-f]{8})", output))
        if lang == "sh" and named and shown:
            assert shown <= golden_sessions(named.group(1)), (named.group(1), shown - golden_sessions(named.group(1)))
            checked += 1
    assert checked >= 2
