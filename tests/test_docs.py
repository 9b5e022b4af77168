"""Docs that stay true: every module, file, function, class, flag, metric, header, route and environment
variable that docs/*.md and the README name in backticks exists in the tree, where the span says it is.
A rename that leaves a doc behind fails here.

- `engine/core.py:EngineCore.step` is defined in that file (imports define nothing), and the class has the member;
- `stratum.engine.core.EngineCore`, `builder.kv_bytes_per_token`: the module, then the name in it;
- `EngineCore.step`: the class exists, and has the member (its bases' included);
- `Scheduler`, `EngineCore`, `num_cached_tokens`, `build_prompt()`: defined somewhere outside a function's body
  (a local variable is no definition), or read by the code as a string or parameter (a JSON field, a GGUF key),
  or defined by the standard library or a dependency;
- `kQ4K`, `Simd::dot`, `REPACK_TYPES`: a word of the C++ (or, for a constant, of any source).
"""

from __future__ import annotations

import ast
import importlib.util
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
SOURCES = ("stratum", "scripts", "tests", ".ci", "deploy")
FILE = re.compile(r"^[\w./~$-]*\w\.(py|cpp|h|sh|md|json|toml|txt|png|gguf)(::\w+)?$|^[\w.-]+(/[\w.-]+)*/$"
                  r"|^(stratum|tests|docs|scripts|deploy)(/[\w.-]+)+$")
LOCATED = re.compile(r"^(?P<file>[\w/]+\.(py|cpp|h)):(?P<name>[A-Za-z_][\w.]*)$")
CALL = re.compile(r"^(?P<name>[A-Za-z_][\w.]*)\((.*)\)$")
DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
CLASS = re.compile(r"^[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*$")  # `Scheduler`, `EngineCore`; not `LLM`, `Q4_K`, `POST`
SNAKE = re.compile(r"^_*[a-z][a-z0-9]*(_[a-z0-9]+)*_*$")  # `num_cached_tokens`, `_update`; one word: `attend`
CPP_CONSTANT = re.compile(r"^k[A-Z][A-Za-z0-9]*$")  # `kQ4K`, `kDot8`: C++ constants and enum members
SCOPED = re.compile(r"^(?!std::)(\w+)::(\w+)$")  # `Simd::dot`
CONSTANT = re.compile(r"^(?!STRATUM_)[A-Z][A-Z0-9]*(_[A-Z0-9]+)+$")  # `REPACK_TYPES`, `Q4_K_M`, `MADV_DONTNEED`
FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")
METRIC = re.compile(r"^stratum_[a-z_]+(?=\{|\*|$)")
HEADER = re.compile(r"^x-stratum-[a-z-]+(?=:|$)", re.I)
ROUTE = re.compile(r"^(?:(?:GET|POST|DELETE) )?(/[\w/{}.-]+)$")
ENV = re.compile(r"\$?(STRATUM_[A-Z_]+)")
STDLIB = ("builtins", "os", "mmap", "random", "math", "time", "json", "torch")
# Names no code of the tree spells: Anthropic-defined tool types, named as examples (the server takes every
# `type` but a custom tool's alike); GGUF tokenizer models the loader refuses (it names whatever it finds);
# x86 instructions the kernels do without
NOT_CODE = frozenset({"web_search_20250305", "bash_20250124", "mcp_toolset", "t5", "bert", "rwkv", "vpshufb",
                      "vpunpck"})
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


@dataclass
class Module:
    """What one source file defines: its module-level names (functions, classes, assignments; imports
    apart, as they define nothing), the functions and classes nested in functions (a route's handler;
    not the variables beside them), what it imports, and each class's members."""
    names: set[str] = field(default_factory=set)
    nested: set[str] = field(default_factory=set)  # functions and classes defined inside a function
    imported: set[str] = field(default_factory=set)
    classes: dict[str, set[str]] = field(default_factory=dict)
    bases: dict[str, list[str]] = field(default_factory=dict)


