"""docs/ARCHITECTURE.md names every module of the package, tests/README.md every test file (in
every folder of tests/); neither names one that does not exist. The package's imports form no
circle and go down its floors only; a lower floor calls up only through the protocols
CALLBACKS_UP lists; its exceptions are all in errors.py, under one base."""

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
    {"errors", "_sizes", "_arguments", "_renamed", "_dcp_frames"},
    {"_format", "format"},
    {"_memory", "_cuda", "_io", "_workers"},
    {"_engine", "_stats", "_mismatch"},
    {"_jobs"},
    {"_writer", "_reader", "_guard"},
    {"tiers"},
    {"_cli", "integrations", "__main__", "__init__"},
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


def _imported(node: ast.AST, here: list[str]) -> list[tuple[str, list[str]]]:
    """What ``node`` imports, as (module, names): an ``import``, a ``from ... import``, or a
    lazy ``importlib.import_module("...")`` / ``__import__("...")`` of a literal name; ``here``
    is the package of the module it is in (for relative names)."""
    if isinstance(node, ast.Import):
        return [(a.name, []) for a in node.names]
    if isinstance(node, ast.ImportFrom):
        return [(_absolute(node.module or "", node.level, here), [a.name for a in node.names])]
    func = getattr(node, "func", None)
    called = getattr(func, "attr", getattr(func, "id", None))
    args = getattr(node, "args", [])
    if called in ("import_module", "__import__") and args and isinstance(args[0], ast.Constant) \
            and isinstance(args[0].value, str):
        text = args[0].value
        return [(_absolute(text.lstrip("."), len(text) - len(text.lstrip(".")), here), [])]
    return []


def _absolute(module: str, level: int, here: list[str]) -> str:
    if not level:
        return module
    return ".".join(here[:len(here) - level + 1] + ([module] if module else []))


