"""The layers' import boundaries: the runtime core imports no server, web framework or client module;
`stratum.client` imports neither torch nor the engine. Read from the source (every import statement of
a module, wherever it sits, except under `if TYPE_CHECKING:`), and checked again in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WEB = ("fastapi", "starlette", "uvicorn", "sse_starlette", "httpx", "anthropic", "openai")
FORBIDDEN = {
    "stratum/engine": ("stratum.server", "stratum.client", "stratum.cluster", "stratum.bench", *WEB),
    "stratum/client": ("torch", "stratum.engine", "stratum.server", "stratum.models", "stratum.kernels"),
}
# what a client module may import inside a function, on purpose: the semantic cache's embedding model
# (sentence-transformers, which loads torch) is an optional extra, loaded when a cache is made
LAZY_ALLOWED = {"stratum/client/semantic_cache.py": ("sentence_transformers", "torch")}


def imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported module, is at module level) of every import outside `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[int, str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.extend((child.lineno, alias.name, top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                found.append((child.lineno, child.module, top))
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inner)

    visit(tree, True)
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_layer_imports_nothing_above_it(package):
    wrong = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for line, module, top in imports(path):
            if not top and module.split(".")[0] in LAZY_ALLOWED.get(rel, ()):
                continue
            if any(module == f or module.startswith(f + ".") for f in FORBIDDEN[package]):
                wrong.append(f"{rel}:{line}: imports {module}")
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_imports_inside_functions_and_skips_type_checking(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import fastapi\n"
                      "def f():\n    import starlette.responses\n")
    assert [(m, top) for _, m, top in imports(source)] == [("typing", True), ("starlette.responses", False)]


@pytest.mark.parametrize("module, absent", [
    ("stratum.engine.core", ("fastapi", "starlette", "uvicorn", "stratum.server", "stratum.client")),
    ("stratum.engine.process", ("fastapi", "starlette", "uvicorn", "stratum.server", "stratum.client")),
    ("stratum.client", ("torch", "stratum.engine", "stratum.server")),
])
def test_importing_a_layer_loads_nothing_above_it(module, absent):
    code = (f"import sys, {module}\n"
            f"print(','.join(sorted(m for m in sys.modules "
            f"if any(m == a or m.startswith(a + '.') for a in {absent!r}))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert loaded.strip() == "", f"importing {module} loaded {loaded.strip()}"
