"""docs/ARCHITECTURE.md names every module of the package, tests/README.md every test file (in
every folder of tests/); neither names one that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

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