def _deps(source: str, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The package's modules that module ``name`` (its ``source``) imports: every import in
    it, at any depth (in functions, under ``TYPE_CHECKING``, lazy ones of a literal name); a
    name imported from a package counts as its module where it is one, else as the package."""
    here = name.split(".") if is_package else name.split(".")[:-1]
    deps = set()
    for node in ast.walk(ast.parse(source)):
        for base, names in _imported(node, here):
            if base.split(".")[0] != "dcp_datastates":
                continue
            for imported in names or [""]:
                target = f"{base}.{imported}" if f"{base}.{imported}" in modules else base
                while target not in modules:
                    target = target.rsplit(".", 1)[0]
                deps.add(target)
    return deps - {name}


def _import_graph() -> dict[str, set[str]]:
    """Each module of the package, with the package's modules it imports (:func:`_deps`)."""
    modules = _modules()
    return {name: _deps(path.read_text(), name, is_package, set(modules))
            for name, (path, is_package) in modules.items()}


def _reachable(graph: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every module ``start`` imports, directly or not, with a shortest path of imports to it
    (``start`` itself where it is on a circle)."""
    paths: dict[str, list[str]] = {}
    todo = [[start]]
    while todo:
        path = todo.pop(0)
        for dep in sorted(graph[path[-1]]):
            if dep not in paths:
                paths[dep] = path + [dep]
                todo.append(paths[dep])
    return paths


def _circles(graph: dict[str, set[str]]) -> list[str]:
    """Every circle of imports: one for each group of modules that import one another,
    directly or not (each is named by a shortest circle through its first module)."""
    reach = {m: _reachable(graph, m) for m in graph}
    circles: dict[frozenset[str], str] = {}
    for module in sorted(graph):
        if module in reach[module]:
            group = frozenset(m for m in reach[module] if module in reach[m])
            circles.setdefault(group, " -> ".join(reach[module][module]))
    return list(circles.values())


def _floor(module: str) -> int:
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else "__init__"
    return next(i for i, floor in enumerate(FLOORS) if key in floor)


def test_the_import_graph_counts_imports_in_functions_and_lazy_ones() -> None:
    source = ("import os\nimport importlib\ndef f():\n    from ..tiers import _slots\n"
              "    importlib.import_module('dcp_datastates._cli.verify')\n"
              "    return __import__('dcp_datastates._writer')\n")
    modules = {"dcp_datastates", "dcp_datastates._jobs", "dcp_datastates._jobs.save",
               "dcp_datastates.tiers", "dcp_datastates.tiers._slots", "dcp_datastates._cli",
               "dcp_datastates._cli.verify", "dcp_datastates._writer"}
    assert _deps(source, "dcp_datastates._jobs.save", False, modules) == {
        "dcp_datastates.tiers._slots", "dcp_datastates._cli.verify", "dcp_datastates._writer"}


def test_every_circle_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert _circles(graph) == ["a -> b -> c -> a", "d -> e -> d"]


def test_the_imports_form_no_circle() -> None:
    circles = _circles(_import_graph())
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_every_module_is_on_a_floor_and_imports_none_above() -> None:
    graph = _import_graph()
    unplaced = sorted(({m.split(".")[1] for m in graph if "." in m} | {"__init__"})
                      - set().union(*FLOORS))
    assert not unplaced, f"folders or modules on no floor of FLOORS: {unplaced}"
    upward = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                    if _floor(d) > _floor(m))
    assert not upward, "imports from a higher floor:\n" + "\n".join(upward)


#: Where a lower floor calls up: a protocol of its own that a class of a higher floor
#: implements ("protocol <- class", under the package), and why. No import goes up, but these
#: calls do; a new one fails until it is listed here with its reason.
CALLBACKS_UP = {
    "_engine.Work <- _jobs.load.LoadJob": "the engine's close() waits for the loads in progress "
                                        "and ends them: it frees what they read into",
    "_engine.Work <- _jobs.ordering.SaveOrder": "the same for the saves in progress",
    "_engine.Work <- tiers._unclosed.Unclosed": "the same for a manager not closed",
    "_engine.Saves <- _jobs.ordering.SaveOrder": "one save order per engine, shared by its "
                                               "writers: the engine's order_after_staging (the "
                                               "guard's wait) asks it",
    "_guard.SnapshotSource <- tiers._manager.CheckpointManager": "guard(optimizer, source="
                                                               "manager): the manager counts "
                                                               "the guard's waits in its budget",
    "_jobs.load.ItemSink <- _cli.reads.Planner": "the load job hands items to DCP's load planner, "
                                               "or to the commands' stand-in for one",
    "_jobs.snapshot.SnapshotTarget <- tiers._slots.Slot": "a managed save goes tiers -> writer -> "
                                                        "jobs, whose snapshot goes back into "
                                                        "the tier's slot (issue 50: an explicit "
                                                        "save job that the manager calls would "
                                                        "take the slot as an argument)",
    "_jobs.snapshot.SnapshotTarget <- tiers._slots.NextSlot": "the same, for a slot to come free",
}


def _members(item: ast.stmt) -> set[str]:
    """The members a statement of a class's body gives it: a method, a class attribute, or
    the attributes a method sets on ``self``."""
    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
        return {item.name} | {n.attr for n in ast.walk(item) if isinstance(n, ast.Attribute)
                              and isinstance(n.ctx, ast.Store)
                              and getattr(n.value, "id", None) == "self"}
    targets = [item.target] if isinstance(item, ast.AnnAssign) else getattr(item, "targets", [])
    return {t.id for t in targets if isinstance(t, ast.Name)}


def _classes() -> dict[str, tuple[set[str], bool]]:
    """Every class of the package ("module.Class", under the package): its members (methods,
    class attributes, attributes set on ``self``, those of the package's classes it derives
    from) and whether it is a ``Protocol``."""
    found: dict[str, tuple[set[str], list[str]]] = {}
    for name, (path, _) in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                members = set().union(*(_members(item) for item in node.body))
                bases = [getattr(b, "id", getattr(b, "attr", "")) for b in node.bases]
                found[f"{name.removeprefix('dcp_datastates.')}.{node.name}"] = (
                    {m for m in members if not m.startswith("__")}, bases)

    def members(key: str) -> set[str]:
        own, bases = found[key]
        return own.union(*(members(k) for k in found for b in bases
                           if k.endswith(f".{b}") and k != key))

    return {k: (members(k), "Protocol" in found[k][1]) for k in found}


def _floor_of(key: str) -> int:
    return _floor("dcp_datastates." + key.rsplit(".", 1)[0])


def test_no_lower_floor_calls_up_but_through_the_listed_protocols() -> None:
    classes = _classes()
    protocols = {k: m for k, (m, is_protocol) in classes.items() if is_protocol and m}
    up = {f"{p} <- {c}" for p, needs in protocols.items() for c, (has, is_protocol) in
          classes.items() if not is_protocol and needs <= has and _floor_of(c) > _floor_of(p)}
    assert sorted(up - set(CALLBACKS_UP)) == [], "calls up through a protocol, not listed"
    assert sorted(set(CALLBACKS_UP) - up) == [], "CALLBACKS_UP lists a call that is gone"


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


#: What reads a call stack: DCP's frames are read in _dcp_frames.py alone (issue 50).
FRAME_READS = re.compile(r"\b(_getframe|_current_frames|currentframe|f_locals|f_back|tb_frame)\b"
                         r"|inspect\.(stack|trace)\b")


def test_only_dcp_frames_reads_the_call_stack() -> None:
    found = sorted(f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
                   for path in PACKAGE.rglob("*.py") if path.name != "_dcp_frames.py"
                   for number, line in enumerate(path.read_text().splitlines(), 1)
                   if FRAME_READS.search(line))
    assert not found, "call-stack reads outside dcp_datastates/_dcp_frames.py:\n" + "\n".join(found)
