"""Docs that stay true: every module, file, function, class, flag, metric and environment variable that
docs/*.md and the README name in backticks exists in the tree. A rename that leaves a doc behind fails here."""

from __future__ import annotations

import ast
import importlib.util
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
SOURCES = ("stratum", "scripts", "tests", ".ci", "deploy")
FILE = re.compile(r"^[\w./~$-]*\w\.(py|cpp|h|sh|md|json|toml|txt|png|gguf)(::\w+)?$|^[\w.-]+(/[\w.-]+)+/$")
MODULE = re.compile(r"^stratum(\.\w+)+$")
LOCATED = re.compile(r"^(?P<file>[\w/]+\.(py|cpp|h)):(?P<name>[A-Za-z_][\w.]*)$")
CALL = re.compile(r"^(?P<name>[A-Za-z_][\w.]*)\((.*)\)$")
QUALIFIED = re.compile(r"^(?P<cls>[A-Z]\w*[a-z]\w*)\.(?P<attr>[a-z_]\w*)$")
CLASS = re.compile(r"^[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+$")  # CamelCase: two humps at least
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")
METRIC = re.compile(r"^stratum_[a-z_]+(?=\{|$)")
ENV = re.compile(r"\$?(STRATUM_[A-Z_]+)")
STDLIB = ("builtins", "os", "mmap", "random", "math", "time", "json", "torch")
OTHER_TOOLS = ("llama-server", "llama-bench", "llama-quantize", "codex", "claude", "vllm", "pip", "npm", "python -m",
               "ray", "curl", "docker", "git", "make ", "apt", "uvicorn", "pytest")


def spans(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each inline code span, fenced blocks left out (they are examples, run elsewhere)."""
    out, fenced = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out += [(n, s.strip()) for s in re.findall(r"`([^`\n]+)`", line)]
    return out


@cache
def tracked_files() -> tuple[Path, ...]:
    return tuple(p for d in SOURCES + ("docs",) for p in (ROOT / d).rglob("*") if p.is_file()) + tuple(ROOT.glob("*"))


def python_files() -> list[Path]:
    return [p for p in tracked_files() if p.suffix == ".py" and "data" not in p.relative_to(ROOT).parts]


@cache
def _index() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Every name defined in the tree (functions, classes, methods, assignments, fields, C++ functions,
    structs and enums) -> its files; and each Python class's members."""
    names: dict[str, set[str]] = {}
    members: dict[str, set[str]] = {}
    for path in python_files():
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.setdefault(node.name, set()).add(rel)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.setdefault(node.id, set()).add(rel)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.setdefault(node.attr, set()).add(rel)
            if isinstance(node, ast.ClassDef):
                got = members.setdefault(node.name, set())
                for item in ast.walk(node):
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        got.add(item.name)
                    elif isinstance(item, ast.Name) and isinstance(item.ctx, ast.Store):
                        got.add(item.id)
                    elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store):
                        got.add(item.attr)
    for path in tracked_files():
        if path.suffix in (".cpp", ".h"):
            for m in re.finditer(r"\b(?:struct|class|enum(?: class)?)\s+(\w+)|\b(\w+)\s*\([^;{)]*\)\s*(?:const\s*)?\{",
                                 path.read_text()):
                names.setdefault(m.group(1) or m.group(2), set()).add(str(path.relative_to(ROOT)))
    return names, members


def definitions() -> dict[str, set[str]]:
    return _index()[0]


def class_members() -> dict[str, set[str]]:
    return _index()[1]


@cache
def source_text() -> str:
    return "\n".join(p.read_text(errors="replace") for p in tracked_files() if p != Path(__file__)
                     and p.suffix in (".py", ".cpp", ".h", ".sh", ".toml", ".json", ".yaml", ".yml") or p.name == "Makefile")


@cache
def flags() -> frozenset[str]:
    """Every option an argument parser in the tree declares (the CLI, the benchmarks, the scripts)."""
    return frozenset(re.findall(r"[\"'](--[a-z][\w-]*)[\"']", source_text()))


