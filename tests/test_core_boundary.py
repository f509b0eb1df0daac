"""The drivers and the addons use the core only through its public methods and the values they return: no
driver reads or writes a field of the core (`docs/design.md`, "Layers"). Checked on the source, so a new line
that reaches into the keeper fails here before it ships."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from slotlogic.intake import Recognition
from slotlogic.keeper import Keeper
from slotlogic.outcomes import Outcomes
from slotlogic.pager import Pager
from slotlogic.server_facts import ServerFacts
from slotlogic.table import SessionTable
from slotlogic.turns import Turns

ROOT = Path(__file__).resolve().parent.parent
PARTS = {"pager": Pager, "turns": Turns, "outcomes": Outcomes, "recognition": Recognition, "facts": ServerFacts,
         "table": SessionTable}  # what the keeper hands out, and the class of each


def _public(cls: type) -> set[str]:
    """A class's public methods and properties (not its fields)."""
    return {n for n, v in inspect.getmembers(cls) if not n.startswith("_") and (callable(v) or isinstance(v, property))}


def _chain(node: ast.AST) -> list[str]:
    out = []
    while isinstance(node, ast.Attribute):
        out.append(node.attr)
        node = node.value
    return out[::-1]


def violations(source: str) -> list[str]:
    keeper, parts = _public(Keeper), {k: _public(v) for k, v in PARTS.items()}
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and "keeper" in _chain(sub)[:-1]:
                    found.append(f"line {node.lineno}: assigns {'.'.join(_chain(sub))}")
        if not isinstance(node, ast.Attribute) or not isinstance(node.value, ast.Attribute):
            continue
        if node.value.attr == "keeper" and node.attr not in keeper:
            found.append(f"line {node.lineno}: keeper.{node.attr}")
        inner = node.value
        if (isinstance(inner.value, ast.Attribute) and inner.value.attr == "keeper" and inner.attr in parts
                and node.attr not in parts[inner.attr]):
            found.append(f"line {node.lineno}: keeper.{inner.attr}.{node.attr}")
    return found


def test_no_driver_or_addon_reads_or_writes_a_field_of_the_core():
    bad = {str(p.relative_to(ROOT)): v for d in ("slotkeeper/drivers", "slotkeeper/mitm")
           for p in sorted((ROOT / d).rglob("*.py")) if (v := violations(p.read_text()))}
    assert bad == {}


def test_the_check_finds_a_field_read_a_write_and_a_part_s_field():
    src = ("def f(up):\n    up.keeper.settings = 1\n    x = up.keeper.ledger\n    y = up.keeper.table.sessions\n"
           "    z = up.keeper.table.live('k', 0.0)\n    w = up.keeper.outcomes.answered\n")
    assert violations(src) == ["line 2: assigns keeper.settings", "line 2: keeper.settings",
                               "line 3: keeper.ledger", "line 4: keeper.table.sessions"]