def _targets(node: ast.AST) -> list[str]:
    """The plain names an assignment target binds (`a`, `a, b`), not subscripts or attributes."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for elt in node.elts for n in _targets(elt)]
    return []


def _bound(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [stmt.name]
    if isinstance(stmt, ast.Assign):
        return [n for t in stmt.targets for n in _targets(t)]
    if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        return _targets(stmt.target)
    return []


def _body(stmts: list[ast.stmt]):
    """The statements of one scope, through if / try / with / for blocks, not into functions or classes."""
    for stmt in stmts:
        yield stmt
        if isinstance(stmt, (ast.If, ast.Try, ast.With, ast.For, ast.While, getattr(ast, "TryStar", ast.Try))):
            for block in ("body", "orelse", "finalbody"):
                yield from _body(getattr(stmt, block, []))
            for handler in getattr(stmt, "handlers", []):
                yield from _body(handler.body)


def _class(node: ast.ClassDef, module: Module) -> None:
    members = module.classes.setdefault(node.name, set())
    module.bases[node.name] = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                               if isinstance(b, (ast.Name, ast.Attribute))]
    for stmt in _body(node.body):
        members.update(_bound(stmt))
        if isinstance(stmt, ast.ClassDef):
            _class(stmt, module)
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):  # what a method sets on self
            members.update(n.attr for n in ast.walk(stmt) if isinstance(n, ast.Attribute)
                           and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) and n.value.id == "self")


def _python_module(tree: ast.Module) -> Module:
    module = Module()
    for stmt in _body(tree.body):
        module.names.update(_bound(stmt))
        if isinstance(stmt, ast.ClassDef):
            _class(stmt, module)
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            module.imported.update((a.asname or a.name).split(".")[0] for a in stmt.names)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            module.nested.update(n.name for n in ast.walk(node) if n is not node and isinstance(
                n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
    return module


CPP_NAME = re.compile(r"\b(?:struct|class|enum(?: class)?|namespace)\s+(\w+)|\b(\w+)\s*\([^;{)]*\)\s*(?:const\s*)?\{"
                      r"|\bconstexpr\s+[\w:<>]+\s+(\w+)\s*[=({]|^#define\s+(\w+)", re.M)


@cache
def modules() -> dict[str, Module]:
    """Each source file (path from the root) -> what it defines."""
    out = {}
    for path in python_files():
        rel = str(path.relative_to(ROOT))
        out[rel] = _python_module(ast.parse(path.read_text(), rel))
    for path in tracked_files():
        if path.suffix in (".cpp", ".h"):
            found = {next(g for g in m.groups() if g) for m in CPP_NAME.finditer(path.read_text())}
            out[str(path.relative_to(ROOT))] = Module(names=found)
    return out


@cache
def definitions() -> frozenset[str]:
    """Every name the tree defines outside a function's body: module-level names, classes and their
    members (methods, class attributes, dataclass fields, what methods set on self), C++ functions,
    structs, enums and constants. A function's local variables are not among them."""
    out: set[str] = set()
    for module in modules().values():
        out |= module.names | module.nested
        for cls, members in module.classes.items():
            out |= members | {cls}
    return frozenset(out)


@cache
def class_members() -> dict[str, set[str]]:
    """Each Python class name -> its members, those of its bases in the tree included; a class that extends
    another package's (`Stratum(anthropic.Anthropic)`) is left out, as what it has is not all here."""
    own: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for module in modules().values():
        for cls, members in module.classes.items():
            own.setdefault(cls, set()).update(members)
            bases.setdefault(cls, []).extend(module.bases.get(cls, []))

    def members(cls: str, seen: frozenset[str] = frozenset()) -> set[str] | None:
        got = set(own.get(cls, ()))
        for base in bases.get(cls, ()):
            if base not in own and base not in ("object", "Protocol", "NamedTuple", "Enum", "IntEnum", "StrEnum",
                                                "Exception", "BaseModel", "TypedDict", "Generic"):
                return None  # a subclass of another package's class: its members are that class's too
            if base not in seen and (inherited := members(base, seen | {cls})) is None:
                return None
            elif base not in seen:
                got |= inherited
        return got
    return {cls: got for cls in own if (got := members(cls)) is not None}


@cache
def _read_names() -> tuple[frozenset[str], frozenset[str]]:
    """The strings the code reads and writes (JSON fields, event types, GGUF keys: Python's string
    constants, and what C++, JavaScript, HTML and JSON quote); and the parameters of its functions and
    the keywords its calls pass."""
    strings: set[str] = set()
    parameters: set[str] = set()
    for path in python_files():
        if path == Path(__file__):
            continue  # the made-up names of the test below
        test = path.relative_to(ROOT).parts[0] == "tests"  # what the tests send is not what the code reads
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) < 200 and not test:
                strings.add(node.value)
            elif isinstance(node, ast.keyword) and node.arg:
                parameters.add(node.arg)
            elif isinstance(node, ast.arg):
                parameters.add(node.arg)
    strings.update(re.findall(r"[\"']([\w.-]+)[\"']", "\n".join(
        p.read_text(errors="replace") for p in tracked_files() if p.suffix in (".cpp", ".h", ".js", ".html", ".json"))))
    return frozenset(strings), frozenset(parameters)


def strings() -> frozenset[str]:
    return _read_names()[0]


def known(name: str) -> bool:
    """A name the tree defines, reads as a string or takes as a parameter, or that a dependency defines."""
    return name in definitions() or name in strings() or name in _read_names()[1] or elsewhere(name)


