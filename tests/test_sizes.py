"""Sizes a reader can hold: no source file in stratum/ over 600 lines, no Python function over 80."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "stratum"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80


def sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".cpp", ".h"))


def test_no_source_file_is_over_600_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in sources() if (n := p.read_text().count("\n")) > MAX_FILE_LINES}
    assert not long, long


def test_no_function_is_over_80_lines():
    long = {}
    for path in (p for p in sources() if p.suffix == ".py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.name}"] = n
    assert not long, long
