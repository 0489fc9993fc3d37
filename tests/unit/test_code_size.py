"""House size budgets (STYLE.md rule 11), enforced: no function over 80 lines, no module over
500, in the serving code (engine/, server/, kernels/) and the benchmarks (loadtest/)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(
    p for d in ("engine", "server", "kernels", "loadtest") for p in (ROOT / d).rglob("*.py")
)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_functions_fit_in_80_lines_and_modules_in_500(path: Path) -> None:
    text = path.read_text()
    assert len(text.splitlines()) <= 500, f"{path.name} has {len(text.splitlines())} lines"
    too_long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > 80
    ]
    assert not too_long, f"{path.name}: {too_long}"
