"""docs/ARCHITECTURE.md names every module of the package, tests/README.md every test file (in
every folder of tests/); neither names one that does not exist. The package's imports form no
circle and go down its floors only; its exceptions are all in errors.py, under one base."""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import dcp_datastates
from dcp_datastates import errors

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dcp_datastates"


def test_every_module_has_its_row_and_every_row_its_module() -> None:
    rows = set(re.findall(r"^\| `([\w/]+\.py)` \|", (ROOT / "docs" / "ARCHITECTURE.md").read_text(),
                          re.M))
    modules = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
               if p.name != "__init__.py" and "__pycache__" not in p.parts}
    assert modules - rows == set(), "modules missing from docs/ARCHITECTURE.md"
    assert rows - modules == set(), "rows of docs/ARCHITECTURE.md naming no module"


def test_every_test_file_has_its_row_in_the_tests_readme() -> None:
    """Rows name files by their path under tests/ (``jobs/test_fence.py``); basenames are unique
    across the folders (pytest imports each test file by its basename)."""
    tests = ROOT / "tests"
    rows = set(re.findall(r"^\| `((?:\w+/)*test_\w+\.py)` \|", (tests / "README.md").read_text(),
                          re.M))
    found = [p.relative_to(tests) for p in tests.rglob("test_*.py")
             if "__pycache__" not in p.parts]
    files = {p.as_posix() for p in found}
    assert files - rows == set(), "test files missing from tests/README.md"
    assert rows - files == set(), "rows of tests/README.md naming no file"
    names = [p.name for p in found]
    assert sorted({n for n in names if names.count(n) > 1}) == [], "test files of the same name"


#: The package's floors, lowest first, as docs/ARCHITECTURE.md draws them: by folder, or by
#: module at the top level ("__init__" is the package itself).
FLOORS = [
    {"errors", "sizes", "arguments", "renamed"},
    {"format"},
    {"memory", "cuda", "io", "workers"},
    {"engine", "stats", "mismatch"},
    {"jobs"},
    {"writer", "reader", "guard"},
    {"tiers"},
    {"cli", "integrations", "__main__", "__init__"},
]


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package by dotted name, with its file and whether it is a package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _import_graph() -> dict[str, set[str]]:
    """Each module's imports of the package's modules: every ``import`` and ``from ... import``
    in it, at any depth (in functions, under ``TYPE_CHECKING``); a name imported from a package
    counts as its module where it is one, else as the package."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                bases = [(a.name, []) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
                bases = [(base, [a.name for a in node.names])]
            else:
                continue
            for base, names in bases:
                if base.split(".")[0] != "dcp_datastates":
                    continue
                for imported in names or [""]:
                    target = f"{base}.{imported}" if f"{base}.{imported}" in modules else base
                    while target not in modules:
                        target = target.rsplit(".", 1)[0]
                    deps.add(target)
        deps.discard(name)
        graph[name] = deps
    return graph


def _floor(module: str) -> int:
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else "__init__"
    return next(i for i, floor in enumerate(FLOORS) if key in floor)


def test_the_imports_form_no_circle() -> None:
    graph = _import_graph()
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done

    def walk(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep] if dep in path else [module, dep]
            if dep not in state and (circle := walk(dep, path + [dep])) is not None:
                return circle
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (circle := walk(module, [module])) is not None:
            raise AssertionError(f"import circle: {' -> '.join(circle)}")


def test_every_module_is_on_a_floor_and_imports_none_above() -> None:
    graph = _import_graph()
    unplaced = sorted(({m.split(".")[1] for m in graph if "." in m} | {"__init__"})
                      - set().union(*FLOORS))
    assert not unplaced, f"folders or modules on no floor of FLOORS: {unplaced}"
    upward = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                    if _floor(d) > _floor(m))
    assert not upward, "imports from a higher floor:\n" + "\n".join(upward)


def test_every_exception_is_in_errors_under_one_base() -> None:
    defined = {}
    for name, (path, _) in _modules().items():
        for node in ast.parse(path.read_text()).body:
            bases = {b.id for b in getattr(node, "bases", []) if isinstance(b, ast.Name)}
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and any(
                    isinstance(getattr(builtins, b, None), type)
                    and issubclass(getattr(builtins, b), BaseException)
                    or b in errors.__all__ for b in bases):
                defined[node.name] = name
    elsewhere = {c: m for c, m in defined.items() if m != "dcp_datastates.errors"}
    assert not elsewhere, f"public exceptions outside errors.py: {elsewhere}"
    assert set(errors.__all__) == set(defined)
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.DataStatesError), name
        assert getattr(dcp_datastates, name) is getattr(errors, name), name
        assert name in dcp_datastates.__all__, name
    # the built-in bases they always had: an except written for those still catches them
    assert issubclass(errors.StateDictMismatchError, RuntimeError)
    assert issubclass(errors.StateDictMismatchError, ValueError)
    assert issubclass(errors.UringUnavailable, RuntimeError)