@cache
def source_text() -> str:
    return "\n".join(p.read_text(errors="replace") for p in tracked_files() if p != Path(__file__)
                     and p.suffix in (".py", ".cpp", ".h", ".sh", ".toml", ".json", ".yaml", ".yml")
                     or p.name == "Makefile")


@cache
def words(*suffixes: str) -> frozenset[str]:
    """Every word of the tree's files of those kinds, comments included."""
    return frozenset(w for p in tracked_files() if p.suffix in suffixes and p != Path(__file__)
                     for w in re.findall(r"\w+", p.read_text(errors="replace")))


@cache
def flags() -> frozenset[str]:
    """Every option an argument parser in the tree declares (the CLI, the benchmarks, the scripts)."""
    return frozenset(re.findall(r"[\"'](--[a-z][\w-]*)[\"']", source_text()))


@cache
def installed_definitions() -> frozenset[str]:
    """Every class and function the project's dependencies (pyproject.toml, torch aside) define outside
    their private packages."""
    import importlib.metadata as md
    import subprocess
    wanted = set(re.findall(r'^\s*"([A-Za-z][\w.-]*)', (ROOT / "pyproject.toml").read_text(), re.M)) - {"torch"}
    folders = set()
    for name in wanted:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        folders |= {str(dist.locate_file(f.parts[0])) for f in dist.files or ()
                    if f.suffix == ".py" and len(f.parts) > 1}
    out = subprocess.run(["grep", "-rHoE", "--include=*.py", r"^\s*(class|def) \w+", *sorted(folders)],
                         capture_output=True, text=True).stdout
    # a private package's (`ray/llm/_internal/`) or a test's classes are no API a doc names
    private = re.compile(r"/(_(?!_)\w*|tests?)/")
    return frozenset(line.split()[-1] for line in out.splitlines() if not private.search(line.split(":", 1)[0]))


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
    return any(str(p.relative_to(ROOT)).endswith("/" + text) or p.name == text
               or f"/{p.relative_to(ROOT).parent}/".find(f"/{text}/") >= 0 for p in tracked_files())


def located(text: str) -> list[str]:
    """The source files a path names: from the root, from stratum/, or as the tail of a path in the tree."""
    return [rel for rel in modules() if rel == text or rel == f"stratum/{text}" or rel.endswith(f"/{text}")]


def _module_file(parts: list[str]) -> str | None:
    """The source file of a dotted module path (`stratum.engine.core`, `stratum.engine`), if it is one."""
    base = "/".join(parts)
    for rel in (f"{base}.py", f"{base}/__init__.py"):
        if rel in modules():
            return rel
    return None


def _member_exists(module: Module, parts: list[str], imports: bool) -> bool:
    """`parts[0]` is defined in the module (or imported into it, where `imports`: a module's attribute;
    else nested in one of its functions: a file's definition), and `parts[1]`, where there is one, is a
    member of that class; what lies beyond is an attribute of an attribute, unchecked."""
    if parts[0] not in module.names and parts[0] not in (module.imported if imports else module.nested):
        return False
    if len(parts) > 1 and parts[0] in module.classes and parts[0] in class_members():
        return parts[1] in class_members()[parts[0]]
    return True


def _resolves(package: list[str], parts: list[str]) -> bool:
    """`package.parts...` names a module of the tree, or a name defined in (or imported into) one."""
    for i in range(len(parts) + 1):
        rel = _module_file(package + parts[:i])
        if rel is None:
            return False
        rest = parts[i:]
        if not rest:
            return True
        if _module_file(package + parts[:i + 1]) is None:
            return _member_exists(modules()[rel], rest, imports=True)
    return False


def _module_starts(name: str) -> list[list[str]]:
    """The dotted paths of every module or package of the tree whose last part is `name` (`builder`:
    stratum/engine/builder.py)."""
    out = []
    for rel in modules():
        if rel.endswith(".py"):
            parts = rel[:-3].split("/")
            if parts[-1] == "__init__":
                parts.pop()
            if parts and parts[-1] == name:
                out.append(parts)
    return out


def dotted_problems(text: str) -> list[str]:
    """`stratum.engine.core`, `engine.core.EngineCore`, `builder.kv_bytes_per_token`, `EngineCore.step`,
    `output_config.effort`: each part is where the one before it says."""
    parts = text.split(".")
    if all(p.isupper() for p in parts):
        return []  # a placeholder: `NAMESPACE.NAME`
    if text in strings() or all(p in strings() for p in parts):
        return []  # a key the code reads whole (`tokenizer.ggml.add_bos_token`) or a JSON path (`usage.input_tokens`)
    if parts[0] == "stratum":
        return [] if _resolves(["stratum"], parts[1:]) else [f"no module or name {text}"]
    if CLASS.match(parts[0]):
        cls, attr = parts[0], parts[1]
        if cls in class_members():
            return [] if attr in class_members()[cls] else [f"no {cls}.{attr}"]
        return [] if cls in definitions() or elsewhere(cls) else [f"no class {cls}"]
    if starts := _module_starts(parts[0]):
        return ([] if any(_resolves(start, parts[1:]) for start in starts)
                else [f"no {'.'.join(parts[1:])} in {parts[0]}"])
    if importlib.util.find_spec(parts[0]) is not None:
        return []  # another package's module: `torch.ops`, `os.environ`
    return [f"no {p} (in {text})" for p in parts if not known(p)]


