"""The size rules the code is held to (docs/design.md, "Shape"): no class over 300 lines and no function over
8 parameters in the runtime's rooms. Checked on the source, so a class that grows past it fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ("slotkeeper/mitm", "slotkeeper/drivers", "slotlogic")
MAX_CLASS_LINES, MAX_PARAMS = 300, 8


def _nodes() -> list[tuple[str, ast.AST]]:
    out = []
    for room in ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            out += [(f"{path.relative_to(ROOT)}:{getattr(n, 'lineno', 0)}", n)
                    for n in ast.walk(ast.parse(path.read_text()))]
    return out


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)] + [x.arg for x in (a.vararg, a.kwarg) if x]
    return len([n for n in names if n not in ("self", "cls")])


def test_the_rooms_hold_code():
    assert len(_nodes()) > 10_000  # the walk found the sources (a wrong root would pass every rule)


@pytest.mark.parametrize("rule", ["class lines", "parameters"])
def test_no_class_over_300_lines_and_no_function_over_8_parameters(rule):
    if rule == "class lines":
        big = [f"{where} {n.name}: {n.end_lineno - n.lineno + 1}" for where, n in _nodes()
               if isinstance(n, ast.ClassDef) and (n.end_lineno or 0) - n.lineno + 1 > MAX_CLASS_LINES]
    else:
        big = [f"{where} {n.name}: {_params(n)}" for where, n in _nodes()
               if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and _params(n) > MAX_PARAMS]
    assert big == []


def test_mitmproxy_is_imported_only_by_the_addons_room():
    """README: mitmproxy lives only in `slotkeeper/mitm/`; the drivers and the core never import it."""
    found = []
    for room in ("slotkeeper/drivers", "slotlogic"):
        for path in sorted((ROOT / room).rglob("*.py")):
            for n in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                    [n.module or ""] if isinstance(n, ast.ImportFrom) else []
                found += [f"{path.relative_to(ROOT)}:{n.lineno}" for m in names if m.split(".")[0] == "mitmproxy"]
    assert found == []


def test_no_function_over_60_lines():
    """Size by cohesion: a function that does one thing fits a screen (docs/design.md, "Shape")."""
    long = [f"{where} {n.name}: {n.end_lineno - n.lineno + 1}" for where, n in _nodes()
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and (n.end_lineno or 0) - n.lineno + 1 > 60]
    assert long == []


def test_product_comments_cite_no_bench_run_or_seed():
    """Comments say why in general terms; the runs and seeds that showed it live in the tests and
    docs/performance.md, where they assert their figures."""
    cite = re.compile(r"mix-4|subagents-2x2|\bseeds? [0-9]{2,}\b|\bruns? [A-Z]{1,2}\b")
    found = [f"{p.relative_to(ROOT)}:{i}" for room in ("slotkeeper", "slotlogic")
             for p in sorted((ROOT / room).rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if cite.search(line)]
    assert found == []