@cache
def installed_definitions() -> frozenset[str]:
    """Every class and function the project's dependencies (pyproject.toml, torch aside) define."""
    import importlib.metadata as md
    import subprocess
    wanted = set(re.findall(r'^\s*"([A-Za-z][\w.-]*)', (ROOT / "pyproject.toml").read_text(), re.M)) - {"torch"}
    folders = set()
    for name in wanted:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        folders |= {str(dist.locate_file(f.parts[0])) for f in dist.files or () if f.suffix == ".py" and len(f.parts) > 1}
    out = subprocess.run(["grep", "-rhoE", "--include=*.py", r"^\s*(class|def) \w+", *sorted(folders)],
                         capture_output=True, text=True).stdout
    return frozenset(line.split()[-1] for line in out.splitlines())


def elsewhere(name: str) -> bool:
    """A name the standard library, torch or one of the project's dependencies defines."""
    import importlib
    return any(hasattr(importlib.import_module(m), name) for m in STDLIB) or name in installed_definitions()


def file_exists(text: str) -> bool:
    text = text.split("::")[0].rstrip("/")
    if text.startswith(("~", "$", "/")):
        return True  # a place on the user's machine, not in the tree
    if (ROOT / text).exists() or (ROOT / "stratum" / text).exists():
        return True
    return any(str(p.relative_to(ROOT)).endswith("/" + text) or p.name == text for p in tracked_files())


def module_exists(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        try:
            found = importlib.util.find_spec(name) is not None and (i == len(parts) or importlib.util.find_spec(
                ".".join(parts[:i + 1])) is None)
        except ModuleNotFoundError:
            found = True
        if found:
            rest = parts[i:]
            return not rest or rest[-1] in definitions() or rest[-1] in class_members().get(rest[0], ())
    return False


def problems(text: str) -> list[str]:
    """What the span names that does not exist (empty when it is all there or names nothing checkable)."""
    found: list[str] = []
    if FILE.match(text):
        return [] if file_exists(text) else [f"no file {text}"]
    if MODULE.match(text):
        return [] if module_exists(text) else [f"no module or name {text}"]
    if m := LOCATED.match(text):
        ok = file_exists(m["file"]) and m["name"].split(".")[-1] in definitions()
        return [] if ok else [f"no {m['name']} in {m['file']}"]
    if m := CALL.match(text):
        name = m["name"].split(".")[-1]
        return [] if name in definitions() or elsewhere(name) else [f"no function {m['name']}"]
    if m := QUALIFIED.match(text):
        cls, attr = m["cls"], m["attr"]
        if cls in class_members():
            return [] if attr in class_members()[cls] else [f"no {cls}.{attr}"]
        return []
    if CLASS.match(text):
        return [] if text in definitions() or elsewhere(text) else [f"no class {text}"]
    if m := METRIC.match(text):
        base = re.sub(r"_(total|count|sum|bucket)$", "", m.group(0))
        return [] if base in source_text() or m.group(0) in source_text() else [f"no metric {m.group(0)}"]
    if text.startswith("stratum ") or text.startswith("--"):
        found += [f"no flag {f}" for f in FLAG.findall(text) if f not in flags()]
    if not text.startswith(OTHER_TOOLS):
        found += [f"no variable {v}" for v in ENV.findall(text) if v not in source_text()]
    return found


def test_the_checker_catches_what_does_not_exist():
    for made_up in ("stratum/engine/nowhere.py", "stratum.engine.nowhere", "engine/core.py:no_such_function",
                    "no_such_function()", "EngineCore.no_such_method", "NoSuchClass", "stratum serve --no-such-flag",
                    "stratum_no_such_metric_total", "STRATUM_NO_SUCH_VARIABLE"):
        assert problems(made_up), made_up
    for real in ("stratum/engine/core.py", "stratum.engine.core", "engine/core.py:EngineCore", "EngineCore.step",
                 "stratum serve --replicas N", "STRATUM_HOME", "EngineClient"):
        assert not problems(real), real


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_named_things_exist(doc):
    missing = [f"{doc.relative_to(ROOT)}:{line}: `{text}`: {p}" for line, text in spans(doc) for p in problems(text)]
    assert not missing, "\n".join(missing)