def problems(text: str) -> list[str]:
    """What the span names that does not exist (empty when it is all there or names nothing checkable)."""
    found: list[str] = []
    if FILE.match(text):
        return [] if file_exists(text) else [f"no file {text}"]
    if m := LOCATED.match(text):
        parts, files = m["name"].split("."), located(m["file"])
        ok = any(_member_exists(modules()[rel], parts, imports=False) for rel in files)
        return [] if ok else [f"no {m['name']} in {m['file']}" if files else f"no file {m['file']}"]
    if m := CALL.match(text):
        return problems(m["name"]) if "." in m["name"] or m["name"] in definitions() or elsewhere(m["name"]) \
            else [f"no function {m['name']}"]
    if m := METRIC.match(text):
        base = re.sub(r"_(total|count|sum|bucket)$", "", m.group(0))
        return [] if base in source_text() or m.group(0) in source_text() else [f"no metric {m.group(0)}"]
    if m := HEADER.match(text):
        return [] if m.group(0).lower() in source_text().lower() else [f"no header {m.group(0)}"]
    if m := ROUTE.match(text):
        pieces = [p for p in re.split(r"\{\w+\}", m.group(1)) if p.strip("/")]  # `/v1/responses/{id}`: both sides
        return [] if all(p in source_text() for p in pieces) else [f"no route {m.group(1)}"]
    if DOTTED.match(text):
        return dotted_problems(text)
    if CLASS.match(text):
        return [] if text in definitions() or elsewhere(text) else [f"no class {text}"]
    if SNAKE.match(text):  # one lowercase word may also be an instruction the C++ names (`vpmaddwd`)
        return [] if known(text) or text in NOT_CODE or ("_" not in text and text in words(".cpp", ".h")) \
            else [f"no name {text}"]
    if CPP_CONSTANT.match(text):
        return [] if text in words(".cpp", ".h") else [f"no C++ constant {text}"]
    if m := SCOPED.match(text):
        return [] if {m[1], m[2]} <= words(".cpp", ".h") else [f"no C++ name {text}"]
    if CONSTANT.match(text):
        return [] if text in words(".py", ".cpp", ".h", ".sh") else [f"no constant {text}"]
    if text.startswith("stratum ") or text.startswith("--"):
        found += [f"no flag {f}" for f in FLAG.findall(text) if f not in flags()]
    if not text.startswith(OTHER_TOOLS):
        found += [f"no variable {v}" for v in ENV.findall(text) if v not in source_text()]
    return found


LOCAL = "is_continuation"  # a variable of server/chat.py:build_prompt, defined nowhere else


def test_the_checker_catches_what_does_not_exist():
    for made_up in ("stratum/engine/nowhere.py", "stratum.engine.nowhere", "engine/core.py:no_such_function",
                    "no_such_function()", "EngineCore.no_such_method", "NoSuchClass", "stratum serve --no-such-flag",
                    "stratum_no_such_metric_total", "STRATUM_NO_SUCH_VARIABLE",
                    # a name that exists, but not in the file named; a module's missing name; an unknown class
                    "server/app.py:LLMEngine", "server/app.py:EngineCore", "engine/loop.py:build_prompt",
                    "builder.no_such_function", "NoSuchClass.method", "stratum.engine.core.no_such_function",
                    "no_such_name", "Nowhere", "kNoSuchConstant", "Simd::no_such", "NO_SUCH_CONSTANT",
                    LOCAL):
        assert problems(made_up), made_up
    for real in ("stratum/engine/core.py", "stratum.engine.core", "engine/core.py:EngineCore", "EngineCore.step",
                 "stratum serve --replicas N", "STRATUM_HOME", "EngineClient", "server/chat.py:build_prompt",
                 "builder.kv_bytes_per_token", "Scheduler", "kv_bytes_per_token", "stop_reason", "kQ4K", "Simd::dot",
                 "vpmaddwd", "engine/process.py:EngineProcess.send"):
        assert not problems(real), real


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_named_things_exist(doc):
    missing = [f"{doc.relative_to(ROOT)}:{line}: `{text}`: {p}" for line, text in spans(doc) for p in problems(text)]
    assert not missing, "\n".join(missing)
